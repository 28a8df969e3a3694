"""The early-phase correction's moments (``detect/phase_moments.py``) and their place in a calibration file.

* ``fit_phase_table`` against a brute-force per-bin median and 1.4826 * MAD (bins under
  ``min_samples`` and zero-scale bins left out, non-finite residuals ignored);
* ``PhaseTable.standardise`` inside a measured bin and the identity outside every one (before the
  first, in a gap, after the last), ``covered_until``;
* ``to_dict`` / ``from_dict`` round trip, and every bad field of ``from_dict`` named in its
  ``ValueError``; ``phase_tables_from_list`` refuses duplicates and non-lists;
* ``select_phase_table``: each reason the correction is off, and the match;
* ``TailTable``: no ``phase`` key without moments (old files unchanged), a round trip with them, a
  bad section refused, and the shipped table's moments for the schedules it serves.
"""

from __future__ import annotations

import copy
import json
import math
import random
import statistics

import pytest

from mechmon_megatron.detect.null_model import _TAIL_FILE, NullTail, TailTable, load_tail_table
from mechmon_megatron.detect.phase_moments import (
    DEFAULT_BIN_STEPS,
    MIN_BIN_SAMPLES,
    PhaseBin,
    PhaseTable,
    TrainingSchedule,
    fit_phase_table,
    phase_tables_from_list,
    select_phase_table,
)

COSINE = TrainingSchedule(100, "cosine", 2e-3)


def _brute_force(pairs, bin_steps, min_samples):
    """Per bin start: (centre, scale, samples), computed directly from the definition."""
    groups: dict[int, list[float]] = {}
    for step, z in pairs:
        if math.isnan(z) or math.isinf(z):
            continue
        groups.setdefault(step - step % bin_steps, []).append(z)
    out = {}
    for start, zs in groups.items():
        if len(zs) < min_samples:
            continue
        centre = statistics.median(zs)
        deviations = sorted(abs(z - centre) for z in zs)
        n = len(deviations)
        mad = deviations[n // 2] if n % 2 else (deviations[n // 2 - 1] + deviations[n // 2]) / 2
        if 1.4826 * mad > 0:
            out[start] = (centre, 1.4826 * mad, len(zs))
    return out


# ---------------------------------------------------------------- fit_phase_table


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_fit_matches_a_brute_force_median_and_mad_per_bin(seed):
    rng = random.Random(seed)
    bin_steps, min_samples = 50, 8
    residuals = {}
    for family in ("attn_delta2", "attn_dw"):
        pairs = []
        for _ in range(600):
            step = rng.randrange(0, 1000)
            # The centre and spread move with the phase, as a young baseline's residual does.
            pairs.append((step, rng.gauss(-1.0 + step / 1000, 0.5 + step / 2000)))
        # Sparse bins (too few samples), one zero-scale bin, and non-finite values to ignore.
        pairs += [(1020, 0.3)] * (min_samples - 1)
        pairs += [(1105, 2.0)] * 9 + [(1110, 5.0)] * 2
        pairs += [(rng.randrange(0, 1200), v) for v in (math.nan, math.inf, -math.inf)]
        residuals[family] = pairs
    table = fit_phase_table(residuals, 20, 100, COSINE, bin_steps=bin_steps, min_samples=min_samples)
    assert (table.interval, table.delta, table.schedule, table.bin_steps) == (20, 100, COSINE, bin_steps)
    assert set(table.families) == set(residuals)
    for family, pairs in residuals.items():
        expected = _brute_force(pairs, bin_steps, min_samples)
        bins = table.families[family]
        assert [b.start for b in bins] == sorted(expected)
        assert 1000 not in expected and 1100 not in expected  # the sparse and the zero-scale bin
        for b in bins:
            centre, scale, samples = expected[b.start]
            assert b.centre == pytest.approx(centre, rel=1e-12, abs=1e-12)
            assert b.scale == pytest.approx(scale, rel=1e-12)
            assert b.samples == samples
            assert math.isfinite(b.centre) and b.scale > 0


def test_fit_on_a_hand_computed_bin():
    """zs 1..5: median 3, |z - 3| = 2 1 0 1 2 with median 1, scale 1.4826; a NaN does not count."""
    pairs = [(210, 5.0), (250, 1.0), (399, 3.0), (200, 2.0), (300, 4.0), (220, math.nan)]
    table = fit_phase_table({"attn_delta2": pairs}, 20, 100, COSINE, bin_steps=200, min_samples=5)
    assert table.families["attn_delta2"] == (PhaseBin(start=200, centre=3.0, scale=1.4826, samples=5),)
    # One sample fewer than min_samples: the bin is left out; the family stays, with no bins.
    table = fit_phase_table({"attn_delta2": pairs}, 20, 100, COSINE, bin_steps=200, min_samples=6)
    assert table.families == {"attn_delta2": ()}
    assert table.covered_until() == 0


def test_fit_defaults_and_bad_arguments():
    pairs = [(s, float(s % 7)) for s in range(0, DEFAULT_BIN_STEPS * 2)]
    table = fit_phase_table({"attn_dw": pairs}, 20, 100, COSINE)
    assert table.bin_steps == DEFAULT_BIN_STEPS
    assert [b.samples for b in table.families["attn_dw"]] == [DEFAULT_BIN_STEPS, DEFAULT_BIN_STEPS]
    few = fit_phase_table({"attn_dw": pairs[: MIN_BIN_SAMPLES - 1]}, 20, 100, COSINE)
    assert few.families["attn_dw"] == ()
    for kwargs in ({"bin_steps": 0}, {"min_samples": 0}):
        with pytest.raises(ValueError, match="bin_steps and min_samples must be >= 1"):
            fit_phase_table({"attn_dw": pairs}, 20, 100, COSINE, **kwargs)


# ---------------------------------------------------------------- standardise, covered_until


def _table(schedule=COSINE, interval=20, delta=100):
    return PhaseTable(
        interval=interval, delta=delta, schedule=schedule, bin_steps=100,
        families={
            # Measured bins [100, 200) and [300, 400): before, between and after them nothing is.
            "attn_delta2": (PhaseBin(100, -1.5, 2.0, 40), PhaseBin(300, 0.5, 0.25, 40)),
            "attn_dw": (PhaseBin(500, 1.0, 4.0, 31),),
            "router_entropy": (),
        },
    )


@pytest.mark.parametrize("step,expected", [
    (100, (3.0 + 1.5) / 2.0), (150, (3.0 + 1.5) / 2.0), (199, (3.0 + 1.5) / 2.0),
    (300, (3.0 - 0.5) / 0.25), (399, (3.0 - 0.5) / 0.25),
    (0, 3.0), (99, 3.0),  # before the first bin
    (200, 3.0), (299, 3.0),  # in the gap between bins
    (400, 3.0), (10_000, 3.0),  # after the last
])
def test_standardise_inside_a_bin_and_identity_outside(step, expected):
    table = _table()
    assert table.standardise("attn_delta2", step, 3.0) == pytest.approx(expected)
    b = table.bin_of("attn_delta2", step)
    assert (b is None) == (expected == 3.0)


def test_standardise_is_per_family():
    table = _table()
    assert table.standardise("attn_dw", 150, 3.0) == 3.0  # attn_delta2's bin, not attn_dw's
    assert table.standardise("attn_dw", 550, 3.0) == pytest.approx(0.5)
    assert table.standardise("router_entropy", 150, 3.0) == 3.0  # no bins
    assert table.standardise("attn_delta2_short", 150, 3.0) == 3.0  # not in the table


def test_covered_until():
    assert _table().covered_until() == 600  # attn_dw's last bin [500, 600)
    only_delta2 = PhaseTable(20, 100, COSINE, 100, {"attn_delta2": _table().families["attn_delta2"]})
    assert only_delta2.covered_until() == 400
    assert PhaseTable(20, 100, COSINE, 100, {"attn_delta2": ()}).covered_until() == 0
    assert PhaseTable(20, 100, COSINE, 100).covered_until() == 0


# ---------------------------------------------------------------- to_dict / from_dict


def test_round_trip_through_json():
    table = _table(TrainingSchedule(250, "WSD", 2e-3), interval=50, delta=200)
    data = json.loads(json.dumps(table.to_dict()))
    assert data["lr_warmup_steps"] == 250 and data["lr_decay_style"] == "WSD"
    assert data["families"]["attn_delta2"] == [[100, -1.5, 2.0, 40], [300, 0.5, 0.25, 40]]
    back = PhaseTable.from_dict(data)
    assert back == table
    assert back.to_dict() == table.to_dict()


def test_integer_centre_and_scale_are_read_as_floats():
    data = _table().to_dict()
    data["families"]["attn_dw"] = [[500, 1, 4, 31]]
    back = PhaseTable.from_dict(data)
    (b,) = back.families["attn_dw"]
    assert (b.centre, b.scale) == (1.0, 4.0) and isinstance(b.centre, float) and isinstance(b.scale, float)


def _row(**change):
    row = {"start": 100, "centre": -1.5, "scale": 2.0, "samples": 40}
    row.update(change)
    return [row["start"], row["centre"], row["scale"], row["samples"]]


def _set(key, value):
    def edit(d):
        d[key] = value
    return edit


def _drop(key):
    def edit(d):
        del d[key]
    return edit


def _rows(rows, family="attn_delta2"):
    def edit(d):
        d["families"][family] = rows
    return edit


BAD = [
    (_set("interval", "20"), r"phase\.interval must be an integer >= 1, got '20'"),
    (_set("interval", True), r"phase\.interval must be an integer >= 1, got True"),
    (_set("interval", 0), r"phase\.interval must be an integer >= 1"),
    (_set("delta", 100.0), r"phase\.delta must be an integer >= 1"),
    (_set("delta", True), r"phase\.delta must be an integer"),
    (_drop("delta"), r"phase\.delta must be an integer >= 1, got None"),
    (_set("lr_warmup_steps", -1), r"phase\.lr_warmup_steps must be an integer >= 0"),
    (_set("lr_warmup_steps", False), r"phase\.lr_warmup_steps must be an integer >= 0, got False"),
    (_set("bin_steps", True), r"phase\.bin_steps must be an integer >= 1, got True"),
    (_set("bin_steps", 0), r"phase\.bin_steps must be an integer >= 1"),
    (_drop("lr_decay_style"), r"phase\.lr_decay_style must be a non-empty string, got None"),
    (_set("lr_decay_style", ""), r"phase\.lr_decay_style must be a non-empty string"),
    (_set("lr_decay_style", 3), r"phase\.lr_decay_style must be a non-empty string"),
    (_drop("families"), r"phase\.families must be an object"),
    (_set("families", [["attn_delta2"]]), r"phase\.families must be an object"),
    (_rows("100,-1.5,2,40"), r"phase\.families\['attn_delta2'\] must be a list"),
    (_rows({"start": 100}), r"phase\.families\['attn_delta2'\] must be a list"),
    (_rows([[100, -1.5, 2.0]]), r"phase\.families\['attn_delta2'\]\[0\] must be \[start, centre, scale, samples\]"),
    (_rows(["abcd"]), r"phase\.families\['attn_delta2'\]\[0\] must be \[start, centre, scale, samples\]"),
    (_rows([_row(start=150)]), r"\[0\]: start must be a multiple of bin_steps 100 and >= 0, got 150"),
    (_rows([_row(start=-100)]), r"\[0\]: start must be a multiple of bin_steps 100"),
    (_rows([_row(start=False)]), r"\[0\]: start must be a multiple of bin_steps 100 and >= 0, got False"),
    (_rows([_row(start=100.0)]), r"\[0\]: start must be a multiple"),
    (_rows([_row(centre="1")]), r"\[0\]: centre must be a finite number, got '1'"),
    (_rows([_row(centre=math.nan)]), r"\[0\]: centre must be a finite number"),
    (_rows([_row(centre=True)]), r"\[0\]: centre must be a finite number, got True"),
    (_rows([_row(scale=0.0)]), r"\[0\]: scale must be > 0, got 0\.0"),
    (_rows([_row(scale=-2.0)]), r"\[0\]: scale must be > 0, got -2\.0"),
    (_rows([_row(scale=math.inf)]), r"\[0\]: scale must be a finite number"),
    (_rows([_row(scale=True)]), r"\[0\]: scale must be a finite number, got True"),
    (_rows([_row(samples=0)]), r"\[0\]: samples must be an integer >= 1, got 0"),
    (_rows([_row(samples=True)]), r"\[0\]: samples must be an integer >= 1, got True"),
    (_rows([_row(samples=40.0)]), r"\[0\]: samples must be an integer >= 1, got 40\.0"),
    (_rows([_row(start=300), _row(start=100)]), r"phase\.families\['attn_delta2'\]: bin starts must increase"),
    (_rows([_row(start=100), _row(start=100)]), r"phase\.families\['attn_delta2'\]: bin starts must increase"),
]


@pytest.mark.parametrize("edit,message", BAD)
def test_from_dict_names_the_bad_field(edit, message):
    data = copy.deepcopy(_table().to_dict())
    PhaseTable.from_dict(copy.deepcopy(data))  # the unedited entry is fine
    edit(data)
    with pytest.raises(ValueError, match=message):
        PhaseTable.from_dict(data)


@pytest.mark.parametrize("data", [None, [], "phase", 3])
def test_from_dict_refuses_a_non_object(data):
    with pytest.raises(ValueError, match=r"^phase must be an object, got "):
        PhaseTable.from_dict(data)


def test_phase_tables_from_list():
    a, b = _table(), _table(TrainingSchedule(100, "linear", 2e-3))
    c = _table(interval=100)
    assert phase_tables_from_list([a.to_dict(), b.to_dict(), c.to_dict()]) == (a, b, c)
    assert phase_tables_from_list([]) == ()
    with pytest.raises(ValueError, match='"phase" has two tables for one interval, delta, schedule and attention kind'):
        phase_tables_from_list([a.to_dict(), b.to_dict(), a.to_dict()])
    # Only the bins differ: still one interval, delta and schedule twice.
    other_bins = _table().to_dict()
    other_bins["families"] = {}
    with pytest.raises(ValueError, match="two tables"):
        phase_tables_from_list([a.to_dict(), other_bins])
    for data in (a.to_dict(), "phase", None, 1):
        with pytest.raises(ValueError, match='"phase" must be a list of phase tables, got '):
            phase_tables_from_list(data)
    bad = b.to_dict()
    bad["bin_steps"] = 0
    with pytest.raises(ValueError, match=r"^phase\[1\]\.bin_steps must be an integer >= 1"):
        phase_tables_from_list([a.to_dict(), bad])


# ---------------------------------------------------------------- select_phase_table


def test_select_without_tables_names_an_old_file():
    table, line = select_phase_table((), 20, 100, COSINE)
    assert table is None
    assert "no phase moments" in line and "written before the early-phase correction" in line
    assert "refit it with mechmon-calibrate" in line


def test_select_without_a_table_for_the_check_schedule_names_the_measured_ones():
    tables = (_table(interval=20), _table(interval=100))
    table, line = select_phase_table(tables, 50, 100, COSINE)
    assert table is None
    assert "no phase moments for interval 50 delta 100" in line
    assert "measured: interval 20 delta 100, interval 100 delta 100" in line
    assert "correction is off" in line
    table, line = select_phase_table(tables, 20, 200, COSINE)  # the interval alone is not enough
    assert table is None and "no phase moments for interval 20 delta 200" in line


def test_select_with_an_unknown_schedule_is_off():
    table, line = select_phase_table((_table(),), 20, 100, None)
    assert table is None
    assert "learning-rate schedule is unknown" in line and "is off" in line
    assert "100-step warm-up, cosine decay" in line  # what it was measured with


@pytest.mark.parametrize("job", [TrainingSchedule(200, "cosine", 2e-3), TrainingSchedule(100, "linear", 2e-3)])
def test_select_with_another_schedule_is_off_and_names_both(job):
    table, line = select_phase_table((_table(),), 20, 100, job)
    assert table is None
    assert "measured with a 100-step warm-up, cosine decay" in line
    assert f"this job has a {job.describe()}" in line
    assert "correction is off" in line and "refit with mechmon-calibrate" in line


def test_select_a_match_is_on_and_names_the_steps_covered():
    cosine, linear = _table(), _table(TrainingSchedule(100, "linear", 2e-3))
    longer = PhaseTable(100, 100, COSINE, 200, {"attn_delta2": (PhaseBin(4000, 0.0, 1.0, 30),)})
    tables = (cosine, linear, longer)
    table, line = select_phase_table(tables, 20, 100, TrainingSchedule(100, "linear", 2e-3))
    assert table is linear
    assert line.startswith("early-phase correction on")
    assert "steps 0-600" in line and "100-step phase" in line and "100-step warm-up, linear decay" in line
    table, line = select_phase_table(tables, 100, 100, COSINE)
    assert table is longer and "steps 0-4200" in line and "200-step phase" in line


# ---------------------------------------------------------------- TailTable


def _tail():
    return NullTail(u0=1.0, log_p_u0=math.log(0.05), theta=0.5, theta_hat=0.6, samples=1000, exceedances=50)


def test_a_table_without_phase_moments_has_no_phase_key():
    table = TailTable(tails={5: {"attn_delta2": {"layer": _tail()}}}, source="old")
    assert "phase" not in table.to_dict()
    assert TailTable.from_dict(table.to_dict()).phase == ()
    # An old file (the shipped one without its phase section) reads and writes back unchanged.
    with open(_TAIL_FILE, encoding="utf-8") as f:
        shipped = json.load(f)
    old = {k: v for k, v in shipped.items() if k != "phase"}
    back = TailTable.from_dict(old)
    assert back.phase == ()
    assert json.dumps(back.to_dict(), indent=1) == json.dumps(old, indent=1)


def test_the_shipped_file_is_written_back_byte_for_byte():
    with open(_TAIL_FILE, encoding="utf-8") as f:
        text = f.read()
    assert json.dumps(load_tail_table().to_dict(), indent=1) + "\n" == text


def test_a_table_with_phase_moments_round_trips():
    phase = (_table(), _table(TrainingSchedule(100, "linear", 2e-3)))
    table = TailTable(tails={5: {"attn_delta2": {"layer": _tail()}}}, source="new", phase=phase)
    data = json.loads(json.dumps(table.to_dict()))
    assert data["phase"] == [t.to_dict() for t in phase]
    back = TailTable.from_dict(data)
    assert back.phase == phase
    assert back.to_dict() == table.to_dict()


@pytest.mark.parametrize("phase,message", [
    ({"interval": 20}, '"phase" must be a list of phase tables, got dict'),
    ("phase", '"phase" must be a list of phase tables, got str'),
    ([{"interval": 20}], r"phase\[0\]\.lr_decay_style must be a non-empty string"),
    ([7], r"phase\[0\] must be an object, got int"),
])
def test_a_bad_phase_section_is_refused(phase, message):
    data = TailTable(tails={5: {"attn_delta2": {"layer": _tail()}}}).to_dict()
    data["phase"] = phase
    with pytest.raises(ValueError, match=message):
        TailTable.from_dict(data)


def test_a_duplicate_phase_table_is_refused_by_the_tail_table():
    data = TailTable(tails={5: {"attn_delta2": {"layer": _tail()}}}).to_dict()
    data["phase"] = [_table().to_dict(), _table().to_dict()]
    with pytest.raises(ValueError, match="two tables"):
        TailTable.from_dict(data)


def test_the_shipped_table_corrects_interval_20_only_and_standard_attention_only():
    interval = 20
    shipped = load_tail_table()
    off, why = select_phase_table(shipped.phase, 100, 100, TrainingSchedule(100, "cosine", 2e-3))
    assert off is None
    assert why.startswith("no phase moments for interval 100 delta 100 (measured: interval 20 delta 100")
    off, why = select_phase_table(shipped.phase, 20, 100, TrainingSchedule(100, "cosine", 2e-3), "mla")
    assert off is None and why.startswith("the phase moments were measured on standard attention, this job has mla")
    table, line = select_phase_table(shipped.phase, interval, 100, TrainingSchedule(100, "cosine", 2e-3))
    assert table is not None, line
    assert (table.interval, table.delta, table.schedule) == (interval, 100, TrainingSchedule(100, "cosine", 2e-3))
    assert line.startswith("early-phase correction on")
    for family in ("attn_delta2", "attn_dw"):
        bins = table.families[family]
        assert bins and all(b.scale > 0 and b.samples >= MIN_BIN_SAMPLES for b in bins)
    assert table.covered_until() > 0
    assert select_phase_table(shipped.phase, interval, 100, TrainingSchedule(2000, "cosine", 2e-3))[0] is None


def test_a_table_without_bins_is_not_selected():
    """A calibration whose runs were too short for any bin at a schedule has an empty table there:
    the job is told the correction is off, not that it covers steps 0-0."""
    empty = PhaseTable(100, 100, TrainingSchedule(100, "cosine", 2e-3), 200, {"attn_delta2": (), "attn_dw": ()})
    table, line = select_phase_table((empty,), 100, 100, TrainingSchedule(100, "cosine", 2e-3))
    assert table is None and "no phase moments for interval 100 delta 100" in line and "without bins" in line


def test_an_unknown_family_is_refused():
    data = {"interval": 20, "delta": 100, "lr_warmup_steps": 100, "lr_decay_style": "cosine", "bin_steps": 200,
            "families": {"not_a_family": [[0, 0.0, 1.0, 30]]}}
    with pytest.raises(ValueError, match="unknown family 'not_a_family'"):
        PhaseTable.from_dict(data)


# ---------------------------------------------------------------- the peak learning rate in the key


def test_a_schedule_matches_only_the_same_known_peak_learning_rate():
    assert COSINE.matches(TrainingSchedule(100, "cosine", float("0.002")))  # a flag written and read back
    assert COSINE.matches(TrainingSchedule(100, "cosine", 2e-3 * (1 + 1e-12)))
    for job in (TrainingSchedule(100, "cosine", 8e-3), TrainingSchedule(100, "cosine", 2.1e-3),
                TrainingSchedule(100, "cosine"), TrainingSchedule(100, "linear", 2e-3),
                TrainingSchedule(200, "cosine", 2e-3)):
        assert not COSINE.matches(job), job
    unrecorded = TrainingSchedule(100, "cosine")  # a table of the first design: nothing matches it
    assert not unrecorded.matches(TrainingSchedule(100, "cosine")) and not unrecorded.matches(COSINE)


def test_select_with_another_peak_learning_rate_is_off_and_names_both():
    table, line = select_phase_table((_table(),), 20, 100, TrainingSchedule(100, "cosine", 8e-3))
    assert table is None and "correction is off" in line
    assert "measured with a 100-step warm-up, cosine decay, peak learning rate 0.002" in line
    assert "this job has a 100-step warm-up, cosine decay, peak learning rate 0.008" in line


def test_select_with_an_unknown_peak_learning_rate_is_off():
    table, line = select_phase_table((_table(),), 20, 100, TrainingSchedule(100, "cosine"))
    assert table is None
    assert line.startswith("the job's peak learning rate is unknown to mechmon: the early-phase correction")


def test_a_table_without_a_peak_learning_rate_loads_and_is_never_selected():
    data = _table().to_dict()
    del data["peak_lr"]
    old = PhaseTable.from_dict(data)
    assert old.schedule == TrainingSchedule(100, "cosine") and old.to_dict()["peak_lr"] is None
    table, line = select_phase_table((old,), 20, 100, COSINE)
    assert table is None
    assert line.startswith("the phase moments do not record their peak learning rate")
    assert "refit with mechmon-calibrate --lr" in line


@pytest.mark.parametrize("peak", [0, -2e-3, "2e-3", True, float("nan"), float("inf")])
def test_a_bad_peak_learning_rate_is_refused(peak):
    data = _table().to_dict()
    data["peak_lr"] = peak
    with pytest.raises(ValueError, match=r"^phase\.peak_lr must be a finite number > 0 or null"):
        PhaseTable.from_dict(data)


def test_the_shipped_table_holds_for_the_calibration_runs_peak_learning_rate_only():
    shipped = load_tail_table()
    assert select_phase_table(shipped.phase, 20, 100, TrainingSchedule(100, "cosine", 2e-3))[0] is not None
    assert select_phase_table(shipped.phase, 20, 100, TrainingSchedule(100, "cosine", 8e-3))[0] is None


def test_a_job_with_any_latent_layer_is_of_the_latent_kind():
    from mechmon_megatron.detect.phase_moments import (
        ATTENTION_KINDS,
        LATENT_ATTENTION,
        STANDARD_ATTENTION,
        attention_kind_of,
    )

    assert ATTENTION_KINDS == (STANDARD_ATTENTION, LATENT_ATTENTION) == ("standard", "mla")  # the file's words
    assert attention_kind_of(True) == LATENT_ATTENTION and attention_kind_of(False) == STANDARD_ATTENTION
