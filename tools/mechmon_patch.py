#!/usr/bin/env python
"""Patch a Megatron-LM checkout for mechmon: ``python tools/mechmon_patch.py status|apply|revert DIR``.

The logic lives in ``mechmon_megatron.adapters.megatron_lm.patch_tool`` (console script ``mechmon-patch``;
``check`` is the old name of ``status``). No patch is needed with ``mechmon-run`` (docs/MEGATRON_LM.md).
"""

import sys

from mechmon_megatron.adapters.megatron_lm.patch_tool import main

if __name__ == "__main__":
    sys.exit(main())
