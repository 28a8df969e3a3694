"""Per-rank snapshot memory, FLOPs, time and overhead share of the monitors at a frontier shape.

    python tools/mechmon_plan.py --model llama3-70b --tp 8 --pp 4 --dp 32 --json

The same as the ``mechmon-plan`` console script (``mechmon_megatron.plan.cli``), from the
installed package (``make venv`` installs the checkout editable); see docs/PERFORMANCE.md,
"Frontier shapes: mechmon-plan".
"""

from __future__ import annotations

import sys

from mechmon_megatron.plan.cli import main

if __name__ == "__main__":
    sys.exit(main())
