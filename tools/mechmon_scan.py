"""``python tools/mechmon_scan.py ...``: the same as ``mechmon-scan`` (docs/SCAN.md).

It runs the installed package (``make venv`` installs the checkout editable), like the console script.
"""

import sys

from mechmon_megatron.scan.cli import main

if __name__ == "__main__":
    sys.exit(main())
