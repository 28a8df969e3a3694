"""``mechmon-supervise``: relaunch a training command after a mechmon abort, with a remedy.

A plain process outside the launcher (standard library only; never torch.distributed, megatron
or deepspeed). It runs the whole launch command; when the command ends with mechmon's abort it
reads ``mechmon_alert.json``, picks the newest checkpoint at or before the detector's change
point, applies the policy's remedy for the alarmed family (the host's own flags) and relaunches
from that checkpoint. It only reads and selects checkpoints: it never deletes or rewrites one.
Every action goes to ``<save>/mechmon_recovery.jsonl``. docs/RECOVERY.md has the details.
"""

from mechmon_megatron.supervise.cli import main

__all__ = ["main"]
