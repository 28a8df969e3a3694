"""The example trainer, each rank appending its check's communication counts to a JSONL file.

    MECHMON_COMM_OUT=out/comm torchrun ... tools/_check_comm_driver.py <trainer flags>

After every check step each rank writes ``session.last_check_comm`` (``CommCounter.take``: bytes
sent and received by the monitor collectives of that check, their seconds and calls) to
``$MECHMON_COMM_OUT.rank<R>.jsonl``. Used by tools/bench_check_comm.py; the product runs unchanged.
"""

from __future__ import annotations

import json
import os
import sys

from mechmon_megatron.session import session


def _install(prefix: str) -> None:
    on_step_end = session.MonitoringSession.on_step_end
    rank = os.environ.get("RANK", "0")

    def step_end(self, iteration: int):
        decision = on_step_end(self, iteration)
        if self.config.is_check_step(iteration) and self.last_check_comm is not None:
            with open(f"{prefix}.rank{rank}.jsonl", "a", encoding="utf-8") as f:
                f.write(json.dumps(self.last_check_comm) + "\n")
        return decision

    session.MonitoringSession.on_step_end = step_end


if __name__ == "__main__":
    _install(os.environ["MECHMON_COMM_OUT"])
    from gpt_trainer.monitored import run

    sys.exit(run())
