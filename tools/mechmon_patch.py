#!/usr/bin/env python
"""Patch a Megatron-LM checkout for mechmon: ``python tools/mechmon_patch.py check|apply|revert DIR``.

The logic lives in ``mechmon_megatron.adapters.megatron_lm_patch`` (console script ``mechmon-patch``).
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from mechmon_megatron.adapters.megatron_lm_patch import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
