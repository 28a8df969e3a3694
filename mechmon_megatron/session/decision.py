"""The writer rank's decision at a check: the detector, the alerts, the scalars, the webhook, the lines.

At the first check the writer builds the whole-job detector from every rank's layers
(``detector_setup``), loading the state a checkpoint gave it; at every check it feeds the
detector the gathered streams (in payload order), turns its alarms and the non-finite reports
into alerts, writes the scalars (after the decision: a failing writer is counted and never
changes an alarm), queues each alarm for the webhook, and says when a family starts drifting.
Other ranks hold the same object, idle, for the saved detector state.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from mechmon_megatron.detect.families import family_spec
from mechmon_megatron.detect.null_model import ThresholdAccount
from mechmon_megatron.detect.phase_moments import PhaseTable
from mechmon_megatron.detect.pooled_cusum import PooledCusumDetector
from mechmon_megatron.session import names
from mechmon_megatron.session.alert import Alert
from mechmon_megatron.session.config import MechmonConfig
from mechmon_megatron.session.detector_inputs import stream_observation
from mechmon_megatron.session.detector_setup import alert_of, build_detector, families_without_signal, job_shape
from mechmon_megatron.session.failures import FAILED, FailureLog, PhaseFailure, QuietMonitors, strict_stop_message
from mechmon_megatron.session.log import SESSION, mechmon_log
from mechmon_megatron.session.records import Payload, Verdict, merge_partials
from mechmon_megatron.session.webhook import WebhookPoster
from mechmon_megatron.session.writers import ScalarWriter

log = mechmon_log(SESSION)


class WriterDecision:
    """The detector and everything the writer does with its result.

    ``design`` / ``tail_table``: the detector design and null tails (``load_detector_design``,
    loaded at start-up so a bad calibration fails there); ``webhook``: the writer's poster or None;
    ``phase``: the early-phase correction and its line (``detector_setup.phase_for_job``)."""

    def __init__(self, config: MechmonConfig, failures: FailureLog, writer: ScalarWriter, design: Any,
                 tail_table: Any, webhook: Optional[WebhookPoster],
                 phase: tuple[Optional[PhaseTable], str] = (None, "")) -> None:
        self.config = config
        self.failures = failures
        self.writer = writer
        self.design = design
        self.tail_table = tail_table
        self.phase, self.phase_note = phase
        self.webhook = webhook
        self.detector: Optional[PooledCusumDetector] = None
        self.detector_account: Optional[ThresholdAccount] = None
        self.pending_detector_state: Optional[dict] = None
        """A checkpoint's detector state, loaded into the detector when the first check builds it."""
        self.alerts: list[Alert] = []
        self.arm_step: Optional[int] = None
        """The step the detector arms at, predicted at start-up (``launch_lines.announce_arming``)."""
        self._armed = False  # the "detector armed" line was printed
        self._active_warnings: set = set()
        self._quiet = QuietMonitors()  # checks at which the monitors did not run

    # ------------------------------------------------------------------ detector state
    def detector_state(self) -> Optional[dict]:
        """The state to save: the live detector's, else the one a checkpoint gave and no check used yet."""
        return self.detector.state_dict() if self.detector is not None else self.pending_detector_state

    def load_detector_state(self, state: dict) -> None:
        if self.detector is not None:
            self.detector.load_state_dict(state)
        else:
            self.pending_detector_state = state

    def drop_detector(self) -> None:
        """Start the detector afresh (a resume with another ``--mechmon-delta``)."""
        self.detector = None
        self.pending_detector_state = None

    # ------------------------------------------------------------------ the check
    def verdict(self, iteration: int, gathered: list[Payload], failures: list[PhaseFailure], others_errors: float,
                drill: bool) -> Verdict:
        """The decision every rank will take (alarm, alerts, strict stop).

        ``failures``: every rank's failure records of this check (the writer's own so far
        included); ``others_errors``: the other ranks' cumulative error counts, summed."""
        alerts = self.failures.run("decision", None, iteration, self._decide, iteration, gathered, bool(failures),
                                   others_errors, drill)
        if alerts is FAILED:
            alerts = [drill_alert(iteration)] if drill else []
            # No detector decided: TensorBoard must say so too (the scalars of _decide never came).
            self.write_off(iteration, others_errors + self.failures.errors)
        failures = list(failures) + self.failures.take()  # the writer's own, from the decision and the writers
        self._quiet.update(iteration, failures)  # one error line per N checks while the monitors are off
        stop = strict_stop_message(failures) if (self.config.strict and failures) else None
        return Verdict(alarm=bool(alerts), alerts=alerts, stop=stop)

    def _ensure_detector(self, gathered: list[Payload]) -> PooledCusumDetector:
        if self.detector is None:
            shape = job_shape(self.config, [payload.layers for payload in gathered])
            self.detector, self.detector_account = build_detector(self.config, shape, self.design, self.tail_table,
                                                                  self.phase)
            if self.pending_detector_state is not None:
                self.detector.load_state_dict(self.pending_detector_state)
                self.pending_detector_state = None
            account = self.detector_account
            log.info(
                "detector: %d tests (layers %s), %.3g false alarms per 10^6 steps -> %.3g per test-check; "
                "alarm thresholds %s%s",
                account.tests, dict(account.layers), account.false_alarm_rate_per_million_steps,
                account.per_test_check_probability,
                {f: (round(t.layer.alarm, 2), round(t.family.alarm, 2)) for f, t in account.thresholds.items()},
                "" if self.arm_step is None else f", judged from step {self.arm_step} (after the baselines' warm-up)",
            )
            if self.phase_note and any(family_spec(f).phase_corrected for f in account.layers):
                log.info("detector: %s", self.phase_note)
            silent = families_without_signal(self.config, shape)
            if silent:
                log.warning("detector: left out of the union bound, no signal in this job: %s",
                            "; ".join(f"{f} ({why})" for f, why in silent.items()))
        return self.detector

    def _decide(self, iteration: int, gathered: list[Payload], failed: bool, others_errors: float,
                drill: bool = False) -> list[Alert]:
        """Feed the detector, decide, then write the scalars (a writer failure is logged and never
        changes the decision). Returns the alarms of this check.

        ``failed``: some rank recorded a failure at this check; ``others_errors``: the other ranks'
        cumulative error counts (``mechmon/errors`` adds the writer's own)."""
        scalars = merge_partials([part for payload in gathered for part in payload.scalars])
        alerts: list[Alert] = [drill_alert(iteration)] if drill else []
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
            late = ("" if self.arm_step in (None, iteration) else
                    f"; predicted at start-up: step {self.arm_step}, from the writer's own layers (a routing entropy "
                    "below its floor, or an alarm's restart, keeps values out of a baseline)")
            log.info("detector armed at step %d (first mechmon/detect/* statistics: %s)%s", iteration,
                     ", ".join(families), late)
        alerts.extend(alert_of(alarm, self.config, self.design) for alarm in result.alarms)
        self._log_new_warnings(iteration, result.warnings)
        for family in result.misfits:  # once per family and job: the loud part of the misfit counter
            log.warning(
                "detector: calibration misfit in %s: %s warning episodes in the healthy phase where the "
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
                log.logger.warning(alert.describe())  # describe() starts with the prefix itself
            self.notify(alert)
        # Written after the decision: a failing writer is counted and never changes an alarm.
        self.failures.run("write", None, iteration, self.write, scalars, iteration)
        return alerts

    def _log_new_warnings(self, iteration: int, warnings: list) -> None:
        current = set(warnings)
        for family, layer in sorted(current - self._active_warnings, key=str):
            where = "all layers" if layer is None else f"layer {layer}"
            log.warning("warning at iteration %d: %s %s is drifting towards an alarm", iteration, family, where)
        self._active_warnings = current

    # ------------------------------------------------------------------ outputs
    def notify(self, alert: Alert) -> None:
        """Queue the alarm for the webhook (returns at once; the daemon thread sends it)."""
        if self.webhook is None:
            return
        fields = {k: v for k, v in alert.to_json().items() if not (isinstance(v, float) and not math.isfinite(v))}
        try:
            self.webhook.post({"text": alert.describe(), "mechmon": {"event": "alarm", "action": self.config.action,
                                                                     **fields}})
        except Exception as exc:  # noqa: BLE001 -- telling people is a side effect: it never changes a decision
            log.warning("webhook post failed: %s", exc)

    def write(self, scalars: dict, iteration: int) -> None:
        self.writer.write_scalars(scalars, iteration)
        self.writer.flush()

    def write_off(self, iteration: int, errors: float) -> None:
        """``mechmon/active`` 0 and the error count: no detector decided at this check, or none will
        again (the monitors are off)."""
        self.failures.run("write", None, iteration, self.write, {names.ACTIVE: 0.0, names.ERRORS: float(errors)},
                          iteration)

    def drill(self, iteration: int) -> Alert:
        """The writer's part of a drill off a check step: the alarm's line, webhook and scalar."""
        alert = drill_alert(iteration)
        log.logger.warning(alert.describe())
        self.alerts.append(alert)
        self.notify(alert)
        self.failures.run("write", None, iteration, self.write, {names.ALARM: 1.0}, iteration)
        return alert


def drill_alert(iteration: int) -> Alert:
    """The synthetic alarm of ``--mechmon-drill-at``."""
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
