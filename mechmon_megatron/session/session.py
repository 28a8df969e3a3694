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
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from mechmon_megatron.detect.pooled_cusum import PooledCusumDetector
from mechmon_megatron.session import names
from mechmon_megatron.session.alert import Alert, AlertReport
from mechmon_megatron.session.attention_check import check_full, check_heads, snapshot_full, snapshot_heads
from mechmon_megatron.session.config import MechmonConfig
from mechmon_megatron.session.detector_inputs import observation
from mechmon_megatron.session.detector_setup import (
    alert_of,
    build_detector,
    job_shape,
    load_detector_design,
    local_layers,
)
from mechmon_megatron.session.host import AttentionSite, Communicator, LocalCommunicator, RouterSite
from mechmon_megatron.session.records import CheckOutput, merge_partials
from mechmon_megatron.session.router_check import empty_vector, local_router_vector, router_output
from mechmon_megatron.session.writers import ScalarWriter, WriterGroup

logger = logging.getLogger(__name__)

STATE_VERSION = 2
"""2: the whole-job detector (0.2); 1: the per-stream detector of 0.1 (its baselines are not reused)."""
_NO_ALARM, _ALARM = 0, 1


@dataclass
class Decision:
    """What the host must do after a step. ``abort``: save on every rank, then exit."""

    iteration: int
    alarm: bool = False
    abort: bool = False
    exit_code: int = 0
    alerts: list[Alert] = field(default_factory=list)


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
        self.writer = writer or WriterGroup()
        # Built by the writer at the first check, from every rank's layers (detector_setup).
        self.detector: Optional[PooledCusumDetector] = None
        self.detector_account: Optional[dict] = None
        self._pending_detector_state: Optional[dict] = None
        self._local_layers = local_layers(config, self.attention_sites, self.router_sites)
        self._detector_design, self._tail_table = load_detector_design(config)  # fails here, not mid-run
        self._active_warnings: set = set()
        self.capturing = False
        self.errors = 0
        self.checkpoints: list[dict] = []  # [{"iteration": i, "path": p}] saved so far
        self.alerts: list[Alert] = []
        self._snapshots: dict[int, dict[int, tuple]] = {}  # check step -> site index -> (heads, full)
        self._overhead_s = 0.0
        self._step_start = time.perf_counter()
        self._pending_abort: Optional[Decision] = None

    # ------------------------------------------------------------------ host hooks
    def on_train_start(self, iteration: int) -> None:
        """Take the first snapshot if the schedule needs one at the starting iteration."""
        if self.enabled and self.config.is_snapshot_step(iteration):
            self._timed(self._take_snapshot, iteration)

    def on_step_start(self, iteration: int) -> bool:
        """Arm router-logit capture for a check step; returns whether capture is on."""
        if not self.enabled:
            return False
        self.capturing = bool(self.router_sites) and self.config.is_check_step(iteration)
        return self.capturing

    def stop_capture(self) -> None:
        """The check step's training forwards are done: later forwards (eval) are not captured."""
        if self.enabled:
            self.capturing = False

    def on_step_end(self, iteration: int) -> Decision:
        """Run the check / snapshot due at ``iteration`` and return the agreed decision."""
        if not self.enabled:
            return Decision(iteration)
        self._step_start = time.perf_counter()
        decision = Decision(iteration)
        drill = self.config.is_drill_step(iteration)
        if self.config.is_check_step(iteration):
            decision = self._check(iteration, drill)
        elif drill:
            decision = self._drill(iteration)
        self.capturing = False
        if self.config.is_snapshot_step(iteration):
            self._take_snapshot(iteration)
        self._overhead_s += time.perf_counter() - self._step_start
        if decision.alarm and self.config.action == "checkpoint-and-abort":
            decision.abort = True
            decision.exit_code = self.config.exit_code
            self._pending_abort = decision
        return decision

    def on_checkpoint_saved(self, iteration: int, path: Optional[str]) -> None:
        """Record a regular checkpoint (for the 'last good checkpoint' in the alert)."""
        if self.enabled:
            self.checkpoints.append({"iteration": int(iteration), "path": path})

    def on_abort_checkpoint_saved(self, iteration: int, checkpoint_dir: Optional[str]) -> Optional[str]:
        """Write ``mechmon_alert.json`` beside the abort checkpoint (writer rank); return its path."""
        if not self.enabled or not self.comm.is_writer:
            return None
        alerts = self._pending_abort.alerts if self._pending_abort else self.alerts[-1:]
        starts = [a.iteration if a.first_warning_step is None else a.first_warning_step for a in alerts]
        first_warning = min(starts) if starts else iteration
        before = [c for c in self.checkpoints if c["iteration"] < first_warning]
        report = AlertReport(
            iteration=iteration,
            alerts=alerts,
            checkpoint_dir=checkpoint_dir,
            last_checkpoint_before_first_warning=before[-1] if before else None,
            exit_code=self.config.exit_code,
            action=self.config.action,
        )
        directory = checkpoint_dir or self.config.log_dir or "."
        path = report.write(directory)
        logger.warning("[mechmon] alert written to %s", path)
        return path

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        if not self.enabled:
            return {}
        detector = self.detector.state_dict() if self.detector is not None else self._pending_detector_state
        return {
            "version": STATE_VERSION,
            "detector": detector,
            "checkpoints": list(self.checkpoints),
            "errors": self.errors,
        }

    def load_state_dict(self, state: dict) -> None:
        if not self.enabled or not state:
            return
        version = state.get("version")
        if version == 1:
            logger.warning(
                "[mechmon] checkpoint holds detector state of mechmon 0.1 (per-stream rule); the whole-job "
                "detector re-learns its baselines from the next checks"
            )
        elif version != STATE_VERSION:
            raise ValueError(f"mechmon state version {version} is not supported (expected {STATE_VERSION} or 1)")
        elif state.get("detector") is not None:
            if self.detector is not None:
                self.detector.load_state_dict(state["detector"])
            else:
                self._pending_detector_state = state["detector"]
        self.checkpoints = list(state.get("checkpoints", []))
        self.errors = int(state.get("errors", 0))

    def close(self) -> None:
        if self.enabled:
            self.writer.close()

    # ------------------------------------------------------------------ internals
    def _timed(self, fn, *args):
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self._overhead_s += time.perf_counter() - start

    def _snapshot_device(self) -> Optional[torch.device]:
        return torch.device("cpu") if self.config.snapshot_device == "cpu" else None

    def _take_snapshot(self, iteration: int) -> None:
        """Copy the weights a later check (at iteration + delta) will compare against."""
        device = self._snapshot_device()
        taken: dict[int, tuple] = {}
        for index, site in enumerate(self.attention_sites):
            full = site.read_full()  # may be a collective: every rank calls it
            heads = site.read_heads()
            taken[index] = (
                snapshot_heads(heads, device) if heads is not None else None,
                snapshot_full(full, device) if (full is not None and self.config.full_matrix_dw) else None,
            )
        self._snapshots[iteration + self.config.delta] = taken

    def _guard(self, fn, *args):
        """Run a monitor computation; count and log failures unless strict mode re-raises."""
        try:
            return fn(*args)
        except Exception:  # noqa: BLE001 -- a monitor must never kill training by default
            if self.config.strict:
                raise
            self.errors += 1
            logger.exception("[mechmon] monitor failed (counted in mechmon/errors; training goes on)")
            return None

    def _check(self, iteration: int, drill: bool = False) -> Decision:
        cfg = self.config
        outputs: list[CheckOutput] = []
        snapshot = self._snapshots.pop(iteration, None)
        # No snapshot (e.g. the first check after a resume) is the same on every rank, since all
        # ranks follow one schedule; the reads below are collectives, so all skip them together.
        sites = self.attention_sites if snapshot is not None else []
        for index, site in enumerate(sites):
            full = site.read_full()  # collectives first, unconditionally, in site order
            heads = site.read_heads()
            assert snapshot is not None  # `sites` is empty without a snapshot
            prev_heads, prev_full = snapshot[index]
            if heads is not None and prev_heads is not None:
                outputs.append(
                    self._guard(
                        check_heads,
                        site.layer_number,
                        prev_heads,
                        heads,
                        cfg.alpha,
                        cfg.qk_method,
                        cfg.per_head_scalars,
                    )
                )
            if full is not None and prev_full is not None:
                outputs.append(self._guard(check_full, site.layer_number, prev_full, full, cfg.alpha))
        for router, floor in zip(self.router_sites, self._router_floors):
            local = self._guard(local_router_vector, router, cfg.router_entropy_bins)
            router.captured_logits.clear()
            # The all-reduce runs on every rank even if this rank's summary failed.
            flat = router.reduce_sum(local if local is not None else empty_vector(router, cfg.router_entropy_bins))
            outputs.append(self._guard(router_output, router, flat, cfg.router_entropy_bins, floor))
        outputs = [o for o in outputs if o is not None]

        payload = {
            "layers": self._local_layers,
            "scalars": [o.scalars for o in outputs],
            "streams": [s for o in outputs for s in o.streams],
            "nonfinite": [report for o in outputs for report in o.nonfinite],
            "errors": self.errors,
            # Session time since the previous check: snapshots in between plus this check so far.
            "overhead_s": self._overhead_s + (time.perf_counter() - self._step_start),
        }
        gathered = self.comm.gather_to_writer(payload)
        flag = _NO_ALARM
        alerts: list[Alert] = []
        if self.comm.is_writer:
            assert gathered is not None  # the writer receives every rank's payload
            try:
                alerts = self._decide(iteration, gathered, drill)
            except Exception:  # noqa: BLE001
                if cfg.strict:
                    raise
                self.errors += 1
                logger.exception("[mechmon] alarm decision failed; no action this check")
            flag = _ALARM if alerts else _NO_ALARM
        flag = self.comm.broadcast_flag(flag)
        self._overhead_s = 0.0
        self._step_start = time.perf_counter()  # what follows is counted towards the next check
        # A drill alarms on every rank even if the writer's decision failed: all know the step.
        alarm = flag == _ALARM or drill
        if drill and not self.comm.is_writer:
            alerts = [_drill_alert(iteration)]
        return Decision(iteration, alarm=alarm, alerts=alerts)

    def _ensure_detector(self, gathered: list[dict]) -> PooledCusumDetector:
        if self.detector is None:
            shape = job_shape(self.config, [payload["layers"] for payload in gathered])
            self.detector, self.detector_account = build_detector(
                self.config, shape, self._detector_design, self._tail_table
            )
            if self._pending_detector_state is not None:
                self.detector.load_state_dict(self._pending_detector_state)
                self._pending_detector_state = None
            account = self.detector_account
            logger.info(
                "[mechmon] detector: %d tests (layers %s), %.3g false alarms per 10^6 steps -> %.3g per test-check; "
                "alarm thresholds %s",
                account["tests"], account["layers"], account["false_alarm_rate_per_million_steps"],
                account["per_test_check_probability"],
                {f: (round(t["layer"]["alarm"], 2), round(t["family"]["alarm"], 2))
                 for f, t in account["thresholds"].items()},
            )
        return self.detector

    def _decide(self, iteration: int, gathered: list[dict], drill: bool = False) -> list[Alert]:
        """Writer rank: feed the detector, decide, then write the scalars (a writer failure is
        logged and never changes the decision). Returns the alarms of this check."""
        scalars = merge_partials([part for payload in gathered for part in payload["scalars"]])
        alerts: list[Alert] = [_drill_alert(iteration)] if drill else []
        for payload in gathered:
            for report in payload["nonfinite"]:
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
                        layers=[] if report.layer_number is None else [report.layer_number],
                    )
                )
        observations = [
            obs
            for payload in gathered
            for stream in payload["streams"]
            if (obs := observation(stream.name, stream.value, stream.limit, stream.limit_reason)) is not None
        ]
        result = self._ensure_detector(gathered).update(iteration, observations)
        alerts.extend(alert_of(alarm, self.config, self._detector_design) for alarm in result.alarms)
        self._log_new_warnings(iteration, result.warnings)
        scalars.update({f"{names.DETECT_PREFIX}/{key}": value for key, value in result.statistics.items()})
        scalars[names.ALARM] = 1.0 if alerts else 0.0
        scalars[names.WARNINGS] = float(len(result.warnings))
        scalars[names.ERRORS] = float(sum(p["errors"] for p in gathered))
        scalars[names.OVERHEAD_MS] = 1000.0 * max(p["overhead_s"] for p in gathered)
        self.alerts.extend(alerts)
        for alert in alerts:
            if self.config.action != "log":
                logger.warning(alert.describe())
        try:
            self.writer.write_scalars(scalars, iteration)
            self.writer.flush()
        except Exception:  # noqa: BLE001 -- losing scalars must never lose an alarm
            if self.config.strict:
                raise
            self.errors += 1
            logger.exception("[mechmon] writing scalars failed at iteration %d (the decision stands)", iteration)
        return alerts

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
            self.writer.write_scalars({names.ALARM: 1.0}, iteration)
            self.writer.flush()
        return Decision(iteration, alarm=True, alerts=[alert])


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


