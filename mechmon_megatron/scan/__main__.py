"""``python -m mechmon_megatron.scan ...`` (the same as ``mechmon-scan``)."""

import sys

from mechmon_megatron.scan.cli import main

sys.exit(main())
