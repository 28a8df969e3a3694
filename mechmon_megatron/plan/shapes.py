"""Model shapes (presets or explicit flags) and parallel layouts, validated for the planner.

A ``ModelShape`` is what the monitor sees of a model: attention layers (query heads, K/V groups,
head dim, hidden size; or, with multi-head latent attention, the latent ranks and head dims),
MoE routers (experts, top-k, dense first layers) and the training shape that sets the router
token count and the step-time estimate (sequence length, batch sizes, FFN size, vocabulary). A
``ParallelLayout`` is TP x PP x DP (x EP inside DP). Both validate with ``PlanInputError``, whose
message names the flag to change.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional

MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")
"""``ModelShape`` fields that describe multi-head latent attention (Megatron-LM's flag names)."""
MLA_REQUIRED = ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")
"""The MLA fields an MLA shape must give (``q_lora_rank`` None means no query latent)."""


class PlanInputError(ValueError):
    """Bad planner input; ``flag`` is the command-line flag the message is about."""

    def __init__(self, flag: str, message: str) -> None:
        super().__init__(f"{flag} {message}")
        self.flag = flag


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """One model as the monitor sees it (all sizes in elements, counts in layers/heads)."""

    name: str
    """Preset name or ``custom``."""
    num_layers: int
    """Transformer layers, each with one attention (Megatron ``--num-layers``)."""
    hidden_size: int
    """Model width d (``--hidden-size``)."""
    num_attention_heads: int
    """Query heads per layer (``--num-attention-heads``)."""
    num_query_groups: int
    """K/V groups per layer (GQA; = heads for MHA; ``--num-query-groups``)."""
    kv_channels: int
    """Query/key head dim (``--kv-channels``; not used by MLA layers)."""
    ffn_hidden_size: int
    """Dense FFN width (SwiGLU: three ``d x ffn`` matrices); only for the parameter count."""
    vocab_size: int
    """Vocabulary (untied input and output embeddings); only for the parameter count."""
    seq_length: int
    """Tokens per sequence (``--seq-length``)."""
    micro_batch_size: int = 1
    """Sequences per micro-batch per data-parallel rank (``--micro-batch-size``)."""
    global_batch_size: int
    """Sequences per optimizer step over the whole job (``--global-batch-size``)."""
    num_experts: Optional[int] = None
    """Routed experts per MoE layer (``--num-experts``; None: dense model)."""
    moe_router_topk: int = 2
    """Experts per token (``--moe-router-topk``)."""
    moe_ffn_hidden_size: Optional[int] = None
    """Expert FFN width (default ``ffn_hidden_size``); only for the parameter count."""
    moe_shared_experts: int = 0
    """Shared (always active) experts per MoE layer; only for the parameter count."""
    first_dense_layers: int = 0
    """Leading layers without a router (DeepSeek-V3: 3)."""
    active_params: Optional[float] = None
    """Parameters active per token, when the published figure should replace the count from
    the shape (the MLA presets: the count leaves out routers and most norms and agrees within 3 %)."""
    multi_latent_attention: bool = False
    """Every attention layer is multi-head latent attention (``--multi-latent-attention``): the
    monitor reads the latent projections below instead of ``linear_qkv``."""
    q_lora_rank: Optional[int] = None
    """Query latent rank r_q (``--q-lora-rank``); None: no query latent (``linear_q_proj``)."""
    kv_lora_rank: Optional[int] = None
    """Key/value latent rank r_kv (``--kv-lora-rank``)."""
    qk_head_dim: Optional[int] = None
    """No-RoPE query/key head dim d_nope (``--qk-head-dim``)."""
    qk_pos_emb_head_dim: Optional[int] = None
    """RoPE query/key head dim d_rope (``--qk-pos-emb-head-dim``); the RoPE key is one head shared by all."""
    v_head_dim: Optional[int] = None
    """Value head dim d_v (``--v-head-dim``); only for the parameter count and the step time."""
    note: str = ""
    """How the preset was derived and how approximate it is."""

    @property
    def num_moe_layers(self) -> int:
        return 0 if self.num_experts is None else self.num_layers - self.first_dense_layers

    def is_moe_layer(self, layer_number: int) -> bool:
        """``layer_number`` is 1-based, global."""
        return self.num_experts is not None and layer_number > self.first_dense_layers

    def latent(self) -> Optional[LatentDims]:
        """The MLA sizes (None for classic attention); call after :func:`validate`."""
        if not self.multi_latent_attention:
            return None
        assert self.kv_lora_rank is not None and self.qk_head_dim is not None  # validate() refuses None
        assert self.qk_pos_emb_head_dim is not None and self.v_head_dim is not None
        return LatentDims(q_lora_rank=self.q_lora_rank, kv_lora_rank=self.kv_lora_rank, d_nope=self.qk_head_dim,
                          d_rope=self.qk_pos_emb_head_dim, d_v=self.v_head_dim)

    def attention_params(self) -> float:
        """Attention weights of one layer (Q, K, V, O; MLA: its projections and latent norms)."""
        d, n = self.hidden_size, self.num_attention_heads
        lat = self.latent()
        if lat is None:
            h = self.kv_channels
            return float(d * h * (2 * n + 2 * self.num_query_groups))  # Q, O and K, V
        q = d * n * lat.d_qk if lat.q_lora_rank is None else lat.q_lora_rank * (d + 1 + n * lat.d_qk)
        kv = lat.n_kv * d + lat.kv_lora_rank * (1 + n * (lat.d_nope + lat.d_v))
        return float(q + kv + n * lat.d_v * d)  # + linear_proj

    def score_dims_per_head(self) -> int:
        """Widths of the two attention products per head, q.k and p.v (step-time estimate):
        ``2 kv_channels``, or ``d_nope + d_rope + d_v`` with MLA."""
        lat = self.latent()
        return 2 * self.kv_channels if lat is None else lat.d_qk + lat.d_v

    def params_per_token(self) -> float:
        """Parameters a token passes through (dense: all; MoE: the active experts)."""
        if self.active_params is not None:
            return float(self.active_params)
        d = self.hidden_size
        attn = self.attention_params()
        dense_mlp = 3 * d * self.ffn_hidden_size
        moe_ffn = self.moe_ffn_hidden_size or self.ffn_hidden_size
        moe_mlp = 3 * d * moe_ffn * (self.moe_router_topk + self.moe_shared_experts)
        moe_layers = self.num_moe_layers
        mlp = (self.num_layers - moe_layers) * dense_mlp + moe_layers * moe_mlp
        return float(self.num_layers * attn + mlp + 2 * self.vocab_size * d)


@dataclass(frozen=True, kw_only=True)
class LatentDims:
    """The sizes of one multi-head latent attention layer (``monitors/mla_increment.py``'s names)."""

    q_lora_rank: Optional[int]
    """r_q; None: no query latent, the query is ``linear_q_proj`` ``[n_h * d_qk, H]``."""
    kv_lora_rank: int
    """r_kv."""
    d_nope: int
    d_rope: int
    d_v: int

    @property
    def d_qk(self) -> int:
        """Query/key head dim, no-RoPE plus RoPE."""
        return self.d_nope + self.d_rope

    @property
    def n_kv(self) -> int:
        """Rows of ``linear_kv_down_proj``: the latent, then the shared RoPE key."""
        return self.kv_lora_rank + self.d_rope


def _llama3(name: str, layers: int, hidden: int, heads: int, ffn: int) -> ModelShape:
    return ModelShape(
        name=name, num_layers=layers, hidden_size=hidden, num_attention_heads=heads, num_query_groups=8,
        kv_channels=128, ffn_hidden_size=ffn, vocab_size=128256, seq_length=8192, micro_batch_size=1,
        global_batch_size=1024,
        note="Llama 3 (Dubey et al. 2024, Table 3): exact attention shapes; GQA with 8 KV heads, head dim 128; "
             "sequence 8192, global batch 1024 sequences (8.4M tokens) assumed",
    )


_DEEPSEEK_V3_MLA: dict[str, Any] = dict(multi_latent_attention=True, q_lora_rank=1536, kv_lora_rank=512,
                                         qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128)
"""DeepSeek-V3's MLA sizes (DeepSeek-AI 2024, section 4.2); Kimi K2 has the same."""

PRESETS: dict[str, ModelShape] = {
    "llama3-8b": _llama3("llama3-8b", 32, 4096, 32, 14336),
    "llama3-70b": _llama3("llama3-70b", 80, 8192, 64, 28672),
    "llama3-405b": _llama3("llama3-405b", 126, 16384, 128, 53248),
    "deepseek-v3": ModelShape(
        name="deepseek-v3", num_layers=61, hidden_size=7168, num_attention_heads=128, num_query_groups=128,
        kv_channels=192, ffn_hidden_size=18432, vocab_size=129280, seq_length=4096, micro_batch_size=1,
        global_batch_size=15360, num_experts=256, moe_router_topk=8, moe_ffn_hidden_size=2048,
        moe_shared_experts=1, first_dense_layers=3, active_params=37e9, **_DEEPSEEK_V3_MLA,
        note="DeepSeek-V3 (DeepSeek-AI 2024): 61 layers, hidden 7168, 128 heads with multi-head latent attention "
             "(MLA: q LoRA rank 1536, kv LoRA rank 512, q/k head dim 128 + 64 RoPE, v head dim 128), 256 routed "
             "experts top-8 (+1 shared), first 3 layers without experts; sequence 4096, global batch 15360 sequences. "
             "Active parameters: the published 37B",
    ),
    "kimi-k2": ModelShape(
        name="kimi-k2", num_layers=61, hidden_size=7168, num_attention_heads=64, num_query_groups=64,
        kv_channels=192, ffn_hidden_size=18432, vocab_size=163840, seq_length=4096, micro_batch_size=1,
        global_batch_size=16384, num_experts=384, moe_router_topk=8, moe_ffn_hidden_size=2048,
        moe_shared_experts=1, first_dense_layers=1, active_params=32e9, **_DEEPSEEK_V3_MLA,
        note="Kimi K2 (public config.json of moonshotai/Kimi-K2-Instruct): 61 layers, hidden 7168, 64 heads with "
             "multi-head latent attention (MLA, the latent ranks and head dims of DeepSeek-V3), 384 routed experts "
             "top-8 (+1 shared), first layer without experts, vocabulary 163840. Sequence 4096 and a global batch "
             "of 16384 sequences (67M tokens) assumed. Active parameters: the published 32B",
    ),
}


@dataclass(frozen=True, kw_only=True)
class ParallelLayout:
    """Tensor x pipeline x data parallel sizes (expert parallelism is carved from DP)."""

    tp: int
    pp: int
    dp: int
    ep: int = 1

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def sequence_parallel(self) -> bool:
        """Assumed on whenever TP > 1 (needed for MoE with TP; Megatron's usual setting)."""
        return self.tp > 1


def validate(shape: ModelShape, layout: ParallelLayout) -> None:
    """Raise ``PlanInputError`` naming the flag for any shape/layout the planner does not know."""
    for flag, value in (("--tp", layout.tp), ("--pp", layout.pp), ("--dp", layout.dp), ("--ep", layout.ep)):
        _positive(flag, value)
    for flag, value in (
        ("--num-layers", shape.num_layers), ("--hidden-size", shape.hidden_size),
        ("--num-attention-heads", shape.num_attention_heads), ("--num-query-groups", shape.num_query_groups),
        ("--kv-channels", shape.kv_channels), ("--seq-length", shape.seq_length),
        ("--micro-batch-size", shape.micro_batch_size), ("--global-batch-size", shape.global_batch_size),
        ("--moe-router-topk", shape.moe_router_topk),
    ):
        _positive(flag, value)
    np_, ng, tp = shape.num_attention_heads, shape.num_query_groups, layout.tp
    _validate_mla(shape)
    if not shape.multi_latent_attention and np_ % ng:  # MLA has no K groups
        raise PlanInputError("--num-query-groups", f"{ng} must divide --num-attention-heads {np_} (GQA)")
    if np_ % tp:
        raise PlanInputError("--tp", f"{tp} must divide --num-attention-heads {np_} (query heads per TP rank)")
    if not shape.multi_latent_attention and ng % tp and tp % ng:
        raise PlanInputError(
            "--tp", f"{tp} and --num-query-groups {ng}: one must divide the other (K groups are split over TP "
            "ranks, or each group is replicated on tp/groups ranks)"
        )
    if shape.num_layers % layout.pp:
        raise PlanInputError(
            "--pp", f"{layout.pp} must divide --num-layers {shape.num_layers} (the planner splits layers evenly "
            "over pipeline stages; uneven stages are not modelled)"
        )
    per_step = layout.dp * shape.micro_batch_size
    if shape.global_batch_size % per_step:
        raise PlanInputError(
            "--global-batch-size", f"{shape.global_batch_size} must be a multiple of --dp x --micro-batch-size "
            f"= {per_step}"
        )
    if shape.num_experts is None:
        if layout.ep != 1:
            raise PlanInputError("--ep", f"{layout.ep} needs an MoE model (--num-experts)")
        return
    _positive("--num-experts", shape.num_experts)
    if shape.num_experts < 2:
        raise PlanInputError("--num-experts", f"must be >= 2 for a router, got {shape.num_experts}")
    if shape.moe_router_topk > shape.num_experts:
        raise PlanInputError("--moe-router-topk", f"{shape.moe_router_topk} exceeds --num-experts {shape.num_experts}")
    if shape.num_experts % layout.ep:
        raise PlanInputError("--ep", f"{layout.ep} must divide --num-experts {shape.num_experts}")
    if layout.dp % layout.ep:
        raise PlanInputError(
            "--ep", f"{layout.ep} must divide --dp {layout.dp} (expert parallelism is carved from data "
            "parallelism; expert TP = TP)"
        )
    if not 0 <= shape.first_dense_layers < shape.num_layers:
        raise PlanInputError("--first-dense-layers", f"must be in [0, num_layers), got {shape.first_dense_layers}")


def _positive(flag: str, value: int, low: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        what = "a positive integer" if low == 1 else f"an integer >= {low}"
        raise PlanInputError(flag, f"must be {what}, got {value!r}")


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def _validate_mla(shape: ModelShape) -> None:
    """MLA sizes all given and in range with ``--multi-latent-attention``, none without it.

    The planner does not fill in Megatron-LM's defaults for a missing size: a plan for the wrong
    latent rank would look plausible and be wrong.
    """
    given = [f for f in MLA_FIELDS if getattr(shape, f) is not None]
    if not shape.multi_latent_attention:
        if given:
            raise PlanInputError("--multi-latent-attention", f"is required with {', '.join(map(_flag, given))} "
                                 "(the latent sizes describe multi-head latent attention)")
        return
    missing = [f for f in MLA_REQUIRED if getattr(shape, f) is None]
    if missing:
        raise PlanInputError(_flag(missing[0]), "is required with --multi-latent-attention (missing: "
                             f"{' '.join(map(_flag, missing))}; --q-lora-rank is optional: without it the query "
                             "has no latent)")
    for field in ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "v_head_dim"):
        if getattr(shape, field) is not None:
            _positive(_flag(field), getattr(shape, field))
    _positive("--qk-pos-emb-head-dim", shape.qk_pos_emb_head_dim, low=0)  # type: ignore[arg-type]


def resolve_shape(preset: Optional[str], overrides: dict, dp: int = 1) -> ModelShape:
    """A preset with explicit flags on top, or a custom shape from the flags alone.

    ``overrides`` maps ``ModelShape`` field names to values (None = not given). A custom shape
    without ``--global-batch-size`` gets one micro-batch per data-parallel rank (``dp`` x mbs).
    """
    given = {k: v for k, v in overrides.items() if v is not None}
    if preset is not None:
        if preset not in PRESETS:
            raise PlanInputError("--model", f"{preset!r} is not a preset; choose one of {sorted(PRESETS)} or give "
                                            "the shape flags (--num-layers --hidden-size --num-attention-heads ...)")
        base = PRESETS[preset]
        if given:
            base = replace(base, name=f"{preset}+overrides", active_params=None if _changes_size(given) else
                           base.active_params, **given)
        return base
    required = ("num_layers", "hidden_size", "num_attention_heads")
    missing = [k for k in required if k not in given]
    if missing:
        flags = " ".join("--" + k.replace("_", "-") for k in missing)
        raise PlanInputError("--model", f"is not given, so the shape flags are required; missing: {flags}")
    heads, hidden = given["num_attention_heads"], given["hidden_size"]
    mla = bool(given.get("multi_latent_attention"))  # MLA layers do not use --kv-channels
    if "kv_channels" not in given and not mla and (heads < 1 or hidden % heads):
        raise PlanInputError("--kv-channels", f"is required when --hidden-size {hidden} is not a multiple of "
                                              f"--num-attention-heads {heads}")
    defaults = dict(
        name="custom", num_query_groups=heads, kv_channels=hidden // heads if heads > 0 else 0,
        ffn_hidden_size=4 * hidden, vocab_size=128256, seq_length=4096, micro_batch_size=1,
    )
    if mla and "kv_channels" not in given and given.get("qk_head_dim") is not None:
        defaults["kv_channels"] = given["qk_head_dim"] + given.get("qk_pos_emb_head_dim", 0)  # d_qk, for the record
    fields = {**defaults, **given}
    fields.setdefault("global_batch_size", dp * fields["micro_batch_size"])
    return ModelShape(**fields)


def _changes_size(given: dict) -> bool:
    sized = {"num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
             "num_experts", "moe_router_topk", "ffn_hidden_size", "moe_ffn_hidden_size",
             "multi_latent_attention", *MLA_FIELDS}
    return bool(sized & set(given))
