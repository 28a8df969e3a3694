"""The example trainer with monitor failures injected on one rank, as they happen on clusters.

    MECHMON_INJECT="read@10,kernel@20" MECHMON_INJECT_RANK=1 MECHMON_INJECT_KIND=oom \\
    MECHMON_DECISIONS=out/decisions python tests/megatron_core/_failure_driver.py <trainer flags>

Phases (where the exception is raised, on ``MECHMON_INJECT_RANK`` only, at the given iteration):

* ``read``: while reading the Q/K weights, before the tensor-parallel gather;
* ``snapshot``: copying the snapshot;
* ``kernel``: the per-head and full-matrix spectra;
* ``router``: summarising the router logits in the training forward;
* ``decision``: the writer rank's detector decision;
* ``write``: the writer rank's scalar writers (``write@*``: at every write);
* ``nan@N`` (all ranks): a NaN in layer 1's Q/K weights after step N's update -- a real alarm;
* ``collective@N``: ``torch.distributed.all_gather`` itself raises at the call (as a communication
  library's own out-of-memory or transport error would), inside the session's step N only: the
  peer is left waiting in the collective. The failing rank writes the wall time of the raise to
  ``$MECHMON_DECISIONS.inject.json``.

``MECHMON_INJECT_KIND``: ``error`` (RuntimeError) or ``oom`` (torch.OutOfMemoryError, what a
CUDA allocation raises). Each rank appends its decisions (iteration, alarm, stop) as JSON lines
to ``$MECHMON_DECISIONS.rank<R>.jsonl``. Only this test helper patches anything; the product
code runs unchanged.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from mechmon_megatron.adapters.megatron_core import sites
from mechmon_megatron.session import checks, host, session, snapshots, writers
from mechmon_megatron.session.decision import WriterDecision

RANK = int(os.environ.get("RANK", "0"))
FAIL_RANK = int(os.environ.get("MECHMON_INJECT_RANK", "1"))
KIND = os.environ.get("MECHMON_INJECT_KIND", "error")
PLAN: dict[str, set] = {}
for item in filter(None, os.environ.get("MECHMON_INJECT", "").split(",")):
    phase, _, at = item.partition("@")
    PLAN.setdefault(phase, set()).add(at if at == "*" else int(at))
STATE = {"iteration": 0, "in_session": False}


def _due(phase: str) -> bool:
    at = PLAN.get(phase, set())
    return RANK == FAIL_RANK and ("*" in at or STATE["iteration"] in at)


def _fail(phase: str) -> None:
    if KIND == "oom":
        raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 2.00 GiB (injected in {phase})")
    raise RuntimeError(f"injected failure in {phase}")


def _wrap(owner, name: str, phase: str) -> None:
    original = getattr(owner, name)

    def wrapped(*args, **kwargs):
        if _due(phase):
            _fail(phase)
        return original(*args, **kwargs)

    setattr(owner, name, wrapped)


def _install() -> None:
    reader_init = sites._AttentionReader.__init__

    def init(self, *args, **kwargs):
        reader_init(self, *args, **kwargs)
        read = self.read_weight

        def read_weight():
            if _due("read"):
                _fail("read")
            return read()

        self.read_weight = read_weight

    sites._AttentionReader.__init__ = init
    all_gather = torch.distributed.all_gather

    def failing_all_gather(*args, **kwargs):
        if STATE["in_session"] and _due("collective"):
            path = os.environ.get("MECHMON_DECISIONS")
            if path:
                with open(f"{path}.inject.json", "w", encoding="utf-8") as f:
                    json.dump({"rank": RANK, "iteration": STATE["iteration"], "time": time.time()}, f)
            _fail("collective")
        return all_gather(*args, **kwargs)

    torch.distributed.all_gather = failing_all_gather
    _wrap(snapshots.SnapshotStore, "take", "snapshot")
    _wrap(checks, "check_heads", "kernel")
    _wrap(checks, "check_full", "kernel")
    _wrap(host, "summarize_routing", "router")
    _wrap(WriterDecision, "_decide", "decision")
    _wrap(writers.WriterGroup, "write_scalars", "write")

    on_step_start = session.MonitoringSession.on_step_start

    def step_start(self, iteration: int):
        STATE["iteration"] = iteration  # the forwards of step `iteration` follow
        return on_step_start(self, iteration)

    session.MonitoringSession.on_step_start = step_start
    on_step_end = session.MonitoringSession.on_step_end
    path = os.environ.get("MECHMON_DECISIONS")

    def step_end(self, iteration: int):
        STATE["iteration"] = iteration
        if iteration in PLAN.get("nan", set()):
            with torch.no_grad():
                for site_reader in self.attention_sites[:1]:
                    weight = site_reader.read_full.__self__.weight
                    weight.view(-1)[0] = float("nan")
        STATE["in_session"] = True
        try:
            decision = on_step_end(self, iteration)
        except session.MechmonStrictError as exc:
            _record(path, {"iteration": iteration, "alarm": False, "stop": str(exc), "families": [],
                           "off": True, "time": time.time()})
            raise
        finally:
            STATE["in_session"] = False
        if self.config.is_check_step(iteration) or decision.alarm:
            _record(path, {"iteration": iteration, "alarm": decision.alarm, "stop": decision.stop,
                           "families": [a.family for a in decision.alerts], "off": self.off is not None,
                           "time": time.time()})
        return decision

    session.MonitoringSession.on_step_end = step_end


def _record(path, row: dict) -> None:
    if path:
        with open(f"{path}.rank{RANK}.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    _install()
    from gpt_trainer.monitored import run

    sys.exit(run())
