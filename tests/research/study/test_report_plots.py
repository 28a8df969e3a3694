"""results.json, the markdown report and the PNG plots, from synthetic runs."""

import json
import os

import pytest

from mechmon_megatron.research.study import analysis as A
from mechmon_megatron.research.study import plots, report
from mechmon_megatron.research.study.study import PLAN_FILE, analyze_study

from .synthetic import check_rows, metrics_rows, write_run

RUNS = (
    # run_id, scenario, seed, onset, metrics kwargs, checks kwargs
    ("clean-seed1", "clean", 1, None, {}, {}),
    ("clean-seed2", "clean", 2, None, {"seed": 2}, {"seed": 2}),
    ("fa-seed1", "fa", 1, 250, {"diverge_at": 600}, {"attn_drop_at": 300}),
    ("moe-lr-seed1", "moe-lr", 1, 1, {}, {"router_drop_at": 300, "collapse_at": 500}),
)


def _study(tmp_path):
    out = str(tmp_path)
    plan_runs = []
    for run_id, scenario, seed, onset, mkw, ckw in RUNS:
        write_run(os.path.join(out, "runs", run_id), metrics_rows(800, **mkw), check_rows(800, **ckw))
        plan_runs.append({"scenario": scenario, "seed": seed, "train_iters": 800, "fault_onset": onset,
                          "calibration": False, "run_id": run_id, "returncode": 0, "wall_s": 1.0, "error_tail": ""})
    plan = {"preset": "demo", "scenarios": ["clean", "fa", "moe-lr"], "seeds": [1, 2], "calibration_seed": None,
            "train_iters": 800, "jobs": 2, "train_wall_s": 3.0, "runs": plan_runs,
            "mechmon_interval": 10, "mechmon_delta": 10}
    with open(os.path.join(out, PLAN_FILE), "w") as f:
        json.dump(plan, f)
    return out


def test_results_json_has_the_interface_keys(tmp_path):
    out = _study(tmp_path)
    analyze_study(out, plots_enabled=False)
    with open(os.path.join(out, "results.json")) as f:
        results = json.load(f)
    assert len(results["runs"]) == len(RUNS)
    for run in results["runs"]:
        for key in ("scenario", "seed", "train_iters", "fault_onset", "divergence_step", "expert_collapse_step"):
            assert key in run
        assert set(run["first_alarm"]) == {
            "attn_delta2", "attn_dw", "router_entropy", "router_weights", "loss_6sigma", "loss_10x",
            "loss_2x_mean", "grad_norm_6sigma", "max_attn_logit", "wq_spectral_norm",
        }
    fa = next(r for r in results["runs"] if r["scenario"] == "fa")
    assert fa["first_alarm"]["attn_delta2"] == 310 and fa["divergence_step"] is not None
    assert results["study"]["detector"] == A.DEFAULT_DETECTOR.to_dict()  # the plan names none
    assert results["orthogonality"]["attn fault (fa)"]["router monitors (entropy, similarity)"] == [0, 1]
    assert results["orthogonality"]["router fault (moe-lr, moe-gbs)"]["attention monitors (Δ2, dW)"] == [0, 1]
    assert results["targets"]["orthogonality"]["met"] is True
    assert results["targets"]["clean"]["met"] is True  # no clean run alarmed: a pass
    assert results["targets"]["clean"]["enough_runs"] is False  # two clean seeds only: the target wants >= 3
    moe = results["targets"]["moe"][0]
    assert moe["before_collapse"] is True and moe["before_divergence"] is None  # no divergence: n/a
    fa_target = results["targets"]["fa"][0]
    assert fa_target["delta2_alarm"] == 310 and fa_target["delta2_lead_share_ge_50pct"] is True


def test_markdown_report(tmp_path):
    out = _study(tmp_path)
    results = analyze_study(out, plots_enabled=False)
    text = report.markdown_report(results)
    assert "| scenario | seed | onset | diverge | collapse | Δ2 |" in text
    assert "| fa | 1 | 250 |" in text
    assert "Orthogonality" in text and "Targets" in text
    with open(os.path.join(out, "report.md")) as f:
        assert f.read() == text


def test_false_alarm_is_marked(tmp_path):
    out = _study(tmp_path)
    results = analyze_study(out, plots_enabled=False)
    clean = next(r for r in results["runs"] if r["run_id"] == "clean-seed1")
    clean["first_alarm"]["attn_delta2"] = 100
    clean["false_alarm"]["attn_delta2"] = True
    assert "100!" in report.markdown_table(results)
    assert report.evaluate_targets(results)["clean"]["runs_with_mechmon_alarm"] == [1]
    assert report.evaluate_targets(results)["clean"]["met"] is False
    assert "no false alarm NO" in report.markdown_targets({**results, "targets": None})


def test_plot_run_writes_a_png(tmp_path):
    mpath, cpath = write_run(
        str(tmp_path / "run"), metrics_rows(400, diverge_at=300), check_rows(400, attn_drop_at=200)
    )
    data = A.RunData.from_files(mpath, cpath)
    run = {"scenario": "fa", "seed": 1, **A.analyze_run(data, fault_onset=150, interval=10, delta=10)}
    path = plots.plot_run(data, run, str(tmp_path / "plots" / "fa.png"))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow  # fast leg budget (tests/README.md): runs in `make test-slow` and in CI
def test_plots_in_the_study(tmp_path):
    out = _study(tmp_path)
    results = analyze_study(out, plots_enabled=True)
    assert sorted(results["study"]["plots"]) == sorted(os.path.join("plots", f"{r[0]}.png") for r in RUNS)
    for rel in results["study"]["plots"]:
        assert os.path.getsize(os.path.join(out, rel)) > 1000


def test_plan_detector_and_an_interrupted_run(tmp_path):
    out = _study(tmp_path)
    with open(os.path.join(out, PLAN_FILE)) as f:
        plan = json.load(f)
    plan["detector"] = {"false_alarm_rate": 1.0}
    plan["train_wall_s"] = None  # as written before training starts
    plan["runs"][2]["returncode"] = None
    plan["runs"][2]["train_iters"] = 1000  # the fa run stopped at 800 of 1000 steps
    with open(os.path.join(out, PLAN_FILE), "w") as f:
        json.dump(plan, f)
    results = analyze_study(out, plots_enabled=False)
    assert results["study"]["detector"] == plan["detector"]
    text = report.markdown_report(results)
    assert "fa (stopped at 800)" in text and "training wall time n/a" in text


def test_sensitivity_replays_each_setting_on_the_reported_runs(tmp_path):
    from mechmon_megatron.research.study.study import sensitivity

    out = _study(tmp_path)
    default = analyze_study(out, plots_enabled=False)
    settings = (A.DEFAULT_DETECTOR, A.DetectorSetting(false_alarm_rate=1e-300))
    rows = sensitivity(out, settings)
    assert [r["setting"] for r in rows] == [s.to_dict() for s in settings]
    # The default row is the study's own analysis with the default setting, run by run.
    got = {(r["scenario"], r["seed"]): r["first_alarm"] for r in rows[0]["runs"]}
    assert got == {(r["scenario"], r["seed"]): r["first_alarm"] for r in default["runs"]}
    text = report.markdown_sensitivity(rows)
    lines = text.splitlines()
    assert len(lines) == 2 + len(settings)
    assert lines[2].startswith("| 0.01 | 0/2 | 310 (")  # fa's Δ2 alarm at 310
    assert lines[3].startswith("| 1e-300 | 0/2 | - (-)")  # thresholds out of reach of this run
