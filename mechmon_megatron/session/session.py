"""The monitoring session: the host's hooks, and the wiring of its pieces.

Host-agnostic: it sees only ``AttentionSite`` / ``RouterSite`` records, a ``Communicator``, the
process's ``CollectiveGuard`` and a ``ScalarWriter``. The host calls, on every rank:

    session.on_train_start(iteration)          # after --load, before the first step
    session.on_step_start(iteration)           # before the forward of step `iteration` (1-based)
    decision = session.on_step_end(iteration)  # after optimizer.step()
    if decision.abort: save a checkpoint on every rank, then
        session.on_abort_checkpoint_saved(iteration, checkpoint_dir); exit(decision.exit_code)

A check at iteration t (t % interval == 0) compares the weights at t with a snapshot from
t - delta. Values are gathered on the writer rank, which runs the detectors and decides; the
decision reaches every rank in one broadcast. The pieces, one job each: ``placement`` (where the
snapshots live, who reports), ``checks`` (snapshot reads and the check's reads and kernels),
``exchange`` (records to the writer, the verdict back), ``decision`` (the writer's detector,
alerts, scalars, webhook), ``launch_lines`` (the writer's start and closing lines),
``saved_state`` (the checkpointed state), ``failures`` (the failure log).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional, Sequence

from mechmon_megatron.detect.null_model import ThresholdAccount
from mechmon_megatron.detect.phase_moments import LATENT_ATTENTION, TrainingSchedule, attention_kind_of
from mechmon_megatron.detect.pooled_cusum import PooledCusumDetector
from mechmon_megatron.session.agreement import agree_collectives
from mechmon_megatron.session.alert import Alert, AlertReport
from mechmon_megatron.session.checks import SiteChecks
from mechmon_megatron.session.collective_guard import CollectiveFailure, CollectiveGuard, CollectivesOff
from mechmon_megatron.session.config import MechmonConfig
from mechmon_megatron.session.decision import WriterDecision, drill_alert
from mechmon_megatron.session.detector_setup import load_detector_design, local_layers, phase_for_job
from mechmon_megatron.session.exchange import RecordExchange
from mechmon_megatron.session.failures import FailureLog, MechmonStrictError, Outcome
from mechmon_megatron.session.host import AttentionSite, Communicator, LocalCommunicator, RouterSite, process_guard
from mechmon_megatron.session.launch_lines import Resumed, announce_arming, close_launch, start_records
from mechmon_megatron.session.log import SESSION, mechmon_log
from mechmon_megatron.session.placement import agreed_store, reports_at_checks
from mechmon_megatron.session.records import Decision, Verdict
from mechmon_megatron.session.saved_state import STATE_VERSION, MonitorState
from mechmon_megatron.session.snapshots import SnapshotStore
from mechmon_megatron.session.webhook import WebhookPoster
from mechmon_megatron.session.writers import ScalarWriter, WriterGroup

log = mechmon_log(SESSION)

__all__ = ["STATE_VERSION", "Decision", "MechmonStrictError", "MonitoringSession"]


class MonitoringSession:
    """Runs the mechanism monitors on one rank. A disabled session does nothing.

    ``guard``: the process's collective guard, which the host looked up once (default: the
    communicator's); ``comm`` (default: one process) and ``writer`` (default: none); ``schedule``:
    the job's learning-rate schedule as the host knows it (None: unknown; the early-phase
    correction is then off and the writer says so)."""

    name = "mechmon"

    def __init__(
        self,
        config: MechmonConfig,
        attention_sites: Sequence[AttentionSite] = (),
        router_sites: Sequence[RouterSite] = (),
        comm: Optional[Communicator] = None,
        writer: Optional[ScalarWriter] = None,
        guard: Optional[CollectiveGuard] = None,
        schedule: Optional[TrainingSchedule] = None,
    ) -> None:
        self.config = config
        self.enabled = config.enabled
        if not self.enabled:
            return
        self.attention_sites = list(attention_sites) if "attn" in config.monitors else []
        self.router_sites = list(router_sites) if "router" in config.monitors else []
        self.comm: Communicator = comm or LocalCommunicator(guard)
        self.rank = int(getattr(self.comm, "global_rank", getattr(self.comm, "rank", 0)))
        self.failures = FailureLog(self.rank, config.strict)
        # Validates the router entropy floors: a floor above E names its flag before training begins.
        self._checks = SiteChecks(config, self.attention_sites, self.router_sites, self.failures)
        self.guard = guard if guard is not None else process_guard(getattr(self.comm, "guard", None))
        self.guard.configure(config.collective_timeout)
        reporting = reports_at_checks(self.attention_sites, self.router_sites) or self.comm.is_writer
        if hasattr(self.comm, "set_reporting"):
            self.comm.set_reporting(reporting)
        self.guard.create_declared()  # every rank: mechmon's own copies of the groups the sites use
        self.off: Optional[str] = None
        """Why the monitors are off on every rank (a monitor collective failed somewhere); None: on."""
        self.last_check_comm: Optional[dict] = None
        """The last check's monitor collectives on this rank (``CommCounter.take``): ``reads`` (the
        weights' gathers, the routers' all-reduces) and ``records`` (the records to the writer and
        the decision back)."""
        self.writer = writer or WriterGroup()
        for router in self.router_sites:
            router.num_bins = config.router_entropy_bins
        self._resumed_from: Resumed = None  # a loaded state marks a resume (records: the same run)
        self._started = False
        self._local_layers = local_layers(config, self.attention_sites, self.router_sites)
        design, tail_table = load_detector_design(config)  # fails here, not mid-run
        self.capturing = False
        self.checkpoints: list[dict] = []  # [{"iteration": i, "path": p}] saved so far
        self.snapshots = agreed_store(config, self.attention_sites, self.comm, self.rank)  # one all-reduce
        self._overhead_s = 0.0
        self._step_start = time.perf_counter()
        self._pending_abort: Optional[Decision] = None
        # Only the writer rank decides, so only it tells people (--mechmon-alert-webhook).
        webhook = WebhookPoster(config.alert_webhook) if (config.alert_webhook and self.comm.is_writer) else None
        attention = attention_kind_of(any(site.attention == LATENT_ATTENTION for site in self.attention_sites))
        self._decision = WriterDecision(config, self.failures, self.writer, design, tail_table, webhook,
                                        phase_for_job(config, tail_table, schedule, attention))
        self._exchange = RecordExchange(self.comm, self.failures, self.rank, self._local_layers, reporting)
        self._closed = False
        self._checks_run = 0  # checks this launch ran (the closing line)

    # ------------------------------------------------------------------ the writer's view
    @property
    def errors(self) -> int:
        """Monitor failures caught on this rank so far (the writer sums them in ``mechmon/errors``)."""
        return self.failures.errors if self.enabled else 0

    @property
    def detector(self) -> Optional[PooledCusumDetector]:  # the writer's, built at the first check
        return self._decision.detector

    @property
    def detector_account(self) -> Optional[ThresholdAccount]:
        return self._decision.detector_account

    @property
    def alerts(self) -> list[Alert]:  # the writer's alarms of this launch so far
        return self._decision.alerts

    # ------------------------------------------------------------------ host hooks
    def on_train_start(self, iteration: int) -> None:
        """Take the first snapshot if the schedule needs one at the starting iteration. The writer
        starts this launch's run in the records and says when the detector arms (once)."""
        if self.enabled and self.comm.is_writer and not self._started:
            self._started = True
            start_records(self.writer, self.config, iteration, self._resumed_from)
            self._decision.arm_step = announce_arming(self.config, self._decision.design, self._local_layers,
                                                      iteration, self._decision.detector_state(), self._resumed_from)
        if self.enabled and self.off is None and self.config.is_snapshot_step(iteration):
            start = time.perf_counter()
            self._checks.take_snapshot(iteration, self.snapshots)
            self._overhead_s += time.perf_counter() - start
            off = self._agree_collectives(iteration)
            if off is not None and off.stop is not None:
                raise MechmonStrictError(off.stop)

    def on_step_start(self, iteration: int) -> bool:
        """Arm router-logit capture for a check step; returns whether capture is on."""
        if not self.enabled or self.off is not None:
            self.capturing = False
            return False
        self.capturing = bool(self.router_sites) and self.config.is_check_step(iteration)
        if self.capturing:
            for router in self.router_sites:
                router.take_summary()  # nothing left over from a check step the host skipped
        return self.capturing

    def stop_capture(self) -> None:
        """The check step's training forwards are done: later forwards (eval) are not captured."""
        if self.enabled:
            self.capturing = False

    def on_step_end(self, iteration: int) -> Decision:
        """Run the check / snapshot due at ``iteration`` and return the agreed decision."""
        if not self.enabled or self.off is not None:
            self.capturing = False
            return Decision(iteration)
        self._step_start = time.perf_counter()
        decision = Decision(iteration)
        cfg = self.config
        drill = cfg.is_drill_step(iteration)
        stale = self.snapshots.drop_stale(iteration)
        if stale:
            log.info("dropped snapshots for check steps %s: their steps were skipped by the host", stale)
        if cfg.is_check_step(iteration):
            self._checks_run += 1
            decision = self._check(iteration, drill)
        elif drill:  # a drill off a check step: every rank knows the step
            alert = self._decision.drill(iteration) if self.comm.is_writer else drill_alert(iteration)
            decision = Decision(iteration, alarm=True, alerts=[alert])
        self.capturing = False
        if cfg.is_snapshot_step(iteration):
            self._checks.take_snapshot(iteration, self.snapshots)
        if cfg.is_check_step(iteration) or cfg.is_snapshot_step(iteration):
            decision = self._agree_collectives(iteration) or decision
        self._overhead_s += time.perf_counter() - self._step_start
        if decision.stop is not None:
            if not (decision.alarm and cfg.action == "checkpoint-and-abort"):
                raise MechmonStrictError(decision.stop)
            # The alarm's checkpoint-and-abort stops every rank anyway, with a checkpoint to roll back to.
            log.error("%s (the alarm's checkpoint-and-abort runs first)", decision.stop)
        if decision.alarm and cfg.action == "checkpoint-and-abort":
            decision.abort = True
            decision.exit_code = cfg.exit_code
            self._pending_abort = decision
        return decision

    def run_host_collective(self, phase: str, iteration: int, fn: Callable[[], Any], what: str) -> Outcome[Any]:
        """A collective the host issues for the monitors (``CollectiveGuard.host_collective``), inside
        the failure log: returns ``fn()``'s value or ``FAILED``. Runs on every rank by the schedule."""
        if not self.enabled:
            return fn()
        return self.failures.run(phase, None, iteration, self.guard.host_collective, fn, what)

    def on_checkpoint_saved(self, iteration: int, path: Optional[str]) -> None:
        """Record a regular checkpoint (for the 'last good checkpoint' in the alert)."""
        if self.enabled:
            self.checkpoints.append({"iteration": int(iteration), "path": path})

    def abort_report(self, iteration: int, checkpoint_dir: Optional[str]) -> AlertReport:
        """The alert record of the abort at ``iteration`` (the same on every rank): written to
        ``mechmon_alert.json`` by the writer, kept in the checkpoint by hosts that hold it there."""
        return AlertReport.of_abort(iteration, self._pending_abort.alerts if self._pending_abort else self.alerts[-1:],
                                    self.checkpoints, checkpoint_dir, self.config.exit_code, self.config.action)

    def on_abort_checkpoint_saved(self, iteration: int, checkpoint_dir: Optional[str]) -> Optional[str]:
        """Write ``mechmon_alert.json`` beside the abort checkpoint (writer rank); return its path."""
        if not self.enabled or not self.comm.is_writer:
            return None
        directory = checkpoint_dir or self.config.log_dir or "."
        path = self.abort_report(iteration, checkpoint_dir).write(directory)
        log.warning("alert written to %s", path)
        return path

    # ------------------------------------------------------------------ state (session/saved_state.py)
    def state_dict(self) -> dict:
        if not self.enabled:
            return {}
        return MonitorState(interval=self.config.interval, delta=self.config.delta,
                            detector=self._decision.detector_state(), checkpoints=tuple(self.checkpoints),
                            errors=self.errors).to_dict()

    def load_state_dict(self, state: dict) -> None:
        """Restore a checkpoint's state (called before ``on_train_start``; it marks this launch a
        resume, which continues its run in the records). A detector built at another delta starts
        afresh; at another interval with the same delta it is kept (``session/saved_state.py`` says
        why); ``on_train_start`` says which happened, with the step the detector arms at."""
        if not self.enabled or not state:
            return
        saved = MonitorState.from_dict(state)
        self._resumed_from = (saved.interval, saved.delta)
        if not saved.detector_reusable:
            log.warning("checkpoint holds detector state of mechmon 0.1 (per-stream rule); the whole-job "
                        "detector re-learns its baselines from the next checks")
        elif saved.delta is not None and saved.delta != self.config.delta:
            self._decision.drop_detector()  # on_train_start says so, with the step it arms again at
        elif saved.detector is not None:
            self._decision.load_detector_state(saved.detector)
        self.checkpoints = list(saved.checkpoints)
        self.failures.errors = saved.errors

    def close(self) -> None:
        """Close the writers and the webhook (once). Never raises: a run that trained to its end
        keeps its exit code when records could not be written (under ``--mechmon-strict`` the
        check whose write failed has already stopped every rank). The writer rank says in one
        line how many record writes failed during the run and at the close, and where."""
        if not self.enabled or self._closed:
            return
        self._closed = True
        close_launch(self.config, self.writer, self._decision.webhook, self.failures, self.comm.is_writer, self.rank,
                     self._checks_run, self.alerts, self.off)

    # ------------------------------------------------------------------ internals
    def _check(self, iteration: int, drill: bool) -> Decision:
        """This rank's reads and kernels, the exchange with the writer, the agreed decision."""
        self.guard.counter.take()  # this check's collectives from here on
        outputs = self._checks.run(iteration, self.snapshots)
        reads = self.guard.counter.take()  # the weights' gathers and the routers' all-reduces
        try:
            verdict = self._exchange.run(
                iteration, outputs, lambda: self._overhead_s + (time.perf_counter() - self._step_start),
                lambda gathered, failures, others: self._decision.verdict(iteration, gathered, failures, others,
                                                                          drill))
        except (CollectiveFailure, CollectivesOff) as exc:
            # This rank is down: the end-of-step agreement turns the monitors off on every rank.
            if isinstance(exc, CollectiveFailure):
                self.failures.record("decision", None, iteration, exc)
            verdict = Verdict()
        self.last_check_comm = {"iteration": int(iteration), "reads": reads, "records": self.guard.counter.take()}
        self._overhead_s = 0.0
        self._step_start = time.perf_counter()  # what follows is counted towards the next check
        alerts = list(verdict.alerts)
        # A drill alarms on every rank even if the writer's decision failed: all know the step.
        if drill and not alerts:
            alerts = [drill_alert(iteration)]
        return Decision(iteration, alarm=verdict.alarm or drill, alerts=alerts, stop=verdict.stop)

    def _agree_collectives(self, iteration: int) -> Optional[Decision]:
        """End of a step with monitor collectives (``session/agreement.py``): when some rank's failed,
        the monitors turn off on every rank -- or, under ``--mechmon-strict``, the returned decision
        stops every rank. A check's ``last_check_comm`` records count the agreement too."""
        self.guard.counter.take()  # the snapshot's reads since the check are not the check's records
        off = agree_collectives(self.guard, self.config, self.rank, iteration)
        agreement = self.guard.counter.take()
        last = self.last_check_comm
        if last is not None and last["iteration"] == iteration:  # the check's end-of-step agreement
            for key in ("sent_bytes", "received_bytes", "seconds", "calls", "messages"):
                last["records"][key] += agreement[key]
        if off is None:
            return None
        self.off = off.cause
        self.capturing = False
        self.snapshots = SnapshotStore(self.snapshots.placement)  # nothing is compared across the gap
        if off.stop is not None:
            return Decision(iteration, stop=off.stop)
        if self.comm.is_writer:  # TensorBoard must say so too: no check will write again
            self._decision.write_off(iteration, self.failures.errors)
        return None
