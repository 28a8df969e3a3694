"""Layout independence: the healthy series re-saved with TP=2 and with PP=2 (torchrun, gloo, 2 CPU
ranks), as torch_dist and as Megatron-LM legacy files, reads the same values as the TP=1 series."""

from __future__ import annotations

import math

import pytest

from mechmon_megatron.scan import ScanConfig, run_scan
from tests.scan import series as S

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.distributed

ITERATIONS = [260, 280, 300, 320]
LAYOUTS = {
    # --make-vocab-size-divisible-by 64: vocab 257 pads to 384 under TP 2 as under TP 1 (128 x 1).
    "tp2": ["--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "64"],
    "pp2": ["--pipeline-model-parallel-size", "2"],
}


def _scan(paths: tuple[str, ...], out, heads: int | None = S.HEADS) -> dict:
    return run_scan(ScanConfig(inputs=paths, out=str(out), num_attention_heads=heads, progress=False))



@pytest.fixture(scope="module")
def reference(healthy, tmp_path_factory):
    out = tmp_path_factory.mktemp("tp1")
    _scan(S.checkpoint_dirs(healthy.save, ITERATIONS), out)
    return S.cached_values(out)


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def resaved(request, runs, healthy):
    return request.param, S.resave(runs, healthy, ITERATIONS, LAYOUTS[request.param], request.param)


@pytest.mark.slow  # fast leg budget (tests/README.md): runs in `make test-slow` and in CI
def test_resaved_layouts_read_the_same_values(resaved, reference, tmp_path):
    """The re-saved weights are the source's bit for bit, and the readers reassemble whole layers
    (DCP global tensors; legacy TP shards concatenated, PP stages offset) before the same float64
    kernels run, so the values agree to round-off. rel 1e-12: a reader that put one row, head or
    layer in the wrong place would move the entropies in the first digits."""
    name, (dist, legacy) = resaved
    assert any(p.name.startswith("mp_rank_") for p in (legacy / f"iter_{ITERATIONS[0]:07d}").iterdir())
    for fmt, root, heads in (("megatron_torch_dist", dist, S.HEADS), ("megatron_legacy_torch", legacy, None)):
        # The legacy files carry Megatron's args, so the head count comes from the checkpoint itself.
        summary = _scan((str(root),), tmp_path / fmt, heads=heads)
        assert summary["format"] == fmt and summary["checkpoints"] == ITERATIONS and summary["layers"] == [1, 2]
        got = S.cached_values(tmp_path / fmt)
        assert set(got) == set(reference) and len(reference) > 50, (name, fmt)
        bad = {k: (got[k], v) for k, v in reference.items()
               if not math.isclose(got[k], v, rel_tol=1e-12, abs_tol=1e-12)}
        assert not bad, (name, fmt, sorted(bad.items())[:5])
