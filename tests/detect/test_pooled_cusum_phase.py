"""The early-phase correction inside the real ``PooledCusumDetector`` (``phase=``, ``collect_young=``).

On hand-built checks, against a reference computed beside the detector (one ``RobustTrend`` per
stream, fed the same values): while a stream's baseline is young, the layer residual of a
``phase_corrected`` family is the trimmed mean of ``(z - c) / s`` for its check's bin; once the
baseline holds ``window`` values it is ``z`` again, as it is at a step outside every bin and for a
family without ``phase_corrected`` (``router_entropy``). ``phase=None`` is the detector without the
correction; ``collect_young`` lists the uncorrected young residuals; a state saved mid-run and
loaded into a new detector continues exactly as the uninterrupted run.
"""

from __future__ import annotations

import json
import math
import random

import pytest

from mechmon_megatron.detect.families import FAMILY_BY_NAME
from mechmon_megatron.detect.phase_moments import PhaseBin, PhaseTable, TrainingSchedule
from mechmon_megatron.detect.pooled_cusum import (
    FAMILY_DIRECTIONS,
    FamilyThresholds,
    Observation,
    PooledCusumDetector,
    SequentialConfig,
    Thresholds,
)
from mechmon_megatron.detect.robust_trend import RobustTrend, TrendConfig

WINDOW, WARMUP = 8, 3
TREND = TrendConfig(window=WINDOW, warmup=WARMUP, min_trend=6, rel_scale_floor=0.0, abs_scale_floor=0.01)
CFG = SequentialConfig(trend=TREND, clip=8.0, trim=0.25)
INTERVAL = 10
BIN = 50
CENTRE = {"attn_delta2": -0.8, "attn_dw": 0.6, "router_entropy": 1.5}
SCALE = {"attn_delta2": 2.5, "attn_dw": 0.5, "router_entropy": 3.0}
GAP = range(100, 150)  # steps of no measured bin


def _phase(families=("attn_delta2", "attn_dw", "router_entropy"), centre=CENTRE, scale=SCALE, last=400):
    """Bins of BIN steps from 0 to ``last``, except the gap [100, 150); each family its own moments,
    which differ per bin (so that a wrong bin shows)."""
    starts = [s for s in range(0, last, BIN) if s not in GAP]
    return PhaseTable(
        interval=INTERVAL, delta=100, schedule=TrainingSchedule(100, "cosine", 2e-3), bin_steps=BIN,
        families={f: tuple(PhaseBin(s, centre[f] + s / 1000, scale[f] * (1 + s / 500), 40) for s in starts)
                  for f in families},
    )


def _thresholds(layer=(1e9, 1e9), family=(1e9, 1e9)):
    return {f: FamilyThresholds(layer=Thresholds(*layer), family=Thresholds(*family))
            for f in ("attn_delta2", "attn_dw", "router_entropy")}


def _members(family):
    if family == "attn_dw":
        return ("dw_entropy", "dwk_entropy")
    if family == "router_entropy":
        return ("token_entropy",)
    return tuple(f"head_{h}" for h in range(4))


def _checks(n, seed=0, families=("attn_delta2", "attn_dw", "router_entropy"), layers=(1, 2)):
    """``n`` checks (steps 10, 20, ...): noisy values with a slow rise (a young phase's drift)."""
    rng = random.Random(seed)
    out = []
    for i in range(1, n + 1):
        obs = [Observation(family=f, layer=L, member=m, value=2.0 + 0.002 * i + rng.gauss(0, 0.02))
               for f in families for L in layers for m in _members(f)]
        out.append((i * INTERVAL, obs))
    return out


def _trimmed(values, trim=0.25):
    xs = sorted(values)
    cut = int(trim * len(xs))
    kept = xs[cut:len(xs) - cut] or xs
    return sum(kept) / len(kept)


class Reference:
    """The detector's residuals computed beside it, from the specification: every value of a check
    with thresholds at infinity enters its stream's baseline after the check."""

    def __init__(self, bins=None):
        self.trends: dict[tuple[str, int, str], RobustTrend] = {}
        self.bins = bins  # family -> {start: (centre, scale)}; None: no correction

    def update(self, step, observations):
        zs: dict[tuple[str, int], dict[str, float]] = {}
        raw_young: dict[str, list[float]] = {}
        corrected: dict[tuple[str, int], bool] = {}
        for obs in sorted(observations, key=lambda o: (o.family, o.layer, o.member)):
            trend = self.trends.setdefault((obs.family, obs.layer, obs.member),
                                           RobustTrend(TREND, FAMILY_DIRECTIONS[obs.family]))
            prediction = trend.predict()
            if prediction is not None:
                z = trend.residual(obs.value, prediction)
                young = len(trend.values) < WINDOW
                if young and obs.family in ("attn_delta2", "attn_dw"):
                    raw_young.setdefault(obs.family, []).append(z)
                    moments = (self.bins or {}).get(obs.family, {}).get(step - step % BIN)
                    if moments is not None:
                        z = (z - moments[0]) / moments[1]
                        corrected[(obs.family, obs.layer)] = True
                zs.setdefault((obs.family, obs.layer), {})[obs.member] = max(-8.0, min(8.0, z))
            trend.accept(obs.value)
        residuals = {f"{f}/residual/layer_{L}": _trimmed(v.values()) for (f, L), v in zs.items()}
        return residuals, raw_young, corrected


def _bins_of(table):
    return {f: {b.start: (b.centre, b.scale) for b in bins} for f, bins in table.families.items()}


def _residuals(result):
    return {k: v for k, v in result.statistics.items() if "/residual/" in k}


def test_first_young_check_is_standardised_by_its_bin_by_hand():
    """Warm-up at 1.0: the baseline is 1.0 with the scale floor 0.01, so 0.97 has z = 3 exactly;
    the bin's moments (c = 1, s = 0.5) make it (3 - 1) / 0.5 = 4."""
    phase = PhaseTable(INTERVAL, 100, TrainingSchedule(100, "cosine", 2e-3), 100,
                       {"attn_delta2": (PhaseBin(0, 1.0, 0.5, 40),)})
    plain = PooledCusumDetector(_thresholds(), CFG)
    corrected = PooledCusumDetector(_thresholds(), CFG, phase=phase)
    heads = [Observation("attn_delta2", 1, f"head_{h}", 1.0) for h in range(4)]
    for step in (10, 20, 30):
        assert _residuals(plain.update(step, heads)) == _residuals(corrected.update(step, heads)) == {}
    shifted = [Observation("attn_delta2", 1, f"head_{h}", 0.97) for h in range(4)]
    assert plain.update(40, shifted).statistics["attn_delta2/residual/layer_1"] == pytest.approx(3.0)
    res = corrected.update(40, shifted)
    assert res.statistics["attn_delta2/residual/layer_1"] == pytest.approx(4.0)
    assert res.statistics["attn_delta2/cusum/layer_1"] == pytest.approx(4.0 - CFG.reference)


def test_young_residuals_are_corrected_and_grown_ones_are_not():
    table = _phase()
    detector = PooledCusumDetector(_thresholds(), CFG, phase=table)
    corrected_ref = Reference(_bins_of(table))
    plain_ref = Reference()
    seen = {"young corrected": 0, "grown in a bin": 0}
    for step, obs in _checks(30):
        result = detector.update(step, obs)
        expected, _, corrected = corrected_ref.update(step, obs)
        plain, _, _ = plain_ref.update(step, obs)
        got = _residuals(result)
        assert set(got) == set(expected)
        for key, value in expected.items():
            assert got[key] == pytest.approx(value, rel=1e-12, abs=1e-12), (step, key)
        young = step // INTERVAL - 1 < WINDOW  # every value enters: check i meets a window of i - 1
        for key in got:
            family, layer = key.split("/")[0], int(key.rsplit("_", 1)[1])
            in_bin = step < 400 and step not in GAP
            if family == "router_entropy" or not young or not in_bin:
                assert got[key] == pytest.approx(plain[key], rel=1e-12, abs=1e-12), (step, key)
            else:
                assert corrected[(family, layer)]
                assert got[key] != pytest.approx(plain[key], abs=1e-6), (step, key)
            seen["young corrected"] += young and in_bin and family != "router_entropy"
            seen["grown in a bin"] += not young and in_bin
    # Checks 4-8 (steps 40-80) are young: 2 families x 2 layers; the grown ones fall in bins too.
    assert seen["young corrected"] == (WINDOW - WARMUP) * 4 and seen["grown in a bin"] > 0, seen


def test_a_family_without_phase_corrected_is_never_corrected():
    assert not FAMILY_BY_NAME["router_entropy"].phase_corrected
    assert FAMILY_BY_NAME["attn_delta2"].phase_corrected and FAMILY_BY_NAME["attn_dw"].phase_corrected
    checks = _checks(12, seed=3, families=("router_entropy",))
    # A table that has bins for router_entropy: only the family's flag keeps them out.
    with_table = PooledCusumDetector(_thresholds(), CFG, phase=_phase(), collect_young=True)
    without = PooledCusumDetector(_thresholds(), CFG)
    reference = Reference()
    checked = 0
    for step, obs in checks:
        a, b = with_table.update(step, obs), without.update(step, obs)
        expected, _, _ = reference.update(step, obs)
        assert a.statistics == b.statistics
        assert _residuals(a) == pytest.approx(expected)
        assert a.young_residuals == {}
        checked += len(expected)
    assert checked > 0


def test_a_step_outside_every_bin_is_uncorrected():
    """Young baselines at steps in the gap between bins and after the last one: the plain residual."""
    table = _phase(last=200)  # bins [0, 100) and [150, 200): steps 100-149 and 200 on are outside
    # A window of 40 keeps every baseline young over the 30 checks (steps 10-300).
    long_cfg = SequentialConfig(trend=TrendConfig(window=40, warmup=WARMUP, min_trend=6, rel_scale_floor=0.0,
                                                  abs_scale_floor=0.01))
    detector = PooledCusumDetector(_thresholds(), long_cfg, phase=table)
    plain = PooledCusumDetector(_thresholds(), long_cfg)
    outside = inside = 0
    for step, obs in _checks(30, seed=4):
        a, b = _residuals(detector.update(step, obs)), _residuals(plain.update(step, obs))
        assert set(a) == set(b)
        if not a:
            continue
        inside_bin = step < 100 or 150 <= step < 200
        for key in a:
            if key.startswith("router_entropy") or not inside_bin:
                assert a[key] == b[key], (step, key)
            else:
                assert a[key] != pytest.approx(b[key], abs=1e-6), (step, key)
        outside += not inside_bin
        inside += inside_bin
    assert outside == 5 + 11 and inside == 6 + 5  # 100-140, 200-300 against 40-90, 150-190


def _run(detector, checks):
    results = [detector.update(step, obs) for step, obs in checks]
    return [(r.statistics, r.alarms, r.warnings, r.young_residuals) for r in results]


def _shifted_checks(seed=5):
    """Healthy checks, then a drop of attn_delta2 in layer 2 that the CUSUM alarms on (and restarts)."""
    checks = _checks(40, seed=seed)
    out = []
    for i, (step, obs) in enumerate(checks):
        if 12 <= i < 24:
            obs = [Observation(o.family, o.layer, o.member, o.value - 0.08)
                   if o.family == "attn_delta2" and o.layer == 2 else o for o in obs]
        out.append((step, obs))
    return out


def test_phase_none_is_the_detector_without_the_correction():
    checks = _shifted_checks()
    thresholds = _thresholds(layer=(3.0, 6.0), family=(3.0, 6.0))
    old = _run(PooledCusumDetector(thresholds, CFG), checks)
    assert any(alarms for _, alarms, _, _ in old)  # the sequence alarms: the comparison covers restarts
    assert _run(PooledCusumDetector(thresholds, CFG, phase=None), checks) == old
    # Moments that change nothing (c = 0, s = 1; no bins) give the same decisions too...
    identity = _phase(centre=dict.fromkeys(CENTRE, 0.0), scale=dict.fromkeys(SCALE, 1.0))
    identity = PhaseTable(identity.interval, identity.delta, identity.schedule, identity.bin_steps,
                          {f: tuple(PhaseBin(b.start, 0.0, 1.0, b.samples) for b in bins)
                           for f, bins in identity.families.items()})
    assert _run(PooledCusumDetector(thresholds, CFG, phase=identity), checks) == old
    empty = PhaseTable(INTERVAL, 100, TrainingSchedule(100, "cosine", 2e-3), BIN, {"attn_delta2": (), "attn_dw": ()})
    assert _run(PooledCusumDetector(thresholds, CFG, phase=empty), checks) == old
    # ... and real moments change them (the comparison above can fail).
    assert _run(PooledCusumDetector(thresholds, CFG, phase=_phase()), checks) != old


def test_collect_young_lists_the_uncorrected_young_residuals():
    table = _phase()
    detector = PooledCusumDetector(_thresholds(), CFG, phase=table, collect_young=True)
    reference = Reference(_bins_of(table))
    listed = grown = 0
    for step, obs in _checks(25, seed=6):
        result = detector.update(step, obs)
        _, raw_young, _ = reference.update(step, obs)
        assert set(result.young_residuals) == set(raw_young) <= {"attn_delta2", "attn_dw"}
        for family, zs in raw_young.items():
            assert result.young_residuals[family] == pytest.approx(zs, rel=1e-12, abs=1e-12)
            assert len(zs) == 2 * len(_members(family))  # every stream of both layers
        listed += bool(raw_young)
        if step > WINDOW * INTERVAL and not raw_young:
            grown += 1
            assert result.young_residuals == {}
            assert _residuals(result)  # the residuals are there: only the young list is empty
    assert listed == WINDOW - WARMUP and grown > 10
    # Off by default: the same detector without collect_young lists nothing.
    quiet = PooledCusumDetector(_thresholds(), CFG, phase=table)
    assert all(r.young_residuals == {} for r in (quiet.update(s, o) for s, o in _checks(25, seed=6)))


def test_collect_young_after_a_restart_lists_the_young_baseline_again():
    checks = _shifted_checks(seed=7)
    detector = PooledCusumDetector(_thresholds(layer=(3.0, 6.0), family=(3.0, 6.0)), CFG, phase=_phase(),
                                   collect_young=True)
    alarm_step = None
    young_after = []
    for step, obs in checks:
        result = detector.update(step, obs)
        if alarm_step is None and any(a.family == "attn_delta2" for a in result.alarms):
            alarm_step = step
        elif alarm_step is not None and "attn_delta2" in result.young_residuals:
            young_after.append((step, len(result.young_residuals["attn_delta2"])))
    assert alarm_step is not None
    # The restarted layer re-learns its baseline: after WARMUP checks its 4 heads are young again.
    assert young_after and young_after[0][0] == alarm_step + (WARMUP + 1) * INTERVAL
    assert all(n in (4, 8) for _, n in young_after)


@pytest.mark.parametrize("cut", [5, 9, 20])
def test_state_round_trip_continues_identically(cut):
    checks = _shifted_checks(seed=8)
    thresholds = _thresholds(layer=(3.0, 6.0), family=(3.0, 6.0))
    phase = _phase()
    whole = _run(PooledCusumDetector(thresholds, CFG, phase=phase, collect_young=True), checks)
    first = PooledCusumDetector(thresholds, CFG, phase=phase, collect_young=True)
    head = _run(first, checks[:cut])
    state = json.loads(json.dumps(first.state_dict()))
    second = PooledCusumDetector(thresholds, CFG, phase=phase, collect_young=True)
    second.load_state_dict(state)
    assert head + _run(second, checks[cut:]) == whole
    # The same state loaded without the moments continues differently while baselines are young.
    if cut < WINDOW:
        third = PooledCusumDetector(thresholds, CFG, collect_young=True)
        third.load_state_dict(state)
        assert head + _run(third, checks[cut:]) != whole


def test_residual_is_clipped_after_the_correction():
    """A small z standardised by a tiny scale is clipped at ``clip``, as an uncorrected one is."""
    phase = PhaseTable(INTERVAL, 100, TrainingSchedule(100, "cosine", 2e-3), 100,
                       {"attn_delta2": (PhaseBin(0, -1.0, 0.01, 40),)})
    detector = PooledCusumDetector(_thresholds(), CFG, phase=phase)
    for step in (10, 20, 30):
        detector.update(step, [Observation("attn_delta2", 1, f"head_{h}", 1.0) for h in range(4)])
    res = detector.update(40, [Observation("attn_delta2", 1, f"head_{h}", 1.0) for h in range(4)])
    assert res.statistics["attn_delta2/residual/layer_1"] == CFG.clip  # (0 + 1) / 0.01 = 100 -> 8
    assert math.isfinite(res.statistics["attn_delta2/cusum/layer_1"])
