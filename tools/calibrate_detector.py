"""Kept for old command lines: the same as ``mechmon-calibrate`` (mechmon_megatron/calibrate/cli.py)."""
import sys

from mechmon_megatron.calibrate.cli import main

sys.exit(main())
