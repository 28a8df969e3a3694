"""The recovery study's loss curves (records) and their plot (docs/RECOVERY.md)."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest

from mechmon_megatron.research.recovery_study.campaign import _discarded_curves, loss_curve
from mechmon_megatron.research.recovery_study.launch import LaunchRecord, LaunchState
from mechmon_megatron.research.recovery_study.plots import plot_recovery, plottable

ROOT = Path(__file__).resolve().parents[3]


def test_loss_curve_is_the_mean_of_each_block_against_brute_force():
    rng = random.Random(3)
    rows = {}
    for i in range(401, 1003):
        loss = rng.choice([None, math.nan, math.inf]) if rng.random() < 0.1 else rng.uniform(1, 3)
        rows[i] = {"lm_loss": loss}
    for i in range(900, 921):  # a whole diverged block
        rows[i]["lm_loss"] = math.nan
    curve = loss_curve(rows, block=20)
    assert [p[0] for p in curve] == list(range(420, 1021, 20))
    for end, mean in curve:
        finite = [r["lm_loss"] for i, r in rows.items() if end - 20 < i <= end
                  and r["lm_loss"] is not None and math.isfinite(r["lm_loss"])]
        if finite:
            assert mean == round(sum(finite) / len(finite), 5)
        else:
            assert mean is None and end == 920
    json.dumps(curve, allow_nan=False)  # a record stays strict JSON


def _write_metrics(path: Path, steps: range, loss) -> None:
    path.write_text("".join(json.dumps({"iteration": i, "lm_loss": loss(i)}) + "\n" for i in steps))


def test_discarded_curves_are_what_each_relaunch_threw_away(tmp_path: Path):
    launches = [LaunchRecord(index=k, argv=[], start_iteration=start, started=0.0, finished=True)
                for k, start in ((1, 400), (2, 500))]
    state = LaunchState(str(tmp_path), launches)
    _write_metrics(tmp_path / "metrics-L1.jsonl", range(401, 661), lambda i: 2.0)
    _write_metrics(tmp_path / "metrics-L2.jsonl", range(501, 1001), lambda i: 1.0)
    (curve,) = _discarded_curves(state)
    assert curve == [[end, 2.0] for end in range(520, 661, 20)]


def _record(cell: str, curves: bool = True) -> dict:
    clean = [[s, 2.0 - s / 2000] for s in range(320, 1501, 20)]
    op = {"status": "done", "restarts": 0, "loss_vs_clean": 0.5,
          **({"loss_curve": [[s, 2.5] for s in range(420, 861, 20)] + [[880, None]]} if curves else {})}
    mech = {"status": "done", "restarts": 1, "loss_vs_clean": 0.001,
            "recovery": [{"action": "relaunch", "alert": {"iteration": 660}, "checkpoint": {"iteration": 400}}],
            **({"loss_curve": clean[5:], "discarded_loss_curves": [[[s, 2.2] for s in range(420, 661, 20)]]}
               if curves else {})}
    return {"cell": cell, "scenario": "fa", "onset": 500, **({"clean_loss_curve": clean} if curves else {}),
            "operators": {"none": op, "practice": dict(op), "mechmon": mech}}


def test_plot_draws_the_cells_with_curves_and_names_the_others(tmp_path: Path):
    png = tmp_path / "img" / "recovery.png"
    left_out = plot_recovery([_record("fa-a"), _record("fa-old", curves=False), _record("fa-b")], str(png))
    assert left_out == ["fa-old"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert not plottable(_record("x", curves=False))
    with pytest.raises(ValueError, match="no record has loss curves"):
        plot_recovery([_record("fa-old", curves=False)], str(png))


def test_plot_command_names_an_unknown_cell(tmp_path: Path):
    (tmp_path / "fa-a.json").write_text(json.dumps(_record("fa-a")))
    cmd = [sys.executable, str(ROOT / "tools" / "recovery_study.py"), "plot", "--records", str(tmp_path)]
    bad = subprocess.run(cmd + ["--to", str(tmp_path / "x.png"), "--cells", "fa-a,fa-zz"], capture_output=True,
                         text=True)
    assert bad.returncode == 2 and "--cells: no record for ['fa-zz']" in bad.stderr
    ok = subprocess.run(cmd + ["--to", str(tmp_path / "x.png")], capture_output=True, text=True)
    assert ok.returncode == 0 and (tmp_path / "x.png").exists(), ok.stderr
