"""Bad input names the file or flag, exits 2 and writes nothing; an interrupted scan resumes.

The checkpoints are the healthy series' (real trainer output), copied and then damaged the way
real folders get damaged (a truncated file, a missing tensor, a model that changed).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mechmon_megatron.scan import ScanConfig, ScanInputError, main, run_scan
from tests.scan import series as S

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.distributed

ITERATIONS = [20, 40, 60, 80]


@pytest.fixture()
def small(healthy, tmp_path) -> Path:
    """Four healthy checkpoints in a run folder of their own (the tracker says 80)."""
    run = tmp_path / "run"
    run.mkdir()
    for i in ITERATIONS:
        shutil.copytree(healthy.save / f"iter_{i:07d}", run / f"iter_{i:07d}")
    (run / "latest_checkpointed_iteration.txt").write_text(str(ITERATIONS[-1]))
    return run


def cli(*args: str, module: str = "mechmon_megatron.scan") -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", module, *args] if module else [sys.executable, *args]
    return subprocess.run(cmd, cwd=S.REPO_ROOT, env=S.env(), capture_output=True, text=True, timeout=120)


def _nothing_written(out: Path) -> None:
    assert not out.exists() or not {"summary.json", "report.html", "tensorboard", "img"} & set(os.listdir(out))
    assert not out.exists() or not [p for p in os.listdir(out) if p.startswith((".staging-", ".old-", ".tmp-"))]


def test_cli_entry_points_scan_a_real_folder(small, tmp_path):
    out = tmp_path / "out"
    proc = cli(str(small), "--out", str(out), "--num-attention-heads", "4", "--layers", "2-2", "--no-progress")
    assert proc.returncode == 0, proc.stderr
    assert "no anomaly (3 pairs" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert {"first_anomaly", "pairs"} <= set(summary) and summary["pairs"] == 3 and summary["layers"] == [2]
    assert sorted(p.name for p in out.iterdir()) == [".mechmon-scan.json", "cache", "img", "mechmon_scalars.jsonl",
                                                     "report.html",
                                                     "summary.json", "tensorboard"]
    proc = cli("tools/mechmon_scan.py", "--help", module="")  # the checkout wrapper reaches the same parser
    assert proc.returncode == 0 and "RUN_DIR_OR_CHECKPOINTS" in proc.stdout and "--window" in proc.stdout
    setup = (S.REPO_ROOT / "setup.py").read_text()
    assert "mechmon-scan=mechmon_megatron.scan.cli:main" in setup  # the console script


def test_a_single_checkpoint_is_refused(small, tmp_path, capsys):
    out = tmp_path / "out"
    assert main([str(small / "iter_0000020"), "--out", str(out), "--num-attention-heads", "4"]) == 2
    err = capsys.readouterr().err
    assert "found 1 checkpoint(s)" in err and "needs at least 2 checkpoints" in err and "iter_0000020" in err
    assert not out.exists()


@pytest.mark.parametrize(
    "flags,expected",
    [
        (["--every", "0"], "--every must be an integer >= 1"),
        (["--window", "0"], "--window must be an integer >= 1"),
        (["--window", "4"], "needs at least 5 checkpoints"),
        (["--false-alarm-rate", "-1"], "--false-alarm-rate must be a number in (0, 1e6]"),
        (["--layers", "7"], "--layers [7] not in the checkpoints; their layers with Q/K weights are [1, 2]"),
        (["--num-attention-heads", "5"], "check --num-attention-heads"),
        (["--detector-calibration", "nope.json"], "--detector-calibration 'nope.json' is not a file"),
    ],
)
def test_bad_flags_name_the_flag(small, tmp_path, capsys, flags, expected):
    """In-process ``main`` (what the console script calls): exit code 2, the flag named on stderr."""
    out = tmp_path / "out"
    heads = [] if "--num-attention-heads" in flags else ["--num-attention-heads", "4"]
    assert main([str(small), "--out", str(out), *heads, *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mechmon-scan: error: ") and expected in err, err
    _nothing_written(out)


def test_unknown_head_count_names_the_flag(small, tmp_path):
    with pytest.raises(ScanInputError, match="does not record the number of attention heads.*--num-attention-heads"):
        run_scan(ScanConfig(inputs=(str(small),), out=str(tmp_path / "out"), progress=False))
    _nothing_written(tmp_path / "out")


def test_unreadable_metadata_names_the_file(small, tmp_path):
    (small / "iter_0000040" / ".metadata").write_bytes(b"not a pickle")
    with pytest.raises(ScanInputError, match=r"iter_0000040/\.metadata: cannot read the torch_dist metadata"):
        run_scan(ScanConfig(inputs=(str(small),), out=str(tmp_path / "out"), num_attention_heads=4, progress=False))
    _nothing_written(tmp_path / "out")


def test_truncated_shard_fails_cleanly_and_leaves_no_outputs(small, tmp_path):
    """The metadata is fine, the data file is cut short: the scan stops at that checkpoint, names it,
    and writes no summary, report or events (the pairs computed before it stay cached)."""
    for shard in (small / "iter_0000060").glob("*.distcp"):
        shard.write_bytes(shard.read_bytes()[:100])
    out = tmp_path / "out"
    with pytest.raises(ScanInputError, match=r"iter_0000060: cannot read .*incomplete or corrupt"):
        run_scan(ScanConfig(inputs=(str(small),), out=str(out), num_attention_heads=4, progress=False))
    _nothing_written(out)


def _hf_series(healthy, root: Path) -> Path:
    for i in (20, 40, 60):
        S.export_hf(healthy.save / f"iter_{i:07d}", root / f"checkpoint-{i}", fused=False)
    return root


def _rewrite(folder: Path, change) -> None:
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path))


def test_missing_qk_tensors_name_the_file(healthy, tmp_path):
    run = _hf_series(healthy, tmp_path / "hf")
    _rewrite(run / "checkpoint-40", lambda t: [t.pop(k) for k in list(t) if k.endswith("k_proj.weight")])
    with pytest.raises(ScanInputError, match=r"checkpoint-40: layer 1 has .*q_proj.weight' but no matching k_proj"):
        run_scan(ScanConfig(inputs=(str(run),), out=str(tmp_path / "out"), progress=False))
    _nothing_written(tmp_path / "out")


def test_shapes_changing_between_checkpoints_are_refused(healthy, tmp_path):
    run = _hf_series(healthy, tmp_path / "hf")
    key = "model.layers.1.self_attn.q_proj.weight"
    _rewrite(run / "checkpoint-60", lambda t: t.update({key: t[key][:48].contiguous()}))
    with pytest.raises(ScanInputError, match=r"checkpoint-60: layer 2 tensors have shapes \(\(48, 64\), \(64, 64\)\).*"
                                             r"expected \(\(64, 64\), \(64, 64\)\).*checkpoint-20"):
        run_scan(ScanConfig(inputs=(str(run),), out=str(tmp_path / "out"), progress=False))
    _nothing_written(tmp_path / "out")


def test_an_interrupted_scan_resumes_from_its_cache(small, tmp_path):
    fresh = run_scan(ScanConfig(inputs=(str(small),), out=str(tmp_path / "fresh"), num_attention_heads=4,
                                progress=False))
    out = tmp_path / "out"
    run_scan(ScanConfig(inputs=(str(small),), out=str(out), num_attention_heads=4, layers=(1,), progress=False))
    # What a kill during layer 1 leaves: the header, one complete record and a line cut short.
    cache = out / "cache" / "layer_0001.jsonl"
    lines = cache.read_text().splitlines()
    cache.write_text("\n".join(lines[:2]) + "\n" + lines[2][: len(lines[2]) // 2])
    (out / "summary.json").unlink()
    resumed = run_scan(ScanConfig(inputs=(str(small),), out=str(out), num_attention_heads=4, progress=False))
    # 3 pairs x 2 layers, of which 1 (layer 1's first pair) came from the cache.
    assert resumed["timing"]["layer_pairs_computed_this_run"] == 5
    assert S.cached_values(out) == S.cached_values(tmp_path / "fresh")
    assert {k: v for k, v in resumed.items() if k != "timing"} == {k: v for k, v in fresh.items() if k != "timing"}
    again = run_scan(ScanConfig(inputs=(str(small),), out=str(out), num_attention_heads=4, progress=False))
    assert again["timing"]["layer_pairs_computed_this_run"] == 0  # a finished scan reruns from its cache
    os.utime(small / "iter_0000040" / ".metadata")  # a checkpoint rewritten since: its layer files recompute
    changed = run_scan(ScanConfig(inputs=(str(small),), out=str(out), num_attention_heads=4, progress=False))
    assert changed["timing"]["layer_pairs_computed_this_run"] == 6


def test_non_finite_weights_are_the_first_anomaly(healthy, tmp_path):
    """A NaN in a checkpoint's Q weights is an anomaly of its own (as online), not an error."""
    run = _hf_series(healthy, tmp_path / "hf")
    key = "model.layers.0.self_attn.q_proj.weight"

    def poison(tensors):
        tensors[key][3, 5] = float("nan")

    _rewrite(run / "checkpoint-60", poison)
    summary = run_scan(ScanConfig(inputs=(str(run),), out=str(tmp_path / "out"), progress=False))
    first = summary["first_anomaly"]
    assert (first["family"], first["layer"], first["after_iteration"], first["before_iteration"]) == (
        "nonfinite", 1, 40, 60)
    assert "non-finite Q/K weights" in first["reason"]
    def refuse(constant):
        raise AssertionError(f"summary.json holds {constant}, which strict JSON readers refuse")

    json.loads((tmp_path / "out" / "summary.json").read_text(), parse_constant=refuse)


def test_every_judges_every_kth_checkpoint_and_reuses_cached_pairs(small, tmp_path):
    out = tmp_path / "out"
    full = run_scan(ScanConfig(inputs=(str(small),), out=str(out), num_attention_heads=4, progress=False))
    sparse = run_scan(ScanConfig(inputs=(str(small),), out=str(out), num_attention_heads=4, every=2, progress=False))
    # Checkpoints 20, 40, 60, 80: pairs (20, 40) and (60, 80), a check every 40 steps over 20-step windows.
    assert (full["pairs"], sparse["pairs"]) == (3, 2)
    assert (sparse["interval_steps"], sparse["window_steps"]) == (40, 20)
    assert sparse["timing"]["layer_pairs_computed_this_run"] == 0  # both pairs were in the cache
    assert sparse["detector"]["checks_per_million_steps"] == 1e6 / 40


def test_ctrl_c_mid_scan_exits_130_and_the_rerun_continues(small, tmp_path, monkeypatch, capsys):
    """A KeyboardInterrupt at the 4th layer-pair (as Ctrl-C would raise it): exit 130, no summary,
    the 3 finished layer-pairs durable in the cache; the same command then computes only the rest."""
    from mechmon_megatron.scan import runner

    real, calls = runner.compute_pair, []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    out = tmp_path / "out"
    argv = [str(small), "--out", str(out), "--num-attention-heads", "4", "--no-progress"]
    monkeypatch.setattr(runner, "compute_pair", interrupted)
    assert main(argv) == 130
    assert "rerun the same command to continue" in capsys.readouterr().err
    _nothing_written(out)
    monkeypatch.setattr(runner, "compute_pair", real)
    assert main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["timing"]["layer_pairs_computed_this_run"] == 3  # of 3 pairs x 2 layers
