"""Every scalar the session writes, declared in one place.

All names live under ``mechmon/``; ``L`` is the GLOBAL 1-based layer number (megatron-core's
``layer_number``), ``H`` a global 0-based query-head index. Values are per check step.

Attention (family ``attn``), per layer:
    mechmon/attn/delta2_entropy/layer_L        mean over heads of the Delta2 spectral entropy (nats)
    mechmon/attn/delta2_entropy_min/layer_L    smallest head's Delta2 entropy (nats)
    mechmon/attn/delta2_norm_entropy/layer_L   mean over heads of H / log(rank)
    mechmon/attn/delta2_eff_rank/layer_L       mean over heads of exp(H)
    mechmon/attn/delta1_entropy/layer_L, mechmon/attn/delta3_entropy/layer_L (means over heads)
    mechmon/attn/delta3_to_delta2/layer_L      mean over heads of ||Delta3||_F / ||Delta2||_F
    mechmon/attn/dwq_head_entropy/layer_L, mechmon/attn/dwk_head_entropy/layer_L
                                               mean over heads (groups) of per-head dW entropy
    mechmon/attn/dw_entropy/layer_L            entropy of the full-matrix dW_q of the layer
    mechmon/attn/dwk_entropy/layer_L           entropy of the full-matrix dW_k of the layer
    mechmon/attn/dw_stable_rank/layer_L        stable rank of the full-matrix dW_q
    mechmon/attn/dw_fro_norm/layer_L           ||dW_q||_F over the window
    mechmon/attn/wq_spectral_norm/layer_L      largest singular value of the layer's W_q (now)
    (with per_head_scalars) mechmon/attn/delta2_entropy/layer_L/head_H
  Multi-head latent attention (MLA) layers: delta2_entropy, _min, _norm_entropy, _eff_rank are
  those of the content (no-RoPE) Delta2, the detector's stream; dw_entropy / dwk_entropy are the
  full-matrix dW of the two projections from the hidden state (linear_q_down_proj or
  linear_q_proj, linear_kv_down_proj); no Delta1/Delta3 or per-head dW scalars. Also:
    mechmon/attn/delta2_whole_entropy/layer_L  mean over heads of the whole (no-RoPE and RoPE rows)
                                               Delta2 entropy (nats; recorded, not judged);
                                               per head with per_head_scalars
    (with short_window) mechmon/attn/delta2_entropy_short/layer_L   mean over heads of the Delta2
                                               entropy over the last ``interval`` steps (nats); per
                                               head ``.../layer_L/head_H`` with per_head_scalars
    (with short_window) mechmon/attn/delta2_short_persistence/layer_L   mean over heads of
                                               |<u_k, u_k-1>| |<v_k, v_k-1>|, the leading Delta2
                                               singular pair of two adjacent short windows, in
                                               [0, 1] (recorded; not judged by the detector)
Router (family ``router``), per MoE layer:
    mechmon/router/token_entropy/layer_L       mean routing entropy per token over all experts (nats;
                                               full softmax, or normalised sigmoid scores)
    mechmon/router/token_entropy_norm/layer_L  the same divided by log E
    mechmon/router/token_entropy_p05/layer_L   5 % quantile over tokens (p01, p10 likewise)
    mechmon/router/effective_experts/layer_L   exp(token_entropy): effective experts per token
    mechmon/router/token_entropy_floor/layer_L the routing-entropy alarm's absolute floor (nats),
                                               log(--mechmon-router-min-effective-experts);
                                               absent when the floor is off
    mechmon/router/weight_similarity/layer_L   mean off-diagonal cosine similarity S of router rows
    mechmon/router/eps/layer_L                 conditioning ratio max_i ||w_i - w_bar|| / ||w_bar||
    mechmon/router/max_vio/layer_L             max expert load / mean load - 1 (routing-map counts)
    mechmon/router/dropped_fraction/layer_L    share of token-expert assignments dropped by the
                                               expert capacity (routers with a capacity factor)
    mechmon/router/load_fraction_min/layer_L, mechmon/router/load_fraction_max/layer_L
Detector (per check; F a family the job feeds, of the table in detect/families.py):
    mechmon/detect/F/residual/layer_L      pooled standardised residual u_L (trimmed mean over heads)
    mechmon/detect/F/cusum/layer_L         the layer's CUSUM statistic S
    mechmon/detect/F/cusum                 the family's pooled CUSUM (families with > 1 layer)
Session:
    mechmon/alarm         1 when any stream alarmed at this check (the action ran), else 0
    mechmon/warnings      number of detector tests above their warning level at this check
    mechmon/overhead_ms   session wall time since the previous check (snapshots + this check), ms,
                          max over ranks (router-logit capture inside the forward is not included)
    mechmon/errors        cumulative count of monitor exceptions swallowed (non-strict mode)
    mechmon/active        1 when every rank's checks ran and the detector decided at this check;
                          0 when some phase failed (the job is not fully watched; the log names
                          the cause once per 10 such checks)
"""

from __future__ import annotations

PREFIX = "mechmon"
ALARM = f"{PREFIX}/alarm"
WARNINGS = f"{PREFIX}/warnings"
OVERHEAD_MS = f"{PREFIX}/overhead_ms"
ERRORS = f"{PREFIX}/errors"
ACTIVE = f"{PREFIX}/active"
DETECT_PREFIX = f"{PREFIX}/detect"


def attn(metric: str, layer_number: int, head: int | None = None) -> str:
    """``mechmon/attn/<metric>/layer_L[/head_H]``."""
    name = f"{PREFIX}/attn/{metric}/layer_{layer_number}"
    return name if head is None else f"{name}/head_{head}"


def router(metric: str, layer_number: int) -> str:
    """``mechmon/router/<metric>/layer_L``."""
    return f"{PREFIX}/router/{metric}/layer_{layer_number}"
