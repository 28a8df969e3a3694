"""The check's records to the writer rank, and its verdict back to every rank.

1. every rank: its failure and error counts in one all-reduce (two float64);
2. the reporting ranks (and the writer) only: their payloads to the writer, through the owner of
   their tensor-parallel group where the host gives one (``Communicator.gather_reports``);
3. only when some rank failed: every rank's failure records to the writer;
4. every rank: the verdict, one small tensor, plus the alerts when there is an alarm.

The writer's decision itself is ``session/decision.py``; the wire formats are ``session/host.py``
and ``session/payload_codec.py``.
"""

from __future__ import annotations

import pickle
from typing import Callable, Optional

from mechmon_megatron.session.failures import FAILED, FailureLog, PhaseFailure
from mechmon_megatron.session.host import Communicator
from mechmon_megatron.session.records import CheckOutput, Payload, Verdict

WriterVerdict = Callable[[list[Payload], list[PhaseFailure], float], Verdict]
"""The writer's decision from every reporting rank's payload, every rank's failure records of
this check, and the other ranks' cumulative error count."""


class RecordExchange:
    """This rank's side of the exchange at every check.

    ``reporting``: this rank sends a payload (``placement.reports_at_checks``, or the writer);
    ``local_layers``: the layers this rank's sites cover (``detector_setup.local_layers``), sent
    even when its payload could not be built, so the writer's detector knows the job's shape."""

    def __init__(self, comm: Communicator, failures: FailureLog, rank: int, local_layers: dict[str, list[int]],
                 reporting: bool) -> None:
        self.comm = comm
        self.failures = failures
        self.rank = rank
        self.local_layers = local_layers
        self.reporting = reporting

    def run(self, iteration: int, outputs: list[CheckOutput], overhead_s: Callable[[], float],
            decide: WriterVerdict) -> Verdict:
        """The exchange of one check (steps 1-4 of the module docstring); ``decide`` runs on the
        writer only. Raises ``CollectiveFailure`` / ``CollectivesOff`` when a collective failed."""
        payload = self.payload(iteration, outputs, overhead_s)
        failures = self.failures.take()
        errors_now = self.failures.errors
        total_failures, total_errors = self.comm.sum_over_ranks([len(failures), errors_now])
        gathered = self.comm.gather_reports(payload) if self.reporting else None
        every_failure: list[PhaseFailure] = []
        if total_failures > 0:
            per_rank = self.comm.gather_to_writer(failures)
            every_failure = [f for part in per_rank or [] for f in part]
        verdict: Optional[Verdict] = None
        if self.comm.is_writer:
            assert gathered is not None  # the writer receives every reporting rank's payload
            # Errors of the other ranks; the writer's own count grows while it decides.
            verdict = decide(gathered, every_failure, total_errors - errors_now)
        return self.comm.broadcast_verdict(verdict)  # the one decision, on every rank

    def payload(self, iteration: int, outputs: list[CheckOutput], overhead_s: Callable[[], float]) -> Payload:
        """This rank's records for the writer; always picklable (a failed build sends its layers only).
        ``overhead_s``: session time since the previous check (snapshots in between plus this check so far)."""
        def build() -> Payload:
            payload = Payload(
                rank=self.rank,
                layers=self.local_layers,
                scalars=[o.scalars for o in outputs],
                streams=[st for o in outputs for st in o.streams],
                nonfinite=[report for o in outputs for report in o.nonfinite],
                overhead_s=overhead_s(),
            )
            pickle.dumps(payload)  # fail here, under the guard, not inside the gather collective
            return payload

        payload = self.failures.run("payload", None, iteration, build)
        return Payload(rank=self.rank, layers=self.local_layers) if payload is FAILED else payload
