"""``python -m mechmon_megatron.calibrate ...`` (the same as ``mechmon-calibrate``)."""

import sys

from mechmon_megatron.calibrate.cli import main

sys.exit(main())
