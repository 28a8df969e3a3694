"""tools/bench_monitors.py runs on a tiny layer and reports the documented JSON keys."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "tools" / "bench_monitors.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_monitors", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tiny_config_json(capsys):
    bench = load_bench()
    argv = ["--hidden", "48", "--num-heads", "4", "--head-dim", "8", "--num-groups", "2"]
    report = bench.main(argv + ["--dense-heads", "3", "--repeats", "1", "--rank", "8", "--json"])
    printed = json.loads(capsys.readouterr().out)
    assert printed["config"] == report["config"]
    for key in ("config", "times_s", "speedup_vs_dense", "max_rel_err", "torch_version", "threads", "machine"):
        assert key in report, key
    assert set(report["times_s"]) >= {"gram", "compressed", "dense", "per_head_update", "full_exact"}
    assert report["dense_heads_timed"] == 3 and report["dense_scaled"] is True
    assert set(report["speedup_vs_dense_per_method"]) == {"gram", "compressed"}
    assert report["max_rel_err"] <= 1e-8
    rnd = report["randomized_full"]
    assert rnd["min_gap_exact_minus_randomized"] >= -1e-12
    assert rnd["max_gap_exact_minus_randomized"] <= rnd["error_bound"] + 1e-12


def test_table_output_and_bad_args(capsys):
    bench = load_bench()
    bench.main(["--hidden", "16", "--num-heads", "2", "--head-dim", "4", "--repeats", "1", "--rank", "4"])
    out = capsys.readouterr().out
    assert "gram" in out and "dense (scaled)" in out
    with pytest.raises(SystemExit):
        bench.main(["--hidden", "16", "--num-heads", "3", "--head-dim", "4", "--num-groups", "2"])


def test_mla_option_runs_the_mla_benchmark(capsys):
    """``--mla`` is tools/bench_mla.py's benchmark (kernel against explicit A_h, B_h), its flags and JSON."""
    bench = load_bench()
    tiny = ["--hidden", "64", "--num-heads", "4", "--q-lora-rank", "16", "--kv-lora-rank", "8", "--d-nope", "8",
            "--d-rope", "4", "--d-v", "8", "--repeats", "1"]
    report = bench.main(["--mla", *tiny, "--json"])
    assert json.loads(capsys.readouterr().out)["config"] == report["config"]
    assert report["config"]["q_lora_rank"] == 16 and report["config"]["num_heads"] == 4
    assert set(report["times_s"]) == {"mla_latent", "explicit_baseline"}
    assert report["max_rel_err"] <= 1e-8
