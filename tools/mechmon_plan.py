"""Per-rank snapshot memory, FLOPs, time and overhead share of the monitors at a frontier shape.

    python tools/mechmon_plan.py --model llama3-70b --tp 8 --pp 4 --dp 32 --json

The same as the ``mechmon-plan`` console script (``mechmon_megatron.plan.cli``); see
docs/PERFORMANCE.md, "Frontier shapes: mechmon-plan".
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mechmon_megatron.plan.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
