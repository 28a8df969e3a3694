"""One MoE router's check: routing entropy, load, and router-weight geometry.

The routing entropy is that of the router's score distribution over all experts (softmax, or the
normalised scores of a sigmoid router; ``monitors.router.routing_entropy``); the load comes from
the router's own routing map (after an expert bias, group-limited selection and capacity
dropping) where the adapter captures it.

The routing-entropy stream carries an absolute floor besides its baseline-relative band:
``log(m)`` nats, where ``m`` is the minimum effective number of experts per token
(``--mechmon-router-min-effective-experts``, default the router's top-k). exp(mean entropy) below
top-k means tokens put their routing probability on fewer experts than each is dispatched to,
the signature of the stable-winner loop (docs/METHOD.md section 6). The floor stands in for the baseline
while there is none (``Observation.limit`` in ``detect.pooled_cusum``): it catches a collapse that starts with
training, which the warm-up would otherwise absorb; a healthy router that forms its baseline and
later sharpens slowly is judged against that baseline only.

The floor is argued for softmax routers only, so routers with another score function (sigmoid:
aux-loss-free, DeepSeek-V3 style) have none, whatever the setting; the adapter says so once at
start-up (``NON_SOFTMAX_FLOOR_NOTICE``) and their entropy is judged against its baseline.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from mechmon_megatron.detect.families import ROUTER_ENTROPY, ROUTER_WEIGHTS
from mechmon_megatron.monitors.router import (
    RouterEntropySummary,
    router_conditioning_ratio,
    router_weight_similarity,
)
from mechmon_megatron.session import names
from mechmon_megatron.session.host import RouterSite
from mechmon_megatron.session.records import CheckOutput, NonFinite, Partial, Stream

NON_SOFTMAX_FLOOR_NOTICE = (
    "MoE routers with the {score} score function (layers {layers}): the routing entropy is that of "
    "the normalised scores p_e = s(z_e) / sum_j s(z_j) (expert bias excluded; docs/METHOD.md section 6), and "
    "the absolute routing-entropy floor (--mechmon-router-min-effective-experts) is off for them: it is "
    "argued for softmax routers only. Their entropy is judged against its own baseline."
)
"""Logged once at start-up by the adapter that builds non-softmax router sites (with the ``[mechmon]``
prefix of ``session/log.py``)."""


def entropy_floor_applies(site: RouterSite) -> bool:
    """Whether the absolute routing-entropy floor is defined for this router (softmax only)."""
    return site.score_function == "softmax"


def empty_vector(site: RouterSite, num_bins: int) -> torch.Tensor:
    """The flat summary of zero tokens (what a rank contributes if its summary failed)."""
    return torch.zeros(RouterEntropySummary.flat_size(site.num_experts, num_bins), dtype=torch.float64)


def local_router_vector(site: RouterSite, num_bins: int) -> torch.Tensor:
    """Flat fp64 summary of every micro-batch this rank routed during the check step.

    The adapter's hook already reduced each micro-batch in the forward (``RouterSite.capture``);
    the ranks of ``site.reduce_sum`` then add their vectors in one all-reduce. Raises when the
    capture failed in the forward (the session counts it).
    """
    summary, error = site.take_summary()
    if error is not None:
        raise RuntimeError(f"router {site.name or site.layer_number}: capture failed in the forward: "
                           f"{type(error).__name__}: {error}") from error
    if summary is None:
        return empty_vector(site, num_bins)
    expected = RouterEntropySummary.flat_size(site.num_experts, num_bins)
    if summary.numel() != expected:
        raise ValueError(f"router {site.name or site.layer_number}: captured summary has {summary.numel()} "
                         f"values, expected {expected} (num_bins {num_bins})")
    return summary.to(torch.float64)


def router_output(
    site: RouterSite, flat: torch.Tensor, num_bins: int, entropy_floor: Optional[float] = None
) -> CheckOutput:
    """Scalars and detector streams of one router from its reduced summary (reporting rank).

    ``entropy_floor``: absolute floor of the mean routing entropy in nats (None: none); ignored
    for a router without softmax scores (:func:`entropy_floor_applies`). A router that drops
    tokens (``site.drops_tokens``) also gets ``dropped_fraction``, the share of its token-expert
    assignments dropped by the expert capacity.
    """
    if not site.reports:
        return CheckOutput()
    total = RouterEntropySummary.from_flat_tensor(flat.cpu(), site.num_experts, num_bins)
    if not entropy_floor_applies(site):
        entropy_floor = None
    layer = site.layer_number
    weight = site.weight().detach()
    if not bool(torch.isfinite(weight).all()):
        return CheckOutput(nonfinite=[NonFinite(layer, f"layer {layer}: non-finite router weights")])
    similarity = float(router_weight_similarity(weight))
    eps = float(router_conditioning_ratio(weight))
    scalars: dict[str, Partial] = {
        names.router("weight_similarity", layer): Partial("value", similarity),
        names.router("eps", layer): Partial("value", eps),
    }
    streams = [Stream(name=names.router("weight_similarity", layer), family=ROUTER_WEIGHTS.name, value=similarity,
                      layer_number=layer, member="weight_similarity")]
    nonfinite: list[NonFinite] = []
    if float(total.num_nonfinite) > 0:
        message = f"layer {layer}: {int(total.num_nonfinite)} tokens with non-finite router logits"
        nonfinite.append(NonFinite(layer, message))
    if float(total.num_tokens) > 0:
        stats = total.finalize()
        for key, metric in (
            ("token_entropy_mean", "token_entropy"),
            ("token_entropy_normalized", "token_entropy_norm"),
            ("token_entropy_p01", "token_entropy_p01"),
            ("token_entropy_p05", "token_entropy_p05"),
            ("token_entropy_p10", "token_entropy_p10"),
            ("max_vio", "max_vio"),
            ("load_fraction_min", "load_fraction_min"),
            ("load_fraction_max", "load_fraction_max"),
        ):
            scalars[names.router(metric, layer)] = Partial("value", float(stats[key]))
        if site.drops_tokens:
            dropped = 1.0 - float(stats["assignments_per_token"]) / site.topk
            scalars[names.router("dropped_fraction", layer)] = Partial("value", dropped)
        entropy = float(stats["token_entropy_mean"])
        scalars[names.router("effective_experts", layer)] = Partial("value", math.exp(entropy))
        limit_reason = ""
        if entropy_floor is not None:
            scalars[names.router("token_entropy_floor", layer)] = Partial("value", entropy_floor)
            limit_reason = (
                f"routing spreads over exp(H) = {math.exp(entropy):.3g} effective experts per token, below "
                f"the floor {math.exp(entropy_floor):.3g} (top-k {site.topk} of {site.num_experts}): tokens "
                "concentrate on fewer experts than they are dispatched to (stable-winner collapse)"
            )
        streams.append(
            Stream(name=names.router("token_entropy", layer), family=ROUTER_ENTROPY.name, value=entropy,
                   layer_number=layer, member="token_entropy", limit=entropy_floor, limit_reason=limit_reason)
        )
    return CheckOutput(scalars=scalars, streams=streams, nonfinite=nonfinite)
