"""One layer, one checkpoint pair: the online session's attention and router-weight checks.

The scan calls the session's own functions on the two checkpoints' weights, so values and
scalar names are those of a live run with ``--mechmon-interval`` = the check interval and
``--mechmon-delta`` = the window (``--mechmon-per-head-scalars`` on):

- ``session.attention_check.check_heads``: Delta1/2/3 spectra per head (compressed kernel) and
  per-head dW spectra, with the layer's QK-norms folded into the per-head rows; ``check_full``:
  the whole-layer dW_q / dW_k spectra with the session's defaults (randomized, top 128 with a
  certified bound: the whole spectrum when the matrix is at most 128 wide) and ``||W_q||_2`` by
  power iteration;
- for a multi-head latent attention layer instead: ``session.mla_check.check_mla_heads``, the
  content (no-RoPE) Delta2 per head, pooled by the detector as ``delta2_entropy``, and the whole
  stream recorded as ``delta2_whole_entropy``; ``check_full`` on the two projections from the
  hidden state (``q_down`` or ``q_proj``, and ``kv_down``), as online;
- ``session.router_check.router_output``: router weight similarity S and conditioning ratio eps,
  from the later checkpoint's router weight. The routing-entropy monitors need the tokens of a
  forward pass, which a checkpoint does not hold: they are not computed (no tokens are passed,
  so ``router_output`` writes the weight scalars only).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from mechmon_megatron.scan.readers.base import LayerWeights
from mechmon_megatron.session.attention_check import check_full, check_heads
from mechmon_megatron.session.host import FullQK, QKWeights, RouterSite
from mechmon_megatron.session.mla_check import check_mla_heads
from mechmon_megatron.session.records import CheckOutput, Stream, merge_partials
from mechmon_megatron.session.router_check import empty_vector, router_output

__all__ = ["PairRecord", "compute_pair"]

_ROUTER_BINS = 8  # no tokens: the routing histogram stays empty, its size is irrelevant


@dataclass(kw_only=True)
class PairRecord:
    """What one layer's check of one pair produced (JSON round trip for the cache)."""

    layer: int
    earlier: int
    """Iteration of the earlier checkpoint (``t - delta``)."""
    later: int
    """Iteration of the later checkpoint (the check step ``t``)."""
    scalars: dict[str, float]
    """Final scalar values, ``mechmon/...`` names (``session/names.py``)."""
    streams: list[dict[str, Any]] = field(default_factory=list)
    """Detector inputs (``session.records.Stream`` fields)."""
    nonfinite: list[str] = field(default_factory=list)
    seconds: float = 0.0
    """Wall time of the kernels for this layer and pair (reads not included)."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PairRecord:
        return cls(**data)

    def stream_records(self) -> list[Stream]:
        return [Stream(**s) for s in self.streams]


def _router_site(now: LayerWeights) -> RouterSite:
    weight = now.router
    assert weight is not None
    return RouterSite(layer_number=now.layer, num_experts=int(weight.shape[0]), topk=1, weight=lambda: weight,
                      reduce_sum=lambda flat: flat, reports=True)


def compute_pair(
    prev: LayerWeights, now: LayerWeights, earlier: int, later: int, alpha: float,
    method: Literal["gram", "compressed"],
) -> PairRecord:
    """Every monitor of one layer between checkpoints ``earlier`` and ``later`` (see the module doc)."""
    start = time.perf_counter()
    layer = now.layer
    if now.mla is not None:
        assert prev.mla is not None
        outputs = [check_mla_heads(layer, prev.mla, now.mla, alpha=alpha, per_head_scalars=True)]
    else:
        outputs = _check_heads(prev, now, alpha, method)
    outputs.append(check_full(layer, _full(prev), _full(now), alpha=alpha))
    if now.router is not None:
        site = _router_site(now)
        outputs.append(router_output(site, empty_vector(site, _ROUTER_BINS), _ROUTER_BINS, entropy_floor=None))
    scalars = merge_partials([out.scalars for out in outputs])
    return PairRecord(
        layer=layer, earlier=earlier, later=later, scalars=scalars,
        streams=[asdict(s) for out in outputs for s in out.streams],
        nonfinite=[n.message for out in outputs for n in out.nonfinite],
        seconds=time.perf_counter() - start,
    )


def _qk(weights: LayerWeights) -> QKWeights:
    assert weights.wq is not None and weights.wk is not None
    return QKWeights(wq=weights.wq, wk=weights.wk, q_norm=weights.q_norm, k_norm=weights.k_norm)


def _check_heads(prev: LayerWeights, now: LayerWeights, alpha: float,
                 method: Literal["gram", "compressed"]) -> list[CheckOutput]:
    """``check_heads`` on the layer, its QK-norms folded by the check (a norm over the whole
    projection, OLMo-2, as one gamma row per head: ``monitors/norm_fold.py``)."""
    return [check_heads(now.layer, _qk(prev), _qk(now), alpha=alpha, method=method, per_head_scalars=True)]


def _full(weights: LayerWeights) -> FullQK:
    """Whole-layer matrices: ``[heads * head_dim, hidden]`` Q and K rows (row order does not
    change singular values); for MLA the projections from the hidden state, as online."""
    if weights.mla is not None:
        w = weights.mla.weights
        wq = w.q_proj if w.q_proj is not None else w.q_down
        assert wq is not None
        return FullQK(wq=wq, wk=w.kv_down)
    assert weights.wq is not None and weights.wk is not None
    hidden = weights.wq.shape[-1]
    return FullQK(wq=weights.wq.reshape(-1, hidden), wk=weights.wk.reshape(-1, hidden))
