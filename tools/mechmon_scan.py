"""``python tools/mechmon_scan.py ...``: the same as ``mechmon-scan`` (docs/SCAN.md), from a checkout."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mechmon_megatron.scan.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
