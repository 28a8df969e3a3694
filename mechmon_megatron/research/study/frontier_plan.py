"""The run list of the frontier-attention fault study: the detector study's grid on two attention
variants of its model, multi-head latent attention (``full-mla``) and per-head QK-norm
(``full-qknorm``), with the shipped detector unchanged (pre-registered in docs/METHOD.md section
8b).

Per variant, from :func:`~mechmon_megatron.research.study.long_plan.plan_campaign` on that
variant's 10,000-step preset: the healthy cosine runs of seeds 1-3 (10,000 steps; seed 3
interrupted at 5,000 and resumed, as there), the amplified FA fault at 32 and 16 BF16 ulps with
onsets 500 and 2,000 (seeds 1-3, forked from the healthy run of the same seed at ``onset - delta``),
and the router-only LR fault (seeds 1-3). Left out, for the CPU budget: the 8-ulp run, the
whole-model LR fault, the WSD and held-out healthy runs.

Pure Python: no torch import.
"""

from __future__ import annotations

from mechmon_megatron.research.study.long_plan import CampaignRun, long_preset, plan_campaign

FRONTIER_VARIANTS: dict[str, str] = {"mla": "full-mla", "qknorm": "full-qknorm"}
"""Plan name suffix -> the fault study's preset of that attention variant."""

_KEPT_PREFIXES = ("healthy-cosine-seed1", "healthy-cosine-seed2", "healthy-cosine-seed3", "fa-s32-", "fa-s16-",
                  "moe-router-lr-")


def plan_frontier_campaign(variant: str) -> list[CampaignRun]:
    """Every run of one variant's campaign, in launch order (healthy parents first)."""
    if variant not in FRONTIER_VARIANTS:
        raise ValueError(f"unknown attention variant {variant!r}; choose from {sorted(FRONTIER_VARIANTS)}")
    runs = plan_campaign(long_preset(FRONTIER_VARIANTS[variant]))
    return [run for run in runs if run.run_id.startswith(_KEPT_PREFIXES)]
