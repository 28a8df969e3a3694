"""The monitoring session: schedule, snapshots, checks, detectors, and the alarm decision.

Host-agnostic: it sees only ``AttentionSite`` / ``RouterSite`` records, a ``Communicator`` and a
``ScalarWriter``. The host calls, on every rank:

    session.on_train_start(iteration)          # after --load, before the first step
    session.on_step_start(iteration)           # before the forward of step `iteration` (1-based)
    decision = session.on_step_end(iteration)  # after optimizer.step()
    if decision.abort: save a checkpoint on every rank, then
        session.on_abort_checkpoint_saved(iteration, checkpoint_dir); exit(decision.exit_code)

A check at iteration t (t % interval == 0) compares the weights at t with a snapshot from
t - delta. Values are gathered on the writer rank, which runs the detectors and decides; the
decision reaches every rank in one broadcast.
"""

from __future__ import annotations

import logging
import math
import pickle
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from mechmon_megatron.detect.pooled_cusum import PooledCusumDetector
from mechmon_megatron.session import collective_guard, names
from mechmon_megatron.session.alert import Alert, AlertReport
from mechmon_megatron.session.attention_check import check_full, check_heads, check_heads_short
from mechmon_megatron.session.config import MechmonConfig
from mechmon_megatron.session.detector_inputs import stream_observation
from mechmon_megatron.session.detector_setup import (
    alert_of,
    arming_line,
    build_detector,
    families_without_signal,
    fed_families,
    held_values,
    job_shape,
    load_detector_design,
    local_layers,
)
from mechmon_megatron.session.failures import (
    FAILED,
    FailureLog,
    MechmonStrictError,
    PhaseFailure,
    QuietMonitors,
    strict_stop_message,
)
from mechmon_megatron.session.host import (
    AttentionSite,
    Communicator,
    LocalCommunicator,
    MLAHeads,
    QKWeights,
    RouterSite,
)
from mechmon_megatron.session.mla_check import check_mla_heads
from mechmon_megatron.session.records import CheckOutput, Payload, Verdict, merge_partials
from mechmon_megatron.session.router_check import empty_vector, local_router_vector, router_output
from mechmon_megatron.session.runs import new_run_id
from mechmon_megatron.session.snapshots import (
    PLACEMENTS,
    SnapshotStore,
    choose_placement,
    describe_budget,
    placement_problem,
    site_bytes,
    snapshot_bytes,
    weights_device,
)
from mechmon_megatron.session.startup import QUIET_SNAPSHOT_SETS
from mechmon_megatron.session.webhook import WebhookPoster
from mechmon_megatron.session.writers import ScalarWriter, WriterGroup

logger = logging.getLogger(__name__)

STATE_VERSION = 2
"""Format of the saved monitor state, not the package version (``mechmon_megatron.__version__``): it
changes only when the format does. 2: the whole-job detector (since 0.2); 1: the per-stream
detector of 0.1 (its baselines are not reused)."""

__all__ = ["Decision", "MechmonStrictError", "MonitoringSession"]


@dataclass
class Decision:
    """What the host must do after a step. ``abort``: save on every rank, then exit."""

    iteration: int
    alarm: bool = False
    abort: bool = False
    exit_code: int = 0
    alerts: list[Alert] = field(default_factory=list)
    stop: Optional[str] = None
    """Set under ``--mechmon-strict`` when a monitor failed on some rank: every rank raises it."""


class MonitoringSession:
    """Runs the mechanism monitors on one rank. A disabled session does nothing."""

    name = "mechmon"

    def __init__(
        self,
        config: MechmonConfig,
        attention_sites: Sequence[AttentionSite] = (),
        router_sites: Sequence[RouterSite] = (),
        comm: Optional[Communicator] = None,
        writer: Optional[ScalarWriter] = None,
    ) -> None:
        self.config = config
        self.enabled = config.enabled
        if not self.enabled:
            return
        self.attention_sites = list(attention_sites) if "attn" in config.monitors else []
        self.router_sites = list(router_sites) if "router" in config.monitors else []
        # Validated here, at start-up: a floor above E names its flag before training begins.
        self._router_floors = [config.router_entropy_floor(s.num_experts, s.topk) for s in self.router_sites]
        self.comm = comm or LocalCommunicator()
        self.rank = int(getattr(self.comm, "global_rank", getattr(self.comm, "rank", 0)))
        self.guard = getattr(self.comm, "guard", None) or collective_guard.guard()
        self.guard.configure(config.collective_timeout)
        self._reporting = self._reports() or self.comm.is_writer
        if hasattr(self.comm, "set_reporting"):
            self.comm.set_reporting(self._reporting)
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
        self.failures = FailureLog(self.rank, config.strict)
        self._quiet = QuietMonitors()  # the writer's: checks at which the monitors did not run
        # Built by the writer at the first check, from every rank's layers (detector_setup).
        self.detector: Optional[PooledCusumDetector] = None
        self.detector_account: Optional[dict] = None
        self._pending_detector_state: Optional[dict] = None
        # (interval, delta) of the monitor state a checkpoint gave this launch (None each when the
        # state predates them); None: nothing loaded, a fresh start (records: a new run).
        self._resumed_from: Optional[tuple[Optional[int], Optional[int]]] = None
        self._arm_step: Optional[int] = None  # predicted at on_train_start (writer)
        self._armed = False  # the "detector armed" line was printed
        self._started = False
        self._local_layers = local_layers(config, self.attention_sites, self.router_sites)
        self._detector_design, self._tail_table = load_detector_design(config)  # fails here, not mid-run
        self._active_warnings: set = set()
        self.capturing = False
        self.checkpoints: list[dict] = []  # [{"iteration": i, "path": p}] saved so far
        self.alerts: list[Alert] = []
        budget = snapshot_bytes(config, self.attention_sites)
        device = weights_device(self.attention_sites)
        self.snapshots = SnapshotStore(self._agreed_placement(config, budget, device))
        # --mechmon-short-window: per site, (check step, leading Delta2 directions of its short
        # window), for the persistence at the next check (2 hidden-size vectors per head).
        self._short_directions: dict[int, tuple[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        if self.attention_sites:
            # Many sets at once (delta >> interval) is a memory cost the user should see, not only read.
            level = logging.WARNING if config.overlap > QUIET_SNAPSHOT_SETS else logging.INFO
            logger.log(level, describe_budget(config, budget, device, self.snapshots.placement, self.rank))
        self._overhead_s = 0.0
        self._step_start = time.perf_counter()
        self._pending_abort: Optional[Decision] = None
        # Only the writer rank decides, so only it tells people (--mechmon-alert-webhook).
        self._webhook: Optional[WebhookPoster] = None
        if config.enabled and config.alert_webhook and self.comm.is_writer:
            self._webhook = WebhookPoster(config.alert_webhook)
        self._closed = False
        self._checks_run = 0  # checks this launch ran (the closing line)

    def _reports(self) -> bool:
        """Whether this rank produces records at a check (a layer's per-head or full-matrix work, a
        router's report): only such ranks send the writer a payload. Known from the layout."""
        for site in self.attention_sites:
            if site.reports is None:
                budget = site.snapshot_budget
                if budget is None or budget.heads_elements or budget.full_elements:
                    return True
            elif site.reports:
                return True
        return any(router.reports for router in self.router_sites)

    def _agreed_placement(self, config: MechmonConfig, budget: Optional[int], device: torch.device) -> str:
        """The job's snapshot placement, after every rank agreed that all can start (one all-reduce).

        Each rank proposes its own placement (``auto``: from its own budget) and says, for every
        placement, whether its snapshots would fit there; the job takes the most conservative
        proposal (``snapshots.PLACEMENTS``), and a rank whose snapshots cannot fit there (or whose
        start-up raised) makes every rank raise the same ``ValueError``, naming that rank, the
        layer and the flag, instead of stopping alone.
        """
        own = 0
        problems: list[Optional[str]]
        try:
            own = PLACEMENTS.index(choose_placement(config, budget, device))
            layers = site_bytes(config, self.attention_sites)
            problems = [placement_problem(config, budget, device, p, layers) for p in PLACEMENTS]
        except Exception as exc:  # noqa: BLE001 -- agreed below, raised on every rank
            failed = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
            problems = [failed] * len(PLACEMENTS)
        agree = getattr(self.comm, "agree_startup", None)
        choice, first = agree(own, problems) if agree is not None else (
            own, None if problems[own] is None else (self.rank, problems[own]))
        if first is not None:
            rank, message = first
            raise ValueError(f"mechmon cannot start on every rank: rank {rank}: {message} (every rank stops)")
        placement = PLACEMENTS[choice]
        if placement == "pinned" and device.type != "cuda":  # page-locked memory needs CUDA here
            placement = "cpu"
        if choice != own:
            logger.info("[mechmon] snapshots: --mechmon-snapshot-device %s is %s on rank %d, %s on another rank: "
                        "every rank uses %s", config.snapshot_device, PLACEMENTS[own], self.rank, placement,
                        placement)
        return placement

    @property
    def errors(self) -> int:
        """Monitor failures caught on this rank so far (the writer sums them in ``mechmon/errors``)."""
        return self.failures.errors if self.enabled else 0

    # ------------------------------------------------------------------ host hooks
    def on_train_start(self, iteration: int) -> None:
        """Take the first snapshot if the schedule needs one at the starting iteration. The writer
        starts this launch's run in the records and says when the detector arms (once)."""
        if self.enabled and self.comm.is_writer and not self._started:
            self._started = True
            self._start_records(iteration)
            self._announce_arming(iteration)
        if self.enabled and self.off is None and self.config.is_snapshot_step(iteration):
            self._timed(self._take_snapshot, iteration)
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
        drill = self.config.is_drill_step(iteration)
        stale = self.snapshots.drop_stale(iteration)
        if stale:
            logger.info("[mechmon] dropped snapshots for check steps %s: their steps were skipped by the host", stale)
        if self.config.is_check_step(iteration):
            self._checks_run += 1
            decision = self._check(iteration, drill)
        elif drill:
            decision = self._drill(iteration)
        self.capturing = False
        if self.config.is_snapshot_step(iteration):
            self._take_snapshot(iteration)
        if self.config.is_check_step(iteration) or self.config.is_snapshot_step(iteration):
            self.guard.counter.take()  # the snapshot's reads since the check are not the check's records
            off = self._agree_collectives(iteration)
            agreement = self.guard.counter.take()
            last = self.last_check_comm
            if last is not None and last["iteration"] == iteration:  # the check's end-of-step agreement
                for key in ("sent_bytes", "received_bytes", "seconds", "calls", "messages"):
                    last["records"][key] += agreement[key]
            if off is not None:
                decision = off
        self._overhead_s += time.perf_counter() - self._step_start
        if decision.stop is not None:
            if not (decision.alarm and self.config.action == "checkpoint-and-abort"):
                raise MechmonStrictError(decision.stop)
            # The alarm's checkpoint-and-abort stops every rank anyway, with a checkpoint to roll back to.
            logger.error("[mechmon] %s (the alarm's checkpoint-and-abort runs first)", decision.stop)
        if decision.alarm and self.config.action == "checkpoint-and-abort":
            decision.abort = True
            decision.exit_code = self.config.exit_code
            self._pending_abort = decision
        return decision

    def _agree_collectives(self, iteration: int) -> Optional[Decision]:
        """End of a step with monitor collectives: every rank learns whether all of them are still
        on (``CollectiveGuard.agree_up``). When not, the monitors turn off on every rank at this
        step -- or, under ``--mechmon-strict``, the returned decision stops every rank."""
        if self.guard.agree_up():
            return None
        timeout = self.guard.timeout_s
        cause = self.guard.down or "a peer rank's monitor collective failed or timed out"
        self.off = cause
        self.capturing = False
        self.snapshots = SnapshotStore(self.snapshots.placement)  # nothing is compared across the gap
        if self.config.strict:
            stop = (f"mechmon monitor failed and --mechmon-strict is set; every rank stops: a monitor collective "
                    f"failed or timed out at iteration {iteration} (--mechmon-collective-timeout {timeout:g} s); "
                    f"on rank {self.rank}: {cause}")
            return Decision(iteration, stop=stop)
        logger.error(
            "[mechmon] a monitor collective failed or timed out at iteration %d (--mechmon-collective-timeout %g s): "
            "the monitors are off on every rank from now on (on rank %d: %s). Training goes on, NOT watched "
            "(mechmon/active = 0); training's own communicators were not used; --mechmon-strict stops the job "
            "instead", iteration, timeout, self.rank, cause)
        if self.comm.is_writer:  # TensorBoard must say so too: no check will write again
            self.failures.run("write", None, iteration, self._write,
                              {names.ACTIVE: 0.0, names.ERRORS: float(self.failures.errors)}, iteration)
        return None

    def run_host_collective(self, phase: str, iteration: int, fn, what: str) -> object:
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
        alerts = self._pending_abort.alerts if self._pending_abort else self.alerts[-1:]
        starts = [a.iteration if a.first_warning_step is None else a.first_warning_step for a in alerts]
        first_warning = min(starts) if starts else iteration
        before = [c for c in self.checkpoints if c["iteration"] < first_warning]
        return AlertReport(
            iteration=iteration,
            alerts=tuple(alerts),
            checkpoint_dir=checkpoint_dir,
            last_checkpoint_before_first_warning=before[-1] if before else None,
            exit_code=self.config.exit_code,
            action=self.config.action,
        )

    def on_abort_checkpoint_saved(self, iteration: int, checkpoint_dir: Optional[str]) -> Optional[str]:
        """Write ``mechmon_alert.json`` beside the abort checkpoint (writer rank); return its path."""
        if not self.enabled or not self.comm.is_writer:
            return None
        directory = checkpoint_dir or self.config.log_dir or "."
        path = self.abort_report(iteration, checkpoint_dir).write(directory)
        logger.warning("[mechmon] alert written to %s", path)
        return path

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        if not self.enabled:
            return {}
        detector = self.detector.state_dict() if self.detector is not None else self._pending_detector_state
        return {
            "version": STATE_VERSION,
            # the schedule the detector's baselines were built at (a resume compares it with its own)
            "interval": self.config.interval,
            "delta": self.config.delta,
            "detector": detector,
            "checkpoints": list(self.checkpoints),
            "errors": self.errors,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore a checkpoint's state (called before ``on_train_start``; it marks this launch a
        resume, which continues its run in the records).

        The state names the interval and delta its detector was built at. Another delta drops the
        detector state: its baselines hold Delta2 / dW over the old window, and over another window
        these are other statistics (level and spread depend on the update noise the window
        averages), so the change of flag would read as a shift; the baselines rebuild. Another
        interval with the same delta keeps it: a baseline is the last accepted values of the same
        statistic, counted in checks, still samples of its healthy level and spread; the warm-up
        length and the thresholds follow the new interval from the first check, and only the
        per-check slope mixes two spacings until the window has refilled. ``on_train_start`` says
        which happened, with the step the detector arms at (docs/METHOD.md, section 5)."""
        if not self.enabled or not state:
            return
        version = state.get("version")
        if version not in (1, STATE_VERSION):
            raise ValueError(f"mechmon state version {version} is not supported (expected {STATE_VERSION} or 1)")
        self._resumed_from = (state.get("interval"), state.get("delta"))
        if version == 1:
            logger.warning(
                "[mechmon] checkpoint holds detector state of mechmon 0.1 (per-stream rule); the whole-job "
                "detector re-learns its baselines from the next checks"
            )
        elif state.get("delta") is not None and state["delta"] != self.config.delta:
            # Delta2 and dW over another window are other statistics (their level and spread
            # change with the window): baselines built at the old delta would judge them wrongly.
            # The detector starts afresh; on_train_start says so, with the step it arms again at.
            self.detector = None
            self._pending_detector_state = None
        elif state.get("detector") is not None:
            if self.detector is not None:
                self.detector.load_state_dict(state["detector"])
            else:
                self._pending_detector_state = state["detector"]
        self.checkpoints = list(state.get("checkpoints", []))
        self.failures.errors = int(state.get("errors", 0))

    def _start_records(self, iteration: int) -> None:
        """Writer: number this launch's records (``session/runs.py``). A fresh start in a log dir
        that already holds records begins a new run there, and says so; a resume continues its run."""
        start_run = getattr(self.writer, "start_run", None)
        if not callable(start_run):
            return
        try:
            marker = start_run(new_run_id(), iteration, self._resumed_from is not None, self.config.interval,
                               self.config.delta)
        except (OSError, ValueError) as exc:  # the records go on unnumbered; training never stops for them
            logger.warning("[mechmon] could not write the run marker beside the records: %s", exc)
            return
        if marker is not None and not marker.resumed and marker.previous_run is not None:
            logger.warning(
                "[mechmon] a new run in a used log dir: records appended as run %d in %s (a fresh start, no monitor "
                "state loaded; the rows before it are run %d; tools that read the records split the runs)",
                marker.run, self.config.log_dir or "the records file", marker.previous_run)

    def _announce_arming(self, iteration: int) -> None:
        """Writer, at start-up: the step the detector arms at (its first statistic) and why then;
        after a resume with another --mechmon-interval or --mechmon-delta, what happened to the
        checkpoint's baselines (``load_state_dict``)."""
        state = self.detector.state_dict() if self.detector is not None else self._pending_detector_state
        families = fed_families(self.config, self._local_layers)
        if not families:
            return
        step, why = arming_line(self.config, self._detector_design, iteration, families, held_values(state))
        self._arm_step = step
        old_interval, old_delta = self._resumed_from or (None, None)
        cfg = self.config
        changes = [f"--mechmon-{name} {now} (checkpoint: {then})"
                   for name, now, then in (("interval", cfg.interval, old_interval), ("delta", cfg.delta, old_delta))
                   if then is not None and then != now]
        if old_delta is not None and old_delta != cfg.delta:
            logger.warning("[mechmon] resumed with %s: detector baselines restart, armed again at step %d: %s",
                           " and ".join(changes), step, why)
        elif changes:
            logger.warning(
                "[mechmon] resumed with %s, same --mechmon-delta %d: detector baselines kept (their values are the "
                "same %d-step statistics; the warm-up length and the thresholds follow the new interval), armed at "
                "step %d: %s", changes[0], cfg.delta, cfg.delta, step, why)
        else:
            logger.info("[mechmon] detector arms at step %d: %s", step, why)

    def close(self) -> None:
        """Close the writers and the webhook (once). Never raises: a run that trained to its end
        keeps its exit code when records could not be written (under ``--mechmon-strict`` the
        check whose write failed has already stopped every rank). The writer rank says in one
        line how many record writes failed during the run and at the close, and where."""
        if not self.enabled or self._closed:
            return
        self._closed = True
        closing: Optional[str] = None
        try:
            self.writer.close()  # flushes what is buffered: a full disk shows here
        except Exception as exc:  # noqa: BLE001 -- counted and reported below
            closing = f"{type(exc).__name__}: {exc}"
        if self._webhook is not None:
            self._webhook.close(wait_s=2.0)  # bounded: an abort still exits within seconds
        failed = self.failures.by_phase.get("write", 0) + (closing is not None)
        where = self.config.log_dir or "the host's writers (TensorBoard, W&B, the DeepSpeed monitor)"
        if failed and self.comm.is_writer:
            first = self.failures.first_of_phase.get("write")
            logger.warning("[mechmon] %d record writes failed (first: %s): records in %s are incomplete", failed,
                           first.describe() if first is not None else f"rank {self.rank}, closing the writers: "
                                                                      f"{closing}", where)
        if self.comm.is_writer:
            alarms = ", ".join(f"{a.family} at {a.iteration}" for a in self.alerts) or "none"
            state = "" if self.off is None else "; monitors off since a failure (see above)"
            checks = f"{self._checks_run} check{'' if self._checks_run == 1 else 's'}"
            logger.info("[mechmon] done: %s this launch, alarms: %s; records in %s%s", checks, alarms, where, state)

    # ------------------------------------------------------------------ internals
    def _timed(self, fn, *args):
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self._overhead_s += time.perf_counter() - start

    def _take_snapshot(self, iteration: int) -> None:
        """Copy the weights a later check (at iteration + delta) will compare against.

        Every rank reads every site (reads may be collectives); a failed read or copy leaves that
        site out of the snapshot, and the set is stored anyway, so all ranks agree that a check
        is due (the check still runs every read in order).
        """
        taken: dict[int, tuple] = {}
        log = self.failures
        for index, site in enumerate(self.attention_sites):
            layer = site.layer_number
            full = log.run("snapshot-read", layer, iteration, site.read_full)
            if full is FAILED:
                continue  # read_full raised on every rank of its group (collective_guard)
            heads = log.run("snapshot-read", layer, iteration, site.read_heads)
            if heads is FAILED:
                continue
            copied = log.run("snapshot", layer, iteration, self.snapshots.take, heads,
                             full if self.config.full_matrix_dw else None)
            if copied is not FAILED:
                taken[index] = copied
        self.snapshots.put(iteration + self.config.delta, taken)

    def _check(self, iteration: int, drill: bool = False) -> Decision:
        cfg = self.config
        log = self.failures
        outputs: list[CheckOutput] = []
        self.guard.counter.take()  # this check's collectives from here on
        snapshot = self.snapshots.pop(iteration)
        # The short window's snapshot: the one taken one interval ago, still in the ring for its
        # own later check (not popped here).
        short = self.snapshots.peek(cfg.short_snapshot_key(iteration)) if cfg.short_window else None
        # No snapshot (e.g. the first check after a resume) is the same on every rank, since all
        # ranks follow one schedule; the reads below are collectives, so all skip them together.
        sites = self.attention_sites if (snapshot is not None or short is not None) else []
        for index, site in enumerate(sites):
            layer = site.layer_number
            full = log.run("read", layer, iteration, site.read_full)  # collectives first, in site order
            if full is FAILED:
                continue
            heads = log.run("read", layer, iteration, site.read_heads)
            prev_heads, prev_full = snapshot.get(index, (None, None)) if snapshot is not None else (None, None)
            if isinstance(heads, MLAHeads) and isinstance(prev_heads, MLAHeads):
                outputs.append(log.run("kernel", layer, iteration, check_mla_heads, layer, prev_heads, heads,
                                       cfg.alpha, cfg.per_head_scalars))
            elif isinstance(heads, QKWeights) and isinstance(prev_heads, QKWeights):
                outputs.append(log.run("kernel", layer, iteration, check_heads, layer, prev_heads, heads, cfg.alpha,
                                       cfg.qk_method, cfg.per_head_scalars))
            if full is not None and prev_full is not None:
                outputs.append(log.run("kernel", layer, iteration, check_full, layer, prev_full, full, cfg.alpha,
                                       cfg.full_matrix_method, cfg.full_matrix_rank, cfg.wq_norm_power_iters))
            short_heads = short.get(index, (None, None))[0] if short is not None else None
            if isinstance(heads, QKWeights) and isinstance(short_heads, QKWeights):  # MLA: the long window only
                # The previous short window is (t - 2 interval, t - interval]: adjacent, not overlapping.
                kept = self._short_directions.pop(index, None)
                previous = kept[1] if kept is not None and kept[0] == iteration - cfg.interval else None
                result = log.run("kernel", layer, iteration, check_heads_short, layer, short_heads, heads,
                                 cfg.alpha, cfg.qk_method, cfg.per_head_scalars, previous)
                if result is not FAILED:
                    output, directions = result
                    outputs.append(output)
                    if directions is not None:
                        self._short_directions[index] = (iteration, directions)
        self.snapshots.release(snapshot)
        for router, floor in zip(self.router_sites, self._router_floors):
            outputs.append(self._router_check(iteration, router, floor))
        outputs = [o for o in outputs if o is not None and o is not FAILED]
        reads = self.guard.counter.take()  # the weights' gathers and the routers' all-reduces
        try:
            verdict = self._exchange(iteration, outputs, drill)
        except (collective_guard.CollectiveFailure, collective_guard.CollectivesOff) as exc:
            # This rank is down: the end-of-step agreement turns the monitors off on every rank.
            if isinstance(exc, collective_guard.CollectiveFailure):
                log.record("decision", None, iteration, exc)
            verdict = Verdict()
        self.last_check_comm = {"iteration": int(iteration), "reads": reads, "records": self.guard.counter.take()}
        self._overhead_s = 0.0
        self._step_start = time.perf_counter()  # what follows is counted towards the next check
        alerts = list(verdict.alerts)
        # A drill alarms on every rank even if the writer's decision failed: all know the step.
        if drill and not alerts:
            alerts = [_drill_alert(iteration)]
        return Decision(iteration, alarm=verdict.alarm or drill, alerts=alerts, stop=verdict.stop)

    def _exchange(self, iteration: int, outputs: list[CheckOutput], drill: bool) -> Verdict:
        """The check's records to the writer and its verdict back (``session/host.py``).

        1. every rank: its failure and error counts in one all-reduce (two float64);
        2. the reporting ranks (and the writer) only: their payloads to the writer, through the owner
           of their tensor-parallel group where the host gives one (``gather_reports``);
        3. only when some rank failed: every rank's failure records to the writer;
        4. every rank: the verdict, one small tensor, plus the alerts when there is an alarm.
        """
        payload = self._payload(iteration, outputs)
        failures = self.failures.take()
        errors_now = self.failures.errors
        total_failures, total_errors = self.comm.sum_over_ranks([len(failures), errors_now])
        gathered = self.comm.gather_reports(payload) if self._reporting else None
        every_failure: list[PhaseFailure] = []
        if total_failures > 0:
            per_rank = self.comm.gather_to_writer(failures)
            every_failure = [f for part in per_rank or [] for f in part]
        verdict: Optional[Verdict] = None
        if self.comm.is_writer:
            assert gathered is not None  # the writer receives every reporting rank's payload
            # Errors of the other ranks; the writer's own count grows while it decides.
            others = total_errors - errors_now
            verdict = self._verdict(iteration, gathered, every_failure, others, drill)
        return self.comm.broadcast_verdict(verdict)  # the one decision, on every rank

    def _router_check(self, iteration: int, router: RouterSite, floor: Optional[float]):
        """One router: local summary, the all-reduce (every rank, always), the reporting rank's output.

        A rank whose summary failed contributes zeros and a failure mark in the same all-reduce,
        so every rank of the group learns it and the partial total is not reported.
        """
        cfg = self.config
        log = self.failures
        layer = router.layer_number
        local = log.run("router", layer, iteration, local_router_vector, router, cfg.router_entropy_bins)
        failed = local is FAILED
        if failed:
            local = empty_vector(router, cfg.router_entropy_bins)
        marked = log.run("router", layer, iteration, _with_failure_mark, local, failed)
        if marked is FAILED:  # never skip the all-reduce: the peers are already on their way to it
            marked = _with_failure_mark(empty_vector(router, cfg.router_entropy_bins), True)
        total = log.run("router", layer, iteration, router.reduce_sum, marked)
        if total is FAILED:  # the collective itself failed (this rank is down) or a peer's part did
            return None
        if float(total[-1]) > 0:
            if not failed:
                logger.warning("[mechmon] router layer %d: a peer rank's summary failed at iteration %d; not reported "
                               "this check", layer, iteration)
            return None
        return log.run("router", layer, iteration, router_output, router, total[:-1], cfg.router_entropy_bins, floor)

    def _payload(self, iteration: int, outputs: list[CheckOutput]) -> Payload:
        """This rank's records for the writer; always picklable (a failed build sends its layers only)."""
        def build() -> Payload:
            payload = Payload(
                rank=self.rank,
                layers=self._local_layers,
                scalars=[o.scalars for o in outputs],
                streams=[st for o in outputs for st in o.streams],
                nonfinite=[report for o in outputs for report in o.nonfinite],
                # Session time since the previous check: snapshots in between plus this check so far.
                overhead_s=self._overhead_s + (time.perf_counter() - self._step_start),
            )
            pickle.dumps(payload)  # fail here, under the guard, not inside the gather collective
            return payload

        payload = self.failures.run("payload", None, iteration, build)
        return Payload(rank=self.rank, layers=self._local_layers) if payload is FAILED else payload

    def _verdict(self, iteration: int, gathered: list[Payload], failures: list[PhaseFailure], others_errors: float,
                 drill: bool) -> Verdict:
        """Writer rank: the decision every rank will take (alarm, alerts, strict stop).

        ``failures``: every rank's failure records of this check (the writer's own so far
        included); ``others_errors``: the other ranks' cumulative error counts, summed."""
        alerts = self.failures.run("decision", None, iteration, self._decide, iteration, gathered, bool(failures),
                                   others_errors, drill)
        if alerts is FAILED:
            alerts = [_drill_alert(iteration)] if drill else []
            # No detector decided: TensorBoard must say so too (the scalars of _decide never came).
            errors = others_errors + self.failures.errors
            self.failures.run("write", None, iteration, self._write,
                              {names.ACTIVE: 0.0, names.ERRORS: float(errors)}, iteration)
        failures = list(failures) + self.failures.take()  # the writer's own, from the decision and the writers
        self._quiet.update(iteration, failures)  # one error line per N checks while the monitors are off
        stop = strict_stop_message(failures) if (self.config.strict and failures) else None
        return Verdict(alarm=bool(alerts), alerts=alerts, stop=stop)

    def _ensure_detector(self, gathered: list[Payload]) -> PooledCusumDetector:
        if self.detector is None:
            shape = job_shape(self.config, [payload.layers for payload in gathered])
            self.detector, self.detector_account = build_detector(
                self.config, shape, self._detector_design, self._tail_table
            )
            if self._pending_detector_state is not None:
                self.detector.load_state_dict(self._pending_detector_state)
                self._pending_detector_state = None
            account = self.detector_account
            logger.info(
                "[mechmon] detector: %d tests (layers %s), %.3g false alarms per 10^6 steps -> %.3g per test-check; "
                "alarm thresholds %s%s",
                account["tests"], account["layers"], account["false_alarm_rate_per_million_steps"],
                account["per_test_check_probability"],
                {f: (round(t["layer"]["alarm"], 2), round(t["family"]["alarm"], 2))
                 for f, t in account["thresholds"].items()},
                "" if self._arm_step is None else f", judged from step {self._arm_step} (after the baselines' warm-up)",
            )
            silent = families_without_signal(self.config, shape)
            if silent:
                logger.warning("[mechmon] detector: left out of the union bound, no signal in this job: %s",
                               "; ".join(f"{f} ({why})" for f, why in silent.items()))
        return self.detector

    def _decide(self, iteration: int, gathered: list[Payload], failed: bool, others_errors: float,
                drill: bool = False) -> list[Alert]:
        """Writer rank: feed the detector, decide, then write the scalars (a writer failure is
        logged and never changes the decision). Returns the alarms of this check.

        ``failed``: some rank recorded a failure at this check; ``others_errors``: the other ranks'
        cumulative error counts (``mechmon/errors`` adds the writer's own)."""
        scalars = merge_partials([part for payload in gathered for part in payload.scalars])
        alerts: list[Alert] = [_drill_alert(iteration)] if drill else []
        for payload in gathered:
            for report in payload.nonfinite:
                alerts.append(
                    Alert(
                        iteration=iteration,
                        family="nonfinite",
                        stream="weights",
                        layer=report.layer_number,
                        head=None,
                        value=float("nan"),
                        baseline=None,
                        threshold=None,
                        first_warning_step=iteration,
                        reason=report.message,
                        kind="nonfinite",
                        layers=() if report.layer_number is None else (report.layer_number,),
                    )
                )
        observations = [
            obs for payload in gathered for stream in payload.streams if (obs := stream_observation(stream)) is not None
        ]
        result = self._ensure_detector(gathered).update(iteration, observations)
        if result.statistics and not self._armed:
            self._armed = True
            families = sorted({key.split("/", 1)[0] for key in result.statistics})
            late = ("" if self._arm_step in (None, iteration) else
                    f"; predicted at start-up: step {self._arm_step}, from the writer's own layers (a routing entropy "
                    "below its floor, or an alarm's restart, keeps values out of a baseline)")
            logger.info("[mechmon] detector armed at step %d (first mechmon/detect/* statistics: %s)%s", iteration,
                        ", ".join(families), late)
        alerts.extend(alert_of(alarm, self.config, self._detector_design) for alarm in result.alarms)
        self._log_new_warnings(iteration, result.warnings)
        for family in result.misfits:  # once per family and job: the loud part of the misfit counter
            logger.warning(
                "[mechmon] detector: calibration misfit in %s: %s warning episodes in the healthy phase where the "
                "null tails predict %.3g: either a change is starting in this family (an alarm may follow) or its "
                "thresholds are too low for this job; if no alarm follows, refit them on its healthy steps with "
                "mechmon-calibrate and pass --mechmon-detector-calibration",
                family,
                int(result.statistics.get(f"{family}/calibration_misfit/observed", 0)),
                result.statistics.get(f"{family}/calibration_misfit/expected", 0.0),
            )
        scalars.update({f"{names.DETECT_PREFIX}/{key}": value for key, value in result.statistics.items()})
        scalars[names.ALARM] = 1.0 if alerts else 0.0
        # 1: every rank's checks ran and the detector decided (a failure so far makes it 0).
        scalars[names.ACTIVE] = 0.0 if (failed or self.failures.pending) else 1.0
        scalars[names.WARNINGS] = float(len(result.warnings))
        # Cumulative over ranks; the writer's own count includes failures of this decision so far.
        scalars[names.ERRORS] = float(others_errors + self.failures.errors)
        # The slowest reporting rank (the others only read and gather for them).
        scalars[names.OVERHEAD_MS] = 1000.0 * max(p.overhead_s for p in gathered)
        self.alerts.extend(alerts)
        for alert in alerts:
            if self.config.action != "log":
                logger.warning(alert.describe())
            self._notify(alert)
        # Written after the decision: a failing writer is counted and never changes an alarm.
        self.failures.run("write", None, iteration, self._write, scalars, iteration)
        return alerts

    def _notify(self, alert: Alert) -> None:
        """Queue the alarm for the webhook (returns at once; the daemon thread sends it)."""
        if self._webhook is None:
            return
        fields = {k: v for k, v in alert.to_json().items() if not (isinstance(v, float) and not math.isfinite(v))}
        try:
            self._webhook.post({"text": alert.describe(), "mechmon": {"event": "alarm", "action": self.config.action,
                                                                      **fields}})
        except Exception as exc:  # noqa: BLE001 -- telling people is a side effect: it never changes a decision
            logger.warning("[mechmon] webhook post failed: %s", exc)

    def _write(self, scalars: dict, iteration: int) -> None:
        self.writer.write_scalars(scalars, iteration)
        self.writer.flush()

    def _log_new_warnings(self, iteration: int, warnings: list) -> None:
        current = set(warnings)
        for family, layer in sorted(current - self._active_warnings, key=str):
            where = "all layers" if layer is None else f"layer {layer}"
            logger.warning("[mechmon] warning at iteration %d: %s %s is drifting towards an alarm", iteration,
                           family, where)
        self._active_warnings = current

    def _drill(self, iteration: int) -> Decision:
        """Synthetic alarm at --mechmon-drill-at off a check step: every rank knows the step."""
        alert = _drill_alert(iteration)
        if self.comm.is_writer:
            logger.warning(alert.describe())
            self.alerts.append(alert)
            self._notify(alert)
            self.failures.run("write", None, iteration, self._write, {names.ALARM: 1.0}, iteration)
        return Decision(iteration, alarm=True, alerts=[alert])


def _with_failure_mark(vector: torch.Tensor, failed: bool) -> torch.Tensor:
    """``vector`` (fp64, where it lives) with one more element: 1 when this rank's summary failed."""
    mark = torch.tensor([1.0 if failed else 0.0], dtype=torch.float64, device=vector.device)
    return torch.cat([vector.reshape(-1).to(torch.float64), mark])


def _drill_alert(iteration: int) -> Alert:
    return Alert(
        iteration=iteration,
        family="drill",
        stream="drill",
        layer=None,
        head=None,
        value=0.0,
        baseline=None,
        threshold=None,
        first_warning_step=iteration,
        reason="rehearsal requested by --mechmon-drill-at",
    )


