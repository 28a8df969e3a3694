"""MoE router monitors: routing entropy, router-weight similarity, load statistics.

Mechanism (docs/METHOD.md section 6): a "stable winner" feedback loop collapses routing diversity.
The full-softmax routing entropy falls, and the router weight rows become more similar, before
discrete signals (top-k counts, load imbalance) change.

The routing entropy is that of the router's score distribution over ALL experts, for the score
function in use (``SCORE_FUNCTIONS``): ``softmax`` gives ``p = softmax(z)``; a positive
elementwise score ``s(z)`` (``sigmoid``, megatron-core's ``sqrtsoftplus``) gives the normalised
scores ``p_e = s(z_e) / sum_j s(z_j)``, the distribution megatron-core itself builds from those
scores for its load-balancing loss. An expert bias (aux-loss-free balancing) is not part of ``z``:
it moves the selection, not the scores, and shows in the routing map's load statistics.

Naming convention (as in megatron-core ``router.py``):

- ``logits``: raw router outputs, ``[..., num_experts]`` (usually ``[num_tokens, num_experts]``).
- ``routing_map``: boolean assignment, ``[num_tokens, num_experts]``: the router's own (after an
  expert bias, group-limited selection and capacity dropping), or the top-k of the logits.
- ``weight``: router weight, ``[num_experts, hidden]``; row ``w_i`` belongs to expert ``i``.
- ``counts``: tokens routed to each expert, ``[num_experts]``.

Everything here is pure torch, allocates on the input's device and never synchronises with the
host except in :meth:`RouterEntropySummary.finalize` (one ``.tolist()``), which the session calls
once per report after the all-reduce.

Non-finite router logits are *flagged*, not raised: raising would need a device-to-host sync on
every call. A token whose logits hold a NaN (or ``+inf``) gets a NaN entropy from
:func:`routing_entropy`; :func:`summarize_routing` counts such tokens in ``num_nonfinite_tokens``
and leaves them out of every other statistic. ``-inf`` logits are allowed (masked experts) as long
as one logit of the token is finite.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "DEFAULT_ENTROPY_BINS",
    "SCORE_FUNCTIONS",
    "RouterEntropySummary",
    "check_score_function",
    "expert_load",
    "load_fractions",
    "max_violation",
    "router_conditioning_ratio",
    "router_weight_similarity",
    "routing_entropy",
    "summarize_routing",
]

DEFAULT_ENTROPY_BINS = 512
"""Histogram bins over ``[0, log E]``; quantile error is at most ``log(E) / num_bins`` nats."""

SCORE_FUNCTIONS = ("softmax", "sigmoid", "sqrtsoftplus")
"""Router score functions whose routing entropy is defined (megatron-core's
``moe_router_score_function``; ``sqrtsoftplus`` is ``sqrt(softplus(z))``, megatron-core >= 0.19)."""


def _compute_dtype(x: Tensor) -> torch.dtype:
    # fp64 inputs keep their precision; everything narrower (bf16, fp16, fp32) runs in fp32,
    # which is exact enough for a log-softmax over tens to hundreds of experts.
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def check_score_function(score_function: str) -> str:
    """``score_function`` if its routing entropy is defined, else ``ValueError`` naming the choices."""
    if score_function not in SCORE_FUNCTIONS:
        raise ValueError(
            f"router score function {score_function!r} has no routing entropy in mechmon; "
            f"supported: {', '.join(SCORE_FUNCTIONS)}"
        )
    return score_function


def _log_scores(z: Tensor, score_function: str) -> Tensor:
    """``u`` with ``softmax(u) = p``: the log of the (unnormalised) positive score of each expert.

    softmax: ``u = z``. sigmoid: ``u = log sigma(z) = logsigmoid(z)`` (exact for large ``|z|``).
    sqrtsoftplus: ``u = log(softplus(z)) / 2``. A ``+inf`` logit has a finite sigmoid score; it is
    mapped to NaN so that every score function flags the token as non-finite, as softmax does.
    """
    if score_function == "softmax":
        return z
    if score_function == "sigmoid":
        u = torch.nn.functional.logsigmoid(z)
    elif score_function == "sqrtsoftplus":
        u = 0.5 * torch.log(torch.nn.functional.softplus(z))
    else:
        raise ValueError(f"unknown router score function {score_function!r} (supported: {SCORE_FUNCTIONS})")
    return torch.where(torch.isposinf(z), torch.full_like(u, math.nan), u)


def routing_entropy(logits: Tensor, score_function: str = "softmax") -> Tensor:
    """Per-token entropy of the router's score distribution over ALL experts, in nats.

    H_t = -sum_e p_te log p_te over all ``E`` experts (not the top-k subset), with
    ``p_t = softmax(logits_t)`` for a softmax router and the normalised scores
    ``p_te = s(z_te) / sum_j s(z_tj)`` for a positive score function ``s`` (``sigmoid``,
    ``sqrtsoftplus``). Computed as the entropy of ``softmax(u)`` with ``u = log s(z)``
    (``log_softmax``), so that huge logits stay exact: one softmax logit ``1e4`` above the rest
    gives 0, ``E`` equal logits of any magnitude give ``log E``.

    Args:
        logits: ``[..., num_experts]``, any floating dtype (bf16/fp16 are upcast to fp32).
        score_function: one of :data:`SCORE_FUNCTIONS`.

    Returns:
        ``[...]`` entropies in nats, fp32 (fp64 for fp64 input), on ``logits.device``. A token
        with a NaN or ``+inf`` logit gets NaN (flagged, see the module docstring); ``-inf``
        logits are masked experts with probability 0 (every score function maps them to 0).
    """
    if not logits.is_floating_point():
        raise ValueError(f"routing_entropy expects floating-point logits, got {logits.dtype}.")
    if logits.dim() == 0 or logits.shape[-1] < 1:
        raise ValueError("routing_entropy expects logits of shape [..., num_experts] with num_experts >= 1.")
    check_score_function(score_function)
    logp = torch.log_softmax(_log_scores(logits.to(_compute_dtype(logits)), score_function), dim=-1)
    p = logp.exp()
    # A masked expert (-inf logit) has p = 0 and logp = -inf; 0 * -inf would be NaN, but its
    # contribution to the entropy is 0 by continuity. NaN logp (a NaN row) must stay NaN.
    plogp = torch.where(p > 0, p * logp, torch.where(torch.isnan(logp), logp, torch.zeros_like(logp)))
    # 0 - x rather than -x so that a zero entropy is +0.0, not -0.0.
    return 0.0 - plogp.sum(dim=-1)


def router_weight_similarity(weight: Tensor) -> Tensor:
    """Mean pairwise cosine similarity of the router weight rows.

    With ``u_i = w_i / ||w_i||`` and ``u_bar = mean_i u_i``:
    ``S = (E ||u_bar||^2 - 1) / (E - 1)``, exactly the mean off-diagonal cosine similarity.
    Computed in fp64 (the matrix is small: ``E x hidden``).

    Zero rows have no direction; they are excluded, so ``S`` is the mean cosine over pairs of
    non-zero rows (``E`` in the formula becomes the number of non-zero rows). Fewer than two
    non-zero rows gives NaN (flagged, no host sync).

    Args:
        weight: ``[num_experts, hidden]``, any floating dtype.

    Returns:
        0-dim fp64 tensor in ``[-1/(E-1), 1]`` on ``weight.device``.

    Raises:
        ValueError: ``weight`` is not 2-D or has fewer than 2 rows (experts).
    """
    _check_router_weight(weight, "router_weight_similarity")
    w = weight.detach().to(torch.float64)
    norms = torch.linalg.vector_norm(w, dim=1)
    nonzero = norms > 0
    u = torch.where(nonzero[:, None], w / torch.where(nonzero, norms, torch.ones_like(norms))[:, None], 0.0)
    n = nonzero.sum().to(torch.float64)
    # sum_{i,j} u_i.u_j = ||sum_i u_i||^2 = n + sum_{i != j} cos_ij  (over the n non-zero rows).
    total = torch.linalg.vector_norm(u.sum(dim=0)) ** 2
    pairs = n * (n - 1)
    nan = torch.full((), math.nan, dtype=torch.float64, device=w.device)
    return torch.where(n >= 2, (total - n) / torch.where(pairs > 0, pairs, torch.ones_like(pairs)), nan)


def router_conditioning_ratio(weight: Tensor) -> Tensor:
    """Conditioning ratio ``eps = max_i ||w_i - w_bar|| / ||w_bar||``, ``w_bar = mean_i w_i``.

    Small ``eps`` means the rows are near copies of their mean (for ``eps < 1`` every pair has
    ``cos >= 1 - 2 eps^2``): a redundant, non-discriminative router.

    Args:
        weight: ``[num_experts, hidden]``, any floating dtype.

    Returns:
        0-dim fp64 tensor (dimensionless) on ``weight.device``; ``+inf`` when the mean row is
        exactly zero (not an exception).

    Raises:
        ValueError: ``weight`` is not 2-D or has fewer than 2 rows (experts).
    """
    _check_router_weight(weight, "router_conditioning_ratio")
    w = weight.detach().to(torch.float64)
    w_bar = w.mean(dim=0)
    spread = torch.linalg.vector_norm(w - w_bar, dim=1).max()
    denom = torch.linalg.vector_norm(w_bar)
    inf = torch.full((), math.inf, dtype=torch.float64, device=w.device)
    return torch.where(denom > 0, spread / torch.where(denom > 0, denom, torch.ones_like(denom)), inf)


def _check_router_weight(weight: Tensor, fn: str) -> None:
    if weight.dim() != 2:
        raise ValueError(f"{fn} expects weight of shape [num_experts, hidden], got {tuple(weight.shape)}.")
    if weight.shape[0] < 2:
        raise ValueError(f"{fn} needs at least 2 experts (rows), got {weight.shape[0]}.")
    if not weight.is_floating_point():
        raise ValueError(f"{fn} expects a floating-point weight, got {weight.dtype}.")


def _topk_indices(logits: Tensor, topk: int) -> Tensor:
    """``[T, topk]`` expert indices; ties broken exactly as ``torch.topk`` breaks them."""
    num_experts = logits.shape[-1]
    if not 1 <= topk <= num_experts:
        raise ValueError(f"topk must be in [1, num_experts={num_experts}], got {topk}.")
    return torch.topk(logits.reshape(-1, num_experts), topk, dim=-1).indices


def _fixed_bincount(idx: Tensor, size: int) -> Tensor:
    """``[size]`` int64 counts of the values of ``idx`` (all in ``[0, size)``).

    Not ``torch.bincount``: on CUDA it reads ``idx.max()`` back to the host to size its output
    (a sync per call). Integer scatter_add is exact, hence deterministic, and ``histc`` is avoided
    because it raises under ``torch.use_deterministic_algorithms`` on CUDA.
    """
    flat = idx.reshape(-1)
    return torch.zeros(size, dtype=torch.int64, device=idx.device).scatter_add_(0, flat, torch.ones_like(flat))


def _count_experts(indices: Tensor, valid: Tensor, num_experts: int) -> Tensor:
    # Invalid tokens are sent to an extra bucket E that is dropped.
    idx = torch.where(valid[:, None], indices, torch.full_like(indices, num_experts))
    return _fixed_bincount(idx, num_experts + 1)[:num_experts]


def expert_load(logits_or_routing_map: Tensor, topk: int | None = None) -> Tensor:
    """Tokens routed to each expert.

    Args:
        logits_or_routing_map: either router ``logits`` ``[..., num_experts]`` (floating; each
            token picks its ``topk`` largest logits, ties broken as ``torch.topk`` does, i.e.
            implementation-defined but deterministic for a given backend), or a boolean
            ``routing_map`` ``[..., num_experts]`` (the router's actual assignment; ``topk`` is
            ignored). Prefer the routing map when the router adds an expert bias, groups or
            capacity dropping, since top-k of raw logits then differs from the real routing.
        topk: experts per token; required for logits.

    Returns:
        ``[num_experts]`` int64 token counts on the input's device.
    """
    x = logits_or_routing_map
    if x.dtype == torch.bool:
        return x.reshape(-1, x.shape[-1]).sum(dim=0, dtype=torch.int64)
    if topk is None:
        raise ValueError("expert_load needs topk when given logits; pass topk=<router top-k> or a bool routing_map.")
    indices = _topk_indices(x, topk)
    valid = torch.ones(indices.shape[0], dtype=torch.bool, device=x.device)
    return _count_experts(indices, valid, x.shape[-1])


def load_fractions(counts: Tensor) -> Tensor:
    """Fraction of routed tokens per expert, ``counts / counts.sum()``, fp64 ``[num_experts]``.

    All-zero counts give NaN fractions (flagged, no host sync).
    """
    c = counts.to(torch.float64)
    return c / c.sum()


def max_violation(counts: Tensor) -> Tensor:
    """MaxVio = max load / mean load - 1 (0 for perfect balance), 0-dim fp64. NaN for no tokens."""
    c = counts.to(torch.float64)
    return c.max() / c.mean() - 1.0


@dataclass
class RouterEntropySummary:
    """Reducible routing statistics for one router (one MoE layer) over some tokens.

    Holds SUMS only, so the summaries of several ranks (DP, EP, sequence/context parallel) or
    micro-batches combine by addition: ``merge`` locally, or one ``all_reduce(SUM)`` of
    :meth:`to_flat_tensor` across ranks. Every tensor is fp64 on the device of the logits.

    Fields:
        num_experts: ``E``.
        num_bins: histogram bins over ``[0, log E]`` nats.
        num_tokens: 0-dim, tokens with finite entropy.
        num_nonfinite: 0-dim, tokens whose logits were non-finite (excluded from the rest).
        entropy_sum: 0-dim, sum of per-token entropies in nats.
        histogram: ``[num_bins]`` token counts per entropy bin.
        expert_counts: ``[E]`` tokens routed to each expert.
    """

    num_experts: int
    num_bins: int
    num_tokens: Tensor
    num_nonfinite: Tensor
    entropy_sum: Tensor
    histogram: Tensor
    expert_counts: Tensor

    # Layout of the flat vector: [num_tokens, num_nonfinite, entropy_sum, histogram, counts].
    _NUM_SCALARS = 3

    @staticmethod
    def flat_size(num_experts: int, num_bins: int) -> int:
        """Length of the vector produced by :meth:`to_flat_tensor`."""
        return RouterEntropySummary._NUM_SCALARS + num_bins + num_experts

    @property
    def bin_width(self) -> float:
        """Histogram bin width in nats, ``log(E) / num_bins``; also the quantile error bound."""
        return math.log(self.num_experts) / self.num_bins

    def to_flat_tensor(self) -> Tensor:
        """One fp64 vector ``[flat_size(E, num_bins)]``, so one ``all_reduce(SUM)`` reduces all."""
        scalars = torch.stack([self.num_tokens, self.num_nonfinite, self.entropy_sum])
        return torch.cat([scalars, self.histogram, self.expert_counts]).to(torch.float64)

    @classmethod
    def from_flat_tensor(cls, flat: Tensor, num_experts: int, num_bins: int) -> RouterEntropySummary:
        """Inverse of :meth:`to_flat_tensor` (e.g. after the all-reduce)."""
        expected = cls.flat_size(num_experts, num_bins)
        if flat.dim() != 1 or flat.numel() != expected:
            raise ValueError(
                f"flat summary must be a vector of length {expected} for num_experts={num_experts}, "
                f"num_bins={num_bins}; got shape {tuple(flat.shape)}."
            )
        f = flat.to(torch.float64)
        s = cls._NUM_SCALARS
        return cls(
            num_experts=num_experts,
            num_bins=num_bins,
            num_tokens=f[0],
            num_nonfinite=f[1],
            entropy_sum=f[2],
            histogram=f[s : s + num_bins],
            expert_counts=f[s + num_bins :],
        )

    def merge(self, other: RouterEntropySummary) -> RouterEntropySummary:
        """Summary of the union of both token sets (a new object; inputs are not modified)."""
        if (self.num_experts, self.num_bins) != (other.num_experts, other.num_bins):
            raise ValueError(
                "cannot merge router summaries with different shapes: "
                f"(num_experts, num_bins) = {(self.num_experts, self.num_bins)} vs "
                f"{(other.num_experts, other.num_bins)}; build both with the same num_bins."
            )
        merged = self.to_flat_tensor() + other.to_flat_tensor().to(self.entropy_sum.device)
        return RouterEntropySummary.from_flat_tensor(merged, self.num_experts, self.num_bins)

    def finalize(self) -> dict[str, float]:
        """Report values as Python floats (one host sync).

        Keys: ``token_entropy_mean`` (nats), ``token_entropy_normalized`` (mean / log E, in
        [0, 1]), ``token_entropy_p01`` / ``_p05`` / ``_p10`` (nats; histogram quantiles, within
        one bin width ``log(E)/num_bins`` of the exact order statistic
        ``torch.quantile(..., interpolation="lower")``), ``max_vio``, ``load_fraction_min``,
        ``load_fraction_max``, ``num_tokens``, ``num_nonfinite_tokens``, ``assignments_per_token``
        (``sum_e c_e / num_tokens``: top-k without dropping, less when a capacity dropped
        assignments). Entropy values are NaN when there are no finite tokens; load values are NaN
        when no token was routed.
        """
        values = self.to_flat_tensor().tolist()
        s = self._NUM_SCALARS
        n, nonfinite, h_sum = values[0], values[1], values[2]
        hist = values[s : s + self.num_bins]
        counts = values[s + self.num_bins :]
        log_e = math.log(self.num_experts)
        mean = h_sum / n if n > 0 else math.nan
        total = sum(counts)
        mean_load = total / self.num_experts
        return {
            "token_entropy_mean": mean,
            "token_entropy_normalized": mean / log_e,
            "token_entropy_p01": _hist_quantile(hist, n, 0.01, self.bin_width),
            "token_entropy_p05": _hist_quantile(hist, n, 0.05, self.bin_width),
            "token_entropy_p10": _hist_quantile(hist, n, 0.10, self.bin_width),
            "max_vio": max(counts) / mean_load - 1.0 if total > 0 else math.nan,
            "load_fraction_min": min(counts) / total if total > 0 else math.nan,
            "load_fraction_max": max(counts) / total if total > 0 else math.nan,
            "num_tokens": n,
            "num_nonfinite_tokens": nonfinite,
            "assignments_per_token": total / n if n > 0 else math.nan,
        }


def _hist_quantile(hist: list[float], n: float, q: float, width: float) -> float:
    """Quantile ``q`` from bin counts: locate the order statistic of rank floor(q (n - 1)).

    The estimate interpolates inside the bin that holds that order statistic, so it is within
    one bin width of it (``torch.quantile(..., interpolation="lower")``).
    """
    if n <= 0:
        return math.nan
    rank = math.floor(q * (n - 1))  # 0-based rank of the target order statistic
    before = 0.0
    for b, c in enumerate(hist):
        if c > 0 and before + c > rank:
            return (b + (rank - before + 0.5) / c) * width
        before += c
    # Unreachable when sum(hist) == n; guard against a corrupted (e.g. partially reduced) summary.
    return len(hist) * width


def summarize_routing(
    logits: Tensor,
    topk: int,
    num_bins: int = DEFAULT_ENTROPY_BINS,
    routing_map: Tensor | None = None,
    score_function: str = "softmax",
    token_mask: Tensor | None = None,
) -> RouterEntropySummary:
    """Build the reducible summary of one router's logits for one micro-batch.

    Args:
        logits: ``[..., num_experts]`` router logits, any floating dtype.
        topk: experts per token, used for ``expert_counts`` when ``routing_map`` is None.
        num_bins: entropy histogram bins over ``[0, log E]``; quantile error <= log(E)/num_bins.
        routing_map: optional bool actual assignment with one row of ``num_experts`` per token of
            ``logits`` (``[..., num_experts]`` or megatron-core's flattened ``[tokens,
            num_experts]``); when given, the expert counts come from it (tokens with non-finite
            logits are still excluded).
        score_function: the router's score function (:data:`SCORE_FUNCTIONS`), which defines
            the routing entropy (:func:`routing_entropy`).
        token_mask: optional ``[...]`` (one entry per token of ``logits``, any dtype; nonzero
            keeps the token) selecting the tokens that count, e.g. DeepSpeed's ``used_token``.
            Masked tokens are left out of every field, as if absent, without boolean indexing
            (which would read the kept count back to the host).

    Returns:
        :class:`RouterEntropySummary` with fp64 tensors on ``logits.device``; no host sync.
    """
    num_experts = logits.shape[-1] if logits.dim() > 0 else 0
    if num_experts < 2:
        raise ValueError(f"summarize_routing needs num_experts >= 2 (entropy range [0, log E]), got {num_experts}.")
    if num_bins < 1:
        raise ValueError(f"num_bins must be >= 1, got {num_bins}.")
    flat_logits = logits.reshape(-1, num_experts)
    entropy = routing_entropy(flat_logits, score_function)
    finite = torch.isfinite(entropy)
    present = torch.ones_like(finite)
    if token_mask is not None:
        if token_mask.numel() != flat_logits.shape[0]:
            raise ValueError(f"token_mask must have one entry per token of the logits {tuple(logits.shape)}, "
                             f"got {tuple(token_mask.shape)}.")
        present = token_mask.reshape(-1).to(device=finite.device) != 0
        finite = finite & present  # a masked token is neither counted nor non-finite
    log_e = math.log(num_experts)
    # Bin index of each token; rounding can put H a hair outside [0, log E], hence the clamp.
    # Non-finite tokens go to an extra bin that is dropped.
    idx = torch.clamp((entropy.to(torch.float64) * (num_bins / log_e)).floor(), 0, num_bins - 1)
    idx = torch.where(finite, idx, torch.full_like(idx, num_bins)).to(torch.int64)
    histogram = _fixed_bincount(idx, num_bins + 1)[:num_bins].to(torch.float64)
    if routing_map is not None:
        # Shapes are host metadata: checking them costs no sync.
        if (
            routing_map.dtype != torch.bool
            or routing_map.dim() == 0
            or routing_map.shape[-1] != num_experts
            or routing_map.numel() != logits.numel()
        ):
            raise ValueError(
                f"routing_map must be a bool tensor with one row of {num_experts} experts per token of the "
                f"logits {tuple(logits.shape)}, got {routing_map.dtype} {tuple(routing_map.shape)}."
            )
        counts = (routing_map.reshape(-1, num_experts) & finite[:, None]).sum(dim=0, dtype=torch.int64)
    else:
        counts = _count_experts(_topk_indices(flat_logits, topk), finite, num_experts)
    h64 = entropy.to(torch.float64)
    return RouterEntropySummary(
        num_experts=num_experts,
        num_bins=num_bins,
        num_tokens=finite.sum(dtype=torch.float64),
        num_nonfinite=(present & ~finite).sum(dtype=torch.float64),
        entropy_sum=torch.where(finite, h64, torch.zeros_like(h64)).sum(),
        histogram=histogram,
        expert_counts=counts.to(torch.float64),
    )
