"""Offline analysis of one fault-study run: first alarms, divergence, expert collapse, leads.

Inputs are the two files a run writes:

- the trainer's metrics JSONL (one line per iteration: ``iteration``, ``lm_loss``, ``grad_norm``,
  ``lr``, ``step_time_s`` and, with ``--log-max-attention-logit``, ``max_attn_logit``);
- the session's ``mechmon_scalars.jsonl`` (one line per check: ``{"step", "scalars"}``).

Mechmon alarms are REPLAYED here with the same detector code the session runs online
(:class:`~mechmon_megatron.detect.pooled_cusum.PooledCusumDetector` with the thresholds of
:func:`~mechmon_megatron.detect.null_model.thresholds_for_job` and the inputs of
:mod:`mechmon_megatron.session.detector_inputs`), on the same streams:

=================  ===================================================================
``attn_delta2``    ``mechmon/attn/delta2_entropy/layer_L/head_H`` (needs
                   ``--mechmon-per-head-scalars``)
``attn_dw``        ``mechmon/attn/dw_entropy/layer_L`` and ``.../dwk_entropy/layer_L``
``router_entropy`` ``mechmon/router/token_entropy/layer_L`` (with the floor recorded in
                   ``mechmon/router/token_entropy_floor/layer_L``)
``router_weights`` ``mechmon/router/weight_similarity/layer_L``
=================  ===================================================================

so a replay with the run's own ``--mechmon-false-alarm-rate`` (and the same null tails)
reproduces its online alarms, and other rates can be compared without retraining.

Symptom baselines (docs/METHOD.md section 9) replayed with
:func:`~mechmon_megatron.research.baselines.symptom_rules.build_symptom_rules` (published defaults):

=====================  ============================================================
``loss_6sigma``        loss > mean + 6 sigma of the previous 128 steps (OLMo-core)
``loss_10x``           loss >= 10 x max of the first 100 steps (Megatron-LM)
``loss_2x_mean``       loss >= 2 x the 100-step mean for > 4 steps (llm-foundry)
``grad_norm_6sigma``   the OLMo-core rule on the global grad norm
``max_attn_logit``     max_ij q.k / sqrt(d) >= 3 x the median of its first 100 steps from
                       step 200 (:class:`GrowthSetting`)
``wq_spectral_norm``   largest singular value of a layer's W_q >= 3 x the median of its
                       first 10 checks from step 200 (per layer; first layer to fire)
=====================  ============================================================

Event definitions (documented, fixed for every scenario):

- **Loss divergence** (:class:`DivergenceRule`): the first step of the first run of
  ``patience`` (10) consecutive steps at which the ``window``-step (10) moving average of the
  loss exceeds ``factor`` (1.3) x the running minimum of the ``reference_window``-step (50)
  moving average taken over the earlier steps; a non-finite loss diverges at once. (Healthy
  runs of the study's model stay below 1.25 x; the per-step loss is too noisy to compare raw.)
- **Expert collapse** (:class:`CollapseRule`): the first check at which some MoE layer has
  ``max_vio >= max_vio_level`` (default 2.0: the busiest expert gets at least 3x its fair
  share of the top-k assignments of the check step; the maximum is E / k - 1) at ``patience``
  (default 5) consecutive checks.

Leads: ``lead = divergence - alarm`` (steps) and ``lead_share = lead / (divergence - onset)``;
an alarm before the onset counts as a false alarm, not a lead.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from mechmon_megatron.calibrate.records import jsonl_rows
from mechmon_megatron.detect.null_model import DEFAULT_FALSE_ALARM_RATE, load_tail_table
from mechmon_megatron.detect.phase_moments import TrainingSchedule, select_phase_table
from mechmon_megatron.detect.pooled_cusum import default_sequential_config
from mechmon_megatron.research.baselines.symptom_rules import GrowthRule, build_symptom_rules
from mechmon_megatron.research.study.pooled_replay import replay_pooled, thresholds_at_rate
from mechmon_megatron.session import names
from mechmon_megatron.session.detector_inputs import attention_kind, observations_from_scalars, stream_family

__all__ = ["stream_family"]  # re-exported: the family of a recorded scalar (session.detector_inputs)

MECHMON_FAMILIES: tuple[str, ...] = ("attn_delta2", "attn_dw", "router_entropy", "router_weights")
SYMPTOM_KEYS: tuple[str, ...] = (
    "loss_6sigma", "loss_10x", "loss_2x_mean", "grad_norm_6sigma", "max_attn_logit", "wq_spectral_norm",
)
ALARM_KEYS: tuple[str, ...] = MECHMON_FAMILIES + SYMPTOM_KEYS
ATTN_FAMILIES = ("attn_delta2", "attn_dw")
ROUTER_FAMILIES = ("router_entropy", "router_weights")

# first_alarm key -> "<stream>/<rule kind>" of build_symptom_rules()
_SYMPTOM_RULE_OF_KEY = {
    "loss_6sigma": "loss/olmo_spike",
    "loss_10x": "loss/megatron_spike",
    "loss_2x_mean": "loss/foundry_spike",
    "grad_norm_6sigma": "grad_norm/olmo_spike",
    "max_attn_logit": "max_attn_logit/growth",
}

@dataclass(kw_only=True, frozen=True, slots=True)
class DetectorSetting:
    """The detector setting of a replay: the whole-job false-alarm rate (one for every scenario)."""

    false_alarm_rate: float = DEFAULT_FALSE_ALARM_RATE
    """``--mechmon-false-alarm-rate``: expected false alarms per 10^6 steps for the run's job."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


DEFAULT_DETECTOR = DetectorSetting()
"""The session's default (what the study's runs used online)."""

CALIBRATION_CANDIDATES: tuple[DetectorSetting, ...] = tuple(
    DetectorSetting(false_alarm_rate=r) for r in (1e4, 1e3, 1e2, 10.0, 1.0, 0.1, 0.01, 1e-3)
)
"""Rates from most to least sensitive, for a study run with an explicit clean calibration seed:
it takes the first rate with no mechmon alarm on that run, then ``CALIBRATION_MARGIN`` rates
further towards the less sensitive end."""

CALIBRATION_MARGIN = 1


@dataclass(kw_only=True, frozen=True, slots=True)
class DivergenceRule:
    """Loss divergence: see the module docstring."""

    factor: float = 1.3
    """The short moving average must exceed this multiple of the running minimum."""
    window: int = 10
    """Steps of the short moving average of the loss that is compared."""
    reference_window: int = 50
    """Steps of the moving average whose running minimum is the reference."""
    patience: int = 10
    """Consecutive steps above the level that make a divergence (reported at the first)."""

    def first_step(self, steps: list[int], losses: list[float]) -> Optional[int]:
        if self.factor <= 1 or self.window < 1 or self.reference_window < 1 or self.patience < 1:
            raise ValueError("divergence rule needs factor > 1 and window, reference_window, patience >= 1.")
        run_start: Optional[int] = None
        run_len = 0
        running_min = math.inf
        for i, (step, loss) in enumerate(zip(steps, losses)):
            if not math.isfinite(loss):
                return run_start if run_start is not None else step
            if i + 1 >= self.window and math.isfinite(running_min):
                short = math.fsum(losses[i + 1 - self.window:i + 1]) / self.window
                if short > self.factor * running_min:
                    run_start = step if run_start is None else run_start
                    run_len += 1
                    if run_len >= self.patience:
                        return run_start
                else:
                    run_start, run_len = None, 0
            if i + 1 >= self.reference_window:
                ref = math.fsum(losses[i + 1 - self.reference_window:i + 1]) / self.reference_window
                running_min = min(running_min, ref)
        return None


@dataclass(kw_only=True, frozen=True, slots=True)
class CollapseRule:
    """Expert collapse: see the module docstring."""

    max_vio_level: float = 2.0
    patience: int = 5

    def first_step(self, checks: list[tuple[int, Mapping[str, float]]]) -> Optional[int]:
        run_start: Optional[int] = None
        run_len = 0
        for step, scalars in checks:
            vios = [v for k, v in scalars.items() if k.startswith("mechmon/router/max_vio/")]
            if not vios:
                continue
            if any((not math.isfinite(v)) or v >= self.max_vio_level for v in vios):
                run_start = step if run_start is None else run_start
                run_len += 1
                if run_len >= self.patience:
                    return run_start
            else:
                run_start, run_len = None, 0
        return None


# ---------------------------------------------------------------------------------------- I/O
def read_jsonl(path: str) -> list[dict[str, Any]]:
    """Rows of a JSONL file; a truncated last line (a run still writing) is skipped."""
    try:
        with open(path, encoding="utf-8") as f:
            return jsonl_rows(f)
    except FileNotFoundError:
        return []


def _num(value: Any) -> float:
    return math.nan if value is None else float(value)


@dataclass
class RunData:
    """The per-step metrics and per-check scalars of one run, sorted by step."""

    steps: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    grad_norm: list[float] = field(default_factory=list)
    max_attn_logit: list[float] = field(default_factory=list)
    checks: list[tuple[int, dict[str, float]]] = field(default_factory=list)

    @classmethod
    def from_rows(cls, metrics: Iterable[Mapping[str, Any]], checks: Iterable[Mapping[str, Any]]) -> RunData:
        data = cls()
        for row in sorted(metrics, key=lambda r: int(r["iteration"])):
            data.steps.append(int(row["iteration"]))
            data.loss.append(_num(row.get("lm_loss")))
            data.grad_norm.append(_num(row.get("grad_norm")))
            data.max_attn_logit.append(_num(row.get("max_attn_logit")))
        for row in sorted(checks, key=lambda r: int(r["step"])):
            data.checks.append((int(row["step"]), {k: _num(v) for k, v in row["scalars"].items()}))
        return data

    @classmethod
    def from_files(cls, metrics_path: str, scalars_path: str) -> RunData:
        return cls.from_rows(read_jsonl(metrics_path), read_jsonl(scalars_path))

    def series(self, name: str) -> tuple[list[int], list[float]]:
        """One mechmon scalar over the checks that recorded it."""
        pts = [(s, sc[name]) for s, sc in self.checks if name in sc]
        return [p[0] for p in pts], [p[1] for p in pts]

    def scalar_names(self) -> list[str]:
        return sorted({k for _, sc in self.checks for k in sc})


# ------------------------------------------------------------------------------- replays
def replay_mechmon(data: RunData, setting: DetectorSetting = DEFAULT_DETECTOR, interval: int = 20,
                   delta: int = 100, schedule: Optional[TrainingSchedule] = None) -> dict[str, Any]:
    """First alarm per family of the whole-job detector replayed at ``setting`` (the session's
    shipped null tails, the thresholds of this run's layers, and their phase moments where they
    match the run's learning-rate ``schedule``, as the session applies them), and who carried it."""
    if not data.checks:
        return {"first_alarm": {f: None for f in MECHMON_FAMILIES}, "first_stream": {f: None for f in MECHMON_FAMILIES},
                "num_streams": 0}
    overlap = max(1, math.ceil(delta / interval))
    table = load_tail_table()
    thresholds, _ = thresholds_at_rate(data.checks, interval, overlap, setting.false_alarm_rate, table)
    phase, _ = select_phase_table(table.phase, interval, delta, schedule, attention_kind(data.checks))
    replay = replay_pooled(data.checks, thresholds, default_sequential_config(interval), phase=phase)
    first_stream: dict[str, Optional[str]] = {f: None for f in MECHMON_FAMILIES}
    for alarm in replay.alarms:
        if first_stream[alarm.family] is None:
            members = " ".join(m for m in alarm.members if m)
            where = ("layers " if len(alarm.layers) > 1 else "layer ") + ",".join(map(str, alarm.layers))
            first_stream[alarm.family] = f"{where}{' ' + members if members else ''} ({alarm.kind}, {alarm.level} test)"
    streams = {(o.family, o.layer, o.member) for _, sc in data.checks[:3] for o in observations_from_scalars(sc)}
    return {"first_alarm": {f: replay.first_alarm.get(f) for f in MECHMON_FAMILIES}, "first_stream": first_stream,
            "num_streams": len(streams)}


@dataclass(kw_only=True, frozen=True, slots=True)
class GrowthSetting:
    """Where the growth rules (max attention logit, W_q spectral norm) take their reference."""

    start_step: int = 200
    """Values before this step are ignored: from initialisation both signals grow many-fold in
    any healthy run (with a reference in the first 100 steps the rule fires on every run)."""

    logit_reference_steps: int = 100
    """Steps (from ``start_step``) whose median is the max-attention-logit reference."""

    wq_reference_checks: int = 10
    """Checks (from ``start_step``) whose median is each layer's W_q spectral-norm reference."""


def replay_symptoms(data: RunData, growth: GrowthSetting = GrowthSetting()) -> dict[str, Any]:
    """First alarm of every symptom baseline (keys of :data:`SYMPTOM_KEYS`), plus
    ``all_rules``: every rule of :func:`build_symptom_rules` on loss and grad norm, and the
    growth rules with a reference in the first 100 steps (``*/growth_from_step_1``)."""
    rules = build_symptom_rules(["loss", "grad_norm", "max_attn_logit"])
    rules["max_attn_logit/growth_from_step_1"] = rules.pop("max_attn_logit/growth")
    rules["max_attn_logit/growth"] = GrowthRule(reference_steps=growth.logit_reference_steps, name="max_attn_logit")
    have_logit = any(math.isfinite(v) for v in data.max_attn_logit)
    for step, loss, gn, logit in zip(data.steps, data.loss, data.grad_norm, data.max_attn_logit):
        for key in ("loss/olmo_spike", "loss/megatron_spike", "loss/foundry_spike", "loss/running_mean_relative"):
            rules[key].update(step, loss)
        for key in ("grad_norm/olmo_spike", "grad_norm/megatron_spike", "grad_norm/foundry_spike",
                    "grad_norm/running_mean_relative"):
            rules[key].update(step, gn)
        if have_logit:
            rules["max_attn_logit/growth_from_step_1"].update(step, logit)
            if step >= growth.start_step:
                rules["max_attn_logit/growth"].update(step, logit)
    out: dict[str, Any] = {key: rules[rule].first_alarm_step for key, rule in _SYMPTOM_RULE_OF_KEY.items()}
    if not have_logit:
        out["max_attn_logit"] = None
    out["wq_spectral_norm"] = _wq_growth(data, growth)
    out["all_rules"] = {key: rule.first_alarm_step for key, rule in sorted(rules.items())}
    return out


def _wq_growth(data: RunData, growth: GrowthSetting) -> Optional[int]:
    first: Optional[int] = None
    for name in data.scalar_names():
        if not name.startswith(f"{names.PREFIX}/attn/wq_spectral_norm/"):
            continue
        rule = GrowthRule(reference_steps=growth.wq_reference_checks, name=name)
        for step, value in zip(*data.series(name)):
            if step >= growth.start_step:
                rule.update(step, value)
        if rule.first_alarm_step is not None and (first is None or rule.first_alarm_step < first):
            first = rule.first_alarm_step
    return first


def _earliest(first: Mapping[str, Optional[int]]) -> Optional[int]:
    steps = [v for v in first.values() if v is not None]
    return min(steps) if steps else None


def online_first_alarm(data: RunData) -> Optional[int]:
    """First check at which the online session raised ``mechmon/alarm`` (for offline == online)."""
    for step, scalars in data.checks:
        if scalars.get(names.ALARM, 0.0) >= 1.0:
            return step
    return None


# ---------------------------------------------------------------------------------- leads
def lead(alarm: Optional[int], event: Optional[int], onset: Optional[int]) -> tuple[Optional[int], Optional[float]]:
    """``(event - alarm, (event - alarm) / (event - onset))``; None where undefined (no alarm,
    no event, an alarm after the event or before the onset)."""
    if alarm is None or event is None:
        return None, None
    start = 0 if onset is None else onset
    if alarm < start or alarm > event:
        return None, None
    steps = event - alarm
    span = event - start
    return steps, (steps / span if span > 0 else None)


def analyze_run(
    data: RunData,
    *,
    fault_onset: Optional[int],
    router_fault_onset: Optional[int] = None,
    setting: DetectorSetting = DEFAULT_DETECTOR,
    divergence: DivergenceRule = DivergenceRule(),
    collapse: CollapseRule = CollapseRule(),
    growth: GrowthSetting = GrowthSetting(),
    interval: int = 20,
    delta: int = 100,
    schedule: Optional[TrainingSchedule] = None,
) -> dict[str, Any]:
    """Everything ``results.json`` records for one run (except scenario/seed bookkeeping).

    ``interval`` / ``delta``: the run's ``--mechmon-interval`` / ``--mechmon-delta``; ``schedule``:
    its learning-rate schedule (the early-phase correction applies where it matches the shipped one).

    ``router_fault_onset``: onset of a router-family fault when it differs from ``fault_onset``
    (``combined``: the high LR acts from step 1, the FA fault from its onset); it applies to the
    router families' leads and false-alarm flags.
    """

    def onset_of(key: str) -> Optional[int]:
        return router_fault_onset if key in ROUTER_FAMILIES and router_fault_onset is not None else fault_onset

    mech = replay_mechmon(data, setting, interval, delta, schedule)
    default_replay = (mech if setting == DEFAULT_DETECTOR
                      else replay_mechmon(data, DEFAULT_DETECTOR, interval, delta, schedule))
    symptoms = replay_symptoms(data, growth)
    first_alarm = {key: mech["first_alarm"].get(key, symptoms.get(key)) for key in ALARM_KEYS}
    div = divergence.first_step(data.steps, data.loss)
    col = collapse.first_step(data.checks)
    leads = {}
    for key in ALARM_KEYS:
        steps, share = lead(first_alarm[key], div, onset_of(key))
        leads[key] = {"steps": steps, "share": share}
    collapse_leads = {}
    for key in ROUTER_FAMILIES:
        steps, share = lead(first_alarm[key], col, onset_of(key))
        collapse_leads[key] = {"steps": steps, "share": share}
    false_alarms = {
        key: first_alarm[key] is not None and (onset_of(key) is None or first_alarm[key] < onset_of(key))
        for key in ALARM_KEYS
    }
    return {
        "fault_onset": fault_onset,
        "router_fault_onset": router_fault_onset,
        "divergence_step": div,
        "expert_collapse_step": col,
        "first_alarm": first_alarm,
        "first_alarm_stream": mech["first_stream"],
        "online_first_alarm": online_first_alarm(data),
        # The runs use the session's default detector flags online: this replay must equal it.
        "replay_first_alarm_default_setting": _earliest(default_replay["first_alarm"]),
        "symptom_rules": symptoms["all_rules"],
        "lead_to_divergence": leads,
        "lead_to_collapse": collapse_leads,
        "false_alarm": false_alarms,
        "steps_recorded": data.steps[-1] if data.steps else 0,
        "final_loss": data.loss[-1] if data.loss else None,
        "num_checks": len(data.checks),
    }


def choose_detector_setting(
    calibration: RunData,
    candidates: tuple[DetectorSetting, ...] = CALIBRATION_CANDIDATES,
    margin: int = CALIBRATION_MARGIN,
    interval: int = 20,
    delta: int = 100,
) -> tuple[DetectorSetting, list[dict[str, Any]]]:
    """The first (most sensitive) candidate with no mechmon alarm on the clean calibration run,
    moved ``margin`` candidates towards the less sensitive end.

    Returns the setting and a JSON-serialisable log (every candidate tried, its alarms, and the
    choice); the least sensitive candidate is used if every candidate alarms (the log says so).
    """
    if margin < 0:
        raise ValueError(f"calibration margin must be >= 0, got {margin}.")
    log: list[dict[str, Any]] = []
    for index, cand in enumerate(candidates):
        first = replay_mechmon(calibration, cand, interval, delta)["first_alarm"]
        alarms = {k: v for k, v in first.items() if v is not None}
        log.append({"setting": cand.to_dict(), "alarms": alarms})
        if not alarms:
            chosen = min(index + margin, len(candidates) - 1)
            log.append({"quiet": index, "chosen": chosen, "margin": margin})
            return candidates[chosen], log
    log.append({"note": "every candidate alarmed on the calibration run; using the least sensitive one"})
    return candidates[-1], log
