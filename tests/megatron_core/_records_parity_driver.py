"""The example trainer, its writer recording the check records both ways (two levels and direct).

    MECHMON_PARITY_OUT=out/parity python tests/megatron_core/_records_parity_driver.py <trainer flags>

At every check each reporting rank sends its payload through both paths of
``TorchDistributedCommunicator``: two levels (the product's path under megatron-core: to the
owner of its tensor-parallel group, then the owners to the writer) and one level (straight to
the writer), in that order on every rank. The writer appends both decoded lists (``repr`` of
each ``Payload``: every number, exact), the path the session took and its byte counts to
``$MECHMON_PARITY_OUT.jsonl``; the session goes on with the two-level list. Only this helper
wraps anything; the product code runs unchanged.
"""

from __future__ import annotations

import json
import os
import sys

from mechmon_megatron.session import host


def _install(prefix: str) -> None:
    def both(self, payload):
        guard = self.guard
        before = dict(vars(guard.counter))
        tiered = self.gather_tiered(payload)
        middle = dict(vars(guard.counter))
        direct = self.gather_direct(payload)
        after = dict(vars(guard.counter))
        if self.is_writer:
            row = {"two_level": self.two_level, "tiered": [repr(p) for p in tiered or []],
                   "direct": [repr(p) for p in direct or []],
                   "tiered_messages": middle["messages"] - before["messages"],
                   "direct_messages": after["messages"] - middle["messages"],
                   "owners": list(guard.tiers(host.REPORTING).leaders.ranks),
                   "reporting": list(guard.members(host.REPORTING).ranks)}
            with open(f"{prefix}.jsonl", "a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")
        return tiered

    host.TorchDistributedCommunicator.gather_reports = both


if __name__ == "__main__":
    _install(os.environ["MECHMON_PARITY_OUT"])
    from gpt_trainer.monitored import run

    sys.exit(run())
