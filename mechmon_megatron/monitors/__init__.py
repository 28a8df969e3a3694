"""The pure-torch monitor core: tensors in, numbers out. Never imports megatron or deepspeed.

* ``spectral``: spectral entropy / effective rank / stable rank of singular-value spectra.
* ``qk_increment``: per-head singular values of the QK increments Delta1, Delta2, Delta3.
* ``mla_increment``: per-head singular values of Delta2 for multi-head latent attention (MLA).
* ``norm_fold``: a per-head QK-norm's gamma (and LayerNorm centring) folded into the Q/K rows.
* ``update_spectrum``: singular values of a weight increment dW (exact or randomized).
* ``router``: full-softmax routing entropy, router-weight similarity, load statistics.

The formulas are stated in docs/METHOD.md. (The symptom-level rules the monitors are compared
with live in the research package, ``mechmon_megatron.research.baselines``.)
"""

from mechmon_megatron.monitors.mla_increment import MLAWeights, mla_delta2_singular_values
from mechmon_megatron.monitors.norm_fold import NormFold, fold_norm
from mechmon_megatron.monitors.qk_increment import qk_increment_singular_values
from mechmon_megatron.monitors.router import (
    RouterEntropySummary,
    expert_load,
    load_fractions,
    max_violation,
    router_conditioning_ratio,
    router_weight_similarity,
    routing_entropy,
    summarize_routing,
)
from mechmon_megatron.monitors.spectral import spectral_stats
from mechmon_megatron.monitors.update_spectrum import (
    per_head_update_singular_values,
    spectral_norm,
    tail_energy,
    update_singular_values,
)

__all__ = [
    "MLAWeights",
    "NormFold",
    "RouterEntropySummary",
    "expert_load",
    "fold_norm",
    "load_fractions",
    "max_violation",
    "mla_delta2_singular_values",
    "per_head_update_singular_values",
    "qk_increment_singular_values",
    "router_conditioning_ratio",
    "router_weight_similarity",
    "routing_entropy",
    "spectral_norm",
    "spectral_stats",
    "summarize_routing",
    "tail_energy",
    "update_singular_values",
]
