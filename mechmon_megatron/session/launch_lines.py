"""The writer's lines at the start and the end of a launch.

At the start: the run marker beside the records (``session/runs.py``: a resume continues its run,
a fresh start in a used log dir begins a new one and says so), and the step the detector arms at,
with what a resume under another ``--mechmon-interval`` or ``--mechmon-delta`` did to the
checkpoint's baselines. At the end: the failed record writes, and one closing line (checks run,
alarms, where the records are), after the writers and the webhook are closed.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from mechmon_megatron.detect.families import family_spec
from mechmon_megatron.session.alert import Alert
from mechmon_megatron.session.config import MechmonConfig
from mechmon_megatron.session.detector_setup import arming_line, fed_families, first_value_step, held_values
from mechmon_megatron.session.failures import FailureLog
from mechmon_megatron.session.log import SESSION, mechmon_log
from mechmon_megatron.session.runs import new_run_id
from mechmon_megatron.session.webhook import WebhookPoster
from mechmon_megatron.session.writers import ScalarWriter

log = mechmon_log(SESSION)

Resumed = Optional[tuple[Optional[int], Optional[int]]]
"""(interval, delta) of the monitor state a checkpoint gave this launch (None each when the state
predates them); None: nothing loaded, a fresh start."""


def start_records(writer: ScalarWriter, config: MechmonConfig, iteration: int, resumed: Resumed) -> None:
    """Number this launch's records (``session/runs.py``). A fresh start in a log dir that already
    holds records begins a new run there, and says so; a resume continues its run."""
    start_run = getattr(writer, "start_run", None)
    if not callable(start_run):
        return
    try:
        marker = start_run(new_run_id(), iteration, resumed is not None, config.interval, config.delta)
    except (OSError, ValueError) as exc:  # the records go on unnumbered; training never stops for them
        log.warning("could not write the run marker beside the records: %s", exc)
        return
    if marker is not None and not marker.resumed and marker.previous_run is not None:
        log.warning(
            "a new run in a used log dir: records appended as run %d in %s (a fresh start, no monitor "
            "state loaded; the rows before it are run %d; tools that read the records split the runs)",
            marker.run, config.log_dir or "the records file", marker.previous_run)


def announce_arming(config: MechmonConfig, design: Any, local_layers: dict[str, list[int]], iteration: int,
                    detector_state: Optional[dict], resumed: Resumed) -> Optional[int]:
    """The step the detector arms at (its first statistic) and why then; after a resume with
    another --mechmon-interval or --mechmon-delta, what happened to the checkpoint's baselines
    (``MonitoringSession.load_state_dict``). Returns the step (None: no family is fed here)."""
    families = fed_families(config, local_layers)
    if not families:
        return None
    step, why = arming_line(config, design, iteration, families, held_values(detector_state))
    old_interval, old_delta = resumed or (None, None)
    changes = [f"--mechmon-{name} {now} (checkpoint: {then})"
               for name, now, then in (("interval", config.interval, old_interval), ("delta", config.delta, old_delta))
               if then is not None and then != now]
    if old_delta is not None and old_delta != config.delta:
        log.warning("resumed with %s: detector baselines restart, armed again at step %d: %s",
                    " and ".join(changes), step, why)
    elif changes:
        log.warning(
            "resumed with %s, same --mechmon-delta %d: detector baselines kept (their values are the "
            "same %d-step statistics; the warm-up length and the thresholds follow the new interval), armed at "
            "step %d: %s", changes[0], config.delta, config.delta, step, why)
    else:
        log.info("detector arms at step %d: %s", step, why)
    if resumed is not None:
        _resume_gap_line(config, families, iteration)
    return step


def _resume_gap_line(config: MechmonConfig, families: Sequence[str], start: int) -> None:
    """After a resume: the checks that run before the first window-old snapshot exists (the
    snapshots are not in the checkpoint), named once, so that the gap in the attention streams is
    never silent."""
    windowed = [f for f in families if family_spec(f).window != "check"]
    if not windowed:
        return
    first_check = config.interval * (start // config.interval + 1)
    first_value = min(first_value_step(config, f, start) for f in windowed)
    if first_value <= first_check:
        return
    last_without = first_value - config.interval
    span = f"step {first_check}" if last_without == first_check else f"steps {first_check}-{last_without}"
    log.info("resumed at step %d: the Q/K snapshots are not kept in checkpoints, so the attention checks at %s "
             "have no window yet (no Delta2/dW values); they resume at step %d, one --mechmon-delta %d window "
             "after the resume", start, span, first_value, config.delta)


def close_launch(config: MechmonConfig, writer: ScalarWriter, webhook: Optional[WebhookPoster], failures: FailureLog,
                 is_writer: bool, rank: int, checks_run: int, alerts: Sequence[Alert], off: Optional[str]) -> None:
    """Close the writers and the webhook; never raises. The writer rank then says how many record
    writes failed (during the run, and at the close) and where, and closes with one line: checks,
    alarms, records."""
    closing: Optional[str] = None
    try:
        writer.close()  # flushes what is buffered: a full disk shows here
    except Exception as exc:  # noqa: BLE001 -- counted and reported below
        closing = f"{type(exc).__name__}: {exc}"
    if webhook is not None:
        webhook.close(wait_s=2.0)  # bounded: an abort still exits within seconds
    failed = failures.by_phase.get("write", 0) + (closing is not None)
    where = config.log_dir or "the host's writers (TensorBoard, W&B, the DeepSpeed monitor)"
    if failed and is_writer:
        first = failures.first_of_phase.get("write")
        log.warning("%d record writes failed (first: %s): records in %s are incomplete", failed,
                    first.describe() if first is not None else f"rank {rank}, closing the writers: {closing}", where)
    if is_writer:
        alarms = ", ".join(f"{a.family} at {a.iteration}" for a in alerts) or "none"
        state = "" if off is None else "; monitors off since a failure (see above)"
        checks = f"{checks_run} check{'' if checks_run == 1 else 's'}"
        log.info("done: %s this launch, alarms: %s; records in %s%s", checks, alarms, where, state)
