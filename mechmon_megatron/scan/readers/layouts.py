"""Where Q/K and router weights sit in a flat state dict, and how to cut them into heads.

The classic layouts are those the DeepSpeed adapter knows on live modules
(``adapters/deepspeed/attention_layouts.py``), recognised here by parameter names, since a
checkpoint has no modules:

=================  =====================================================  ==========================
layout             parameter (suffix)                                     rows
=================  =====================================================  ==========================
``megatron_qkv``   ``linear_qkv.weight`` (megatron-core),                 per query group
                   ``query_key_value.weight`` (Megatron-DeepSpeed)        ``[q x r | k | v]``
``separate``       ``q_proj.weight`` + ``k_proj.weight`` (Hugging Face)    ``[heads*hd]``, ``[groups*hd]``
``stacked_qkv``    ``qkv_proj.weight``, ``Wqkv.weight``, ``in_proj_weight``  ``[q | k | v]``
``gpt2_c_attn``    ``c_attn.weight`` (GPT-2 ``Conv1D``, input-major)       columns ``[q | k | v]``
``mla``            multi-head latent attention, below                     per head, below
=================  =====================================================  ==========================

QK-norm next to a classic layout (folded into the per-head rows, ``monitors/norm_fold.py``):
``q_layernorm.weight`` / ``k_layernorm.weight`` (megatron-core ``qk_layernorm``) or
``q_norm.weight`` / ``k_norm.weight`` (Hugging Face Qwen3, Gemma 3, OLMo-2), either of size
``head_dim`` (one gamma shared by every head: Qwen3, Gemma 3, megatron-core), or of size
``heads * head_dim`` (q) / ``groups * head_dim`` (k): OLMo-2 normalises the whole projected
query and key. For an RMSNorm the whole-projection norm folds exactly as well: its ``1/rms`` is
one input-dependent scalar (shared by the heads instead of one per head), left out like every
norm's, and head h's logit is the bilinear form of ``diag(gamma_h) W_q,h`` and
``diag(gamma_k,h) W_k,h`` with ``gamma_h`` head h's slice of gamma; the scan folds each head's
slice (``scan/pairs.py``). A LayerNorm over the whole projection would centre across heads,
which no per-head form expresses: refused with a message. Norm kind and zero-centred gamma come
from the checkpoint's args or config, else the flags, else RMSNorm with a plain gamma.

Multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi K2; megatron-core ``MLASelfAttention``),
the layout of docs/METHOD.md section 4b, ``H`` hidden, ``n_h`` heads, ``d_qk = d_nope + d_rope``:

=======================================  =============================  ==============================================
megatron-core                            Hugging Face (DeepSeek-V3)     shape
=======================================  =============================  ==============================================
``linear_q_down_proj.weight``            ``q_a_proj.weight``            ``[q_lora_rank, H]``
``q_layernorm.weight`` or                ``q_a_layernorm.weight``       ``[q_lora_rank]``
``linear_q_up_proj.layer_norm_weight``
``linear_q_up_proj.weight``              ``q_b_proj.weight``            ``[n_h * d_qk, q_lora_rank]`` (a)
``linear_q_proj.weight`` (no latent)     ``q_proj.weight``              ``[n_h * d_qk, H]`` (a)
``linear_kv_down_proj.weight``           ``kv_a_proj_with_mqa.weight``  ``[kv_lora_rank + d_rope, H]`` (b)
``kv_layernorm.weight`` or               ``kv_a_layernorm.weight``      ``[kv_lora_rank]``
``linear_kv_up_proj.layer_norm_weight``
``linear_kv_up_proj.weight``             ``kv_b_proj.weight``           ``[n_h * (d_nope + d_v), kv_lora_rank]`` (c)
``linear_qkv_down_proj.weight`` (fused)                                 ``[q_lora_rank + kv_lora_rank + d_rope, H]``
=======================================  =============================  ==============================================

Rows: (a) per head ``d_nope`` no-RoPE rows then ``d_rope`` RoPE rows; (b) the latent, then the
RoPE key shared by every head; (c) per head ``d_nope`` key rows then ``d_v`` value rows; the
fused down projection is ``[q_down | kv_down]``. Kimi K2 uses the DeepSeek-V3 names.

A layer is MLA when it has a key/value down projection. The row orders are the same in both
namings; Hugging Face permutes the RoPE channels of q and k alike, which leaves every logit, and
so Delta2, unchanged. The dims follow from the shapes and the head count: ``kv_lora_rank`` is the
latent norm's size (or the up projection's columns), ``d_rope`` the down projection's rows beyond
it, ``d_qk`` the query rows per head, ``d_v`` the key/value up rows per head beyond ``d_nope``.
Where the checkpoint or the flags give a dim (``qk_head_dim``, ``qk_pos_emb_head_dim``,
``v_head_dim``, the latent ranks), every stored shape is checked against it, and a shape that
does not fit names the key and the shape expected. A LayerNorm latent is refused, as the live
adapter refuses it (the kernel folds RMSNorm gammas only). The norms of the hidden state fused
into a projection from it (``linear_q_proj.layer_norm_weight`` and the like) sit in front of the
projection and are left out, as online.

MoE routers: ``mlp.router.weight`` (megatron-core), ``gate.wg.weight`` (DeepSpeed MoE),
``block_sparse_moe.gate.weight`` (Mixtral), ``mlp.gate.weight`` (Qwen-MoE / DeepSeek style),
each ``[num_experts, hidden]``.

The layer number of a parameter is its first integer path component + 1
(``model.layers.3.self_attn.q_proj.weight`` -> layer 4), as the DeepSpeed adapter numbers modules.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Literal, Optional

import torch

from mechmon_megatron.monitors.mla_increment import MLAWeights
from mechmon_megatron.monitors.norm_fold import NormFold
from mechmon_megatron.scan.errors import ScanInputError
from mechmon_megatron.scan.readers.base import HeadCounts, HeadHints, LayerWeights, MLADims, NormKind
from mechmon_megatron.session.host import MLAHeads
from mechmon_megatron.session.qkv_layout import split_qk

__all__ = ["AttentionKeys", "build_layer", "find_layer_keys", "replicated_roles", "resolve_heads", "split_heads"]

Layout = Literal["megatron_qkv", "separate", "stacked_qkv", "gpt2_c_attn", "mla"]
Shape = tuple[int, ...]

_FUSED_SUFFIXES: tuple[tuple[str, Layout], ...] = (
    ("linear_qkv.weight", "megatron_qkv"),
    ("query_key_value.weight", "megatron_qkv"),
    ("qkv_proj.weight", "stacked_qkv"),
    ("Wqkv.weight", "stacked_qkv"),
    ("in_proj_weight", "stacked_qkv"),
    ("c_attn.weight", "gpt2_c_attn"),
)
_ROUTER_SUFFIXES = ("mlp.router.weight", "gate.wg.weight", "block_sparse_moe.gate.weight", "mlp.gate.weight")
_INDEX = re.compile(r"(?:^|\.)(\d+)\.")

# (module, parameter) -> role, for the tensors of an MLA layer (the module doc's table).
_MLA_NAMES: dict[tuple[str, str], str] = {
    ("linear_q_down_proj", "weight"): "q_down", ("q_a_proj", "weight"): "q_down",
    ("q_layernorm", "weight"): "q_norm", ("linear_q_up_proj", "layer_norm_weight"): "q_norm",
    ("q_a_layernorm", "weight"): "q_norm",
    ("linear_q_up_proj", "weight"): "q_up", ("q_b_proj", "weight"): "q_up",
    ("linear_q_proj", "weight"): "q_proj", ("q_proj", "weight"): "q_proj",
    ("linear_kv_down_proj", "weight"): "kv_down", ("kv_a_proj_with_mqa", "weight"): "kv_down",
    ("linear_qkv_down_proj", "weight"): "qkv_down",
    ("kv_layernorm", "weight"): "kv_norm", ("linear_kv_up_proj", "layer_norm_weight"): "kv_norm",
    ("kv_a_layernorm", "weight"): "kv_norm",
    ("linear_kv_up_proj", "weight"): "kv_up", ("kv_b_proj", "weight"): "kv_up",
}
MLA_ROLES = ("q_down", "q_norm", "q_up", "q_proj", "qkv_down", "kv_down", "kv_norm", "kv_up")
"""The roles of an MLA layer's tensors, in the order :attr:`AttentionKeys.keys` lists them."""
# The names each convention gives a role, for messages about a missing tensor.
_MLA_SPELLING = {
    "megatron": {"q_down": "linear_q_down_proj.weight", "q_up": "linear_q_up_proj.weight",
                 "q_proj": "linear_q_proj.weight", "kv_up": "linear_kv_up_proj.weight"},
    "hf": {"q_down": "q_a_proj.weight", "q_up": "q_b_proj.weight", "q_proj": "q_proj.weight",
           "kv_up": "kv_b_proj.weight"},
}
_QK_NORM_NAMES: dict[tuple[str, str], str] = {
    ("q_layernorm", "weight"): "q_norm", ("k_layernorm", "weight"): "k_norm",
    ("q_norm", "weight"): "q_norm", ("k_norm", "weight"): "k_norm",
}
_NORM_ROLES = ("q_norm", "k_norm", "kv_norm")


@dataclass(frozen=True, slots=True)
class AttentionKeys:
    """The state-dict keys of one layer: its attention tensors and router.

    ``keys[i]`` plays ``roles[i]``: ``"qkv"`` (one fused tensor) or ``"q"`` + ``"k"``, then any
    ``"q_norm"`` / ``"k_norm"`` (QK-norm gammas); for ``layout == "mla"`` the roles of
    :data:`MLA_ROLES` the layer has.
    """

    layer: int
    layout: Layout
    keys: tuple[str, ...]
    router: Optional[str] = None
    roles: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.roles:  # a classic layout without norms: the roles follow from the layout
            object.__setattr__(self, "roles", ("q", "k") if self.layout == "separate" else ("qkv",))

    def key(self, role: str) -> Optional[str]:
        """The key playing ``role``, or None."""
        return dict(zip(self.roles, self.keys)).get(role)


def _layer_index(key: str) -> Optional[int]:
    match = _INDEX.search(key)
    return int(match.group(1)) if match else None


def _name(key: str) -> tuple[str, str]:
    """(module, parameter): the last two path components."""
    parts = key.rsplit(".", 2)
    return (parts[-2], parts[-1]) if len(parts) >= 2 else ("", key)


@dataclass
class _Found:
    """What one layer's keys hold, by kind."""

    fused: Optional[tuple[str, Layout]] = None
    q: Optional[str] = None
    k: Optional[str] = None
    router: Optional[str] = None
    mla: dict[str, str] | None = None
    qk_norms: dict[str, str] | None = None

    def note(self, key: str) -> None:
        for suffix, layout in _FUSED_SUFFIXES:
            if key.endswith(suffix) and self.fused is None:
                self.fused = (key, layout)
        if key.endswith("q_proj.weight") and not key.endswith("qkv_proj.weight"):
            self.q = self.q or key
        elif key.endswith("k_proj.weight"):
            self.k = self.k or key
        if any(key.endswith(s) for s in _ROUTER_SUFFIXES):
            self.router = self.router or key
        name = _name(key)
        if name in _MLA_NAMES:
            self.mla = self.mla or {}
            self.mla.setdefault(_MLA_NAMES[name], key)
        if name in _QK_NORM_NAMES:
            self.qk_norms = self.qk_norms or {}
            self.qk_norms.setdefault(_QK_NORM_NAMES[name], key)

    @property
    def is_mla(self) -> bool:
        return self.mla is not None and ("kv_down" in self.mla or "qkv_down" in self.mla)


def find_layer_keys(keys: Iterable[str], where: str, layer_offset: int = 0) -> dict[int, AttentionKeys]:
    """Global layer number -> its keys. ``layer_offset``: layers held by earlier pipeline stages
    (legacy Megatron files number their layers locally). Optimizer entries are ignored.

    Raises:
        ScanInputError: a layer with part of a layout (q_proj without k_proj; an MLA down
            projection without its up projection), naming the key expected.
    """
    found: dict[int, _Found] = {}
    for key in keys:
        if key.startswith("optimizer") or "._extra_state" in key:
            continue
        index = _layer_index(key)
        if index is not None:
            found.setdefault(index + 1 + layer_offset, _Found()).note(key)
    out: dict[int, AttentionKeys] = {}
    for layer in sorted(found):
        f = found[layer]
        if f.is_mla:
            out[layer] = _mla_keys(layer, f, where)
        elif f.fused is not None or f.q is not None:
            out[layer] = _classic_keys(layer, f, where)
    return out


def _classic_keys(layer: int, f: _Found, where: str) -> AttentionKeys:
    if f.fused is not None:
        layout, keys, roles = f.fused[1], [f.fused[0]], ["qkv"]
    elif f.k is not None:
        assert f.q is not None
        layout, keys, roles = "separate", [f.q, f.k], ["q", "k"]
    else:
        raise ScanInputError(f"{where}: layer {layer} has {f.q!r} but no matching k_proj.weight.")
    for role in ("q_norm", "k_norm"):
        if f.qk_norms and role in f.qk_norms:
            keys.append(f.qk_norms[role])
            roles.append(role)
    return AttentionKeys(layer, layout, tuple(keys), f.router, tuple(roles))


def _mla_keys(layer: int, f: _Found, where: str) -> AttentionKeys:
    """An MLA layer's keys, after checking that its query and key sides are complete."""
    assert f.mla is not None
    got = f.mla
    down = got.get("kv_down") or got["qkv_down"]
    convention = "hf" if _name(down)[0] == "kv_a_proj_with_mqa" else "megatron"
    prefix = down.rsplit(".", 2)[0] + "."

    def missing(role: str, shape: str, why: str) -> ScanInputError:
        expected = prefix + _MLA_SPELLING[convention][role]
        return ScanInputError(f"{where}: layer {layer} is multi-head latent attention ({down!r}) but has no "
                              f"{expected!r}: expected a tensor of shape {shape} ({why}).")

    if "kv_down" in got and "qkv_down" in got:
        raise ScanInputError(f"{where}: layer {layer} has both {got['kv_down']!r} and the fused {got['qkv_down']!r}.")
    if "kv_up" not in got:
        raise missing("kv_up", "[num_heads * (qk_head_dim + v_head_dim), kv_lora_rank]",
                      "the key/value up projection: per head the no-RoPE key rows, then the value rows")
    if "q_proj" in got and ({"q_down", "q_up", "qkv_down"} & set(got)):
        latent = got.get("q_down") or got.get("q_up") or got.get("qkv_down")
        raise ScanInputError(f"{where}: layer {layer} has {got['q_proj']!r} (no query latent) and a query latent "
                             f"({latent!r}); expected one of them.")
    if "q_proj" not in got:
        if "q_up" not in got:
            raise missing("q_up", "[num_heads * (qk_head_dim + qk_pos_emb_head_dim), q_lora_rank]",
                          "the query up projection; or, without a query latent, "
                          f"{prefix + _MLA_SPELLING[convention]['q_proj']!r} of shape "
                          "[num_heads * (qk_head_dim + qk_pos_emb_head_dim), hidden]")
        if "q_down" not in got and "qkv_down" not in got:
            raise missing("q_down", "[q_lora_rank, hidden]", "the query down projection")
    if "q_norm" in got and "q_proj" in got:
        got = {role: key for role, key in got.items() if role != "q_norm"}  # a hidden-state norm: left out
    roles = tuple(r for r in MLA_ROLES if r in got)
    return AttentionKeys(layer, "mla", tuple(got[r] for r in roles), f.router, roles)


# ------------------------------------------------------------------------------------------ heads
def resolve_heads(attn: AttentionKeys, shapes: Mapping[str, Shape], hints: HeadHints, where: str) -> HeadCounts:
    """Head layout of one layer from its stored shapes (``shapes[key]``, TP shards merged) and
    the known numbers (``hints``). Raises ScanInputError naming the flag, key or shape at fault."""
    by_role = {role: tuple(int(x) for x in shapes[key]) for role, key in zip(attn.roles, attn.keys)}
    if attn.layout == "mla":
        return _resolve_mla(attn, by_role, hints, where)
    qk = [by_role[r] for r in attn.roles if r not in _NORM_ROLES]
    counts = _resolve_classic(attn.layout, qk, hints, where)
    return replace(counts, norm=_resolve_qk_norms(attn, by_role, counts, hints, where))


def _resolve_classic(layout: Layout, shape_list: list[Shape], hints: HeadHints, where: str) -> HeadCounts:
    need = "pass --num-attention-heads (and --num-query-groups for GQA)"
    heads = hints.num_heads
    if heads is None:
        raise ScanInputError(
            f"{where}: the checkpoint does not record the number of attention heads ({layout} Q/K layout); {need}."
        )
    if layout == "separate":
        q_rows, k_rows = shape_list[0][0], shape_list[1][0]
        head_dim = hints.head_dim or (q_rows // heads if q_rows % heads == 0 else 0)
        if not head_dim or q_rows != heads * head_dim or k_rows % head_dim:
            raise ScanInputError(
                f"{where}: q_proj has {q_rows} rows and k_proj {k_rows}, which do not split into {heads} heads "
                f"(head_dim {hints.head_dim or 'unknown'}); check --num-attention-heads / --kv-channels."
            )
        groups = k_rows // head_dim
    else:
        rows = shape_list[0][1] if layout == "gpt2_c_attn" else shape_list[0][0]
        groups = hints.num_groups or heads
        if hints.head_dim:
            head_dim = hints.head_dim
        elif rows % (heads + 2 * groups) == 0:
            head_dim = rows // (heads + 2 * groups)
        else:
            head_dim = 0
        if not head_dim or rows != head_dim * (heads + 2 * groups):
            raise ScanInputError(
                f"{where}: the fused QKV weight has {rows} rows, expected head_dim x (heads + 2 groups) with "
                f"{heads} heads and {groups} groups; check --num-attention-heads / --num-query-groups / --kv-channels."
            )
    if heads % groups:
        raise ScanInputError(f"{where}: {heads} heads are not a multiple of {groups} key/value groups.")
    return HeadCounts(num_heads=heads, num_groups=groups, head_dim=head_dim)


def _norm_kind(hints: HeadHints) -> NormKind:
    return NormKind(centres=hints.normalization == "LayerNorm", zero_centered_gamma=bool(hints.zero_centered_gamma))


def _resolve_qk_norms(attn: AttentionKeys, by_role: Mapping[str, Shape], counts: HeadCounts, hints: HeadHints,
                      where: str) -> Optional[NormKind]:
    """The QK-norms' kind, after checking each gamma is per head (``[head_dim]``) or over the
    whole projection (``[heads * head_dim]`` / ``[groups * head_dim]``)."""
    present = [r for r in ("q_norm", "k_norm") if r in by_role]
    if not present:
        return None
    kind = _norm_kind(hints)
    d = counts.head_dim
    for role in present:
        n = counts.num_heads if role == "q_norm" else counts.num_groups
        shape, key = by_role[role], attn.key(role)
        if shape not in ((d,), (n * d,)):
            raise ScanInputError(
                f"{where}: {key!r} has shape {shape}, expected ({d},) (a QK-norm per head of {d} channels) or "
                f"({n * d},) (a norm over the whole projection, {n} x {d}); check --kv-channels."
            )
        if shape != (d,) and n > 1 and kind.centres:
            raise ScanInputError(
                f"{where}: {key!r} is a LayerNorm over the whole projection ({n} heads x {d}): it centres across "
                "heads, which no per-head bilinear form expresses, so the scan cannot fold it (an RMSNorm there "
                f"folds exactly; normalization {hints.normalization} from {hints.source or 'the flags'})."
            )
    return kind


# -------------------------------------------------------------------------------------------- MLA
_MLA_SHAPE_TEXT = {
    "q_down": "[q_lora_rank, hidden]",
    "q_norm": "[q_lora_rank]",
    "q_up": "[num_heads * (qk_head_dim + qk_pos_emb_head_dim), q_lora_rank]",
    "q_proj": "[num_heads * (qk_head_dim + qk_pos_emb_head_dim), hidden]",
    "qkv_down": "[q_lora_rank + kv_lora_rank + qk_pos_emb_head_dim, hidden]",
    "kv_down": "[kv_lora_rank + qk_pos_emb_head_dim, hidden]",
    "kv_norm": "[kv_lora_rank]",
    "kv_up": "[num_heads * (qk_head_dim + v_head_dim), kv_lora_rank]",
}


def _mla_error(where: str, what: str, hints: HeadHints) -> ScanInputError:
    source = f" (numbers from {hints.source})" if hints.source else ""
    return ScanInputError(f"{where}: {what}{source}; check --num-attention-heads / --qk-head-dim / "
                          "--qk-pos-emb-head-dim / --v-head-dim.")


def _resolve_mla(attn: AttentionKeys, by_role: Mapping[str, Shape], hints: HeadHints, where: str) -> HeadCounts:
    """MLA dims from the shapes and hints; every stored shape is then checked against them."""
    n_h = hints.num_heads
    if n_h is None:
        raise ScanInputError(f"{where}: the checkpoint does not record the number of attention heads (multi-head "
                             "latent attention); pass --num-attention-heads.")
    for role, shape in by_role.items():
        if len(shape) != (1 if role in _NORM_ROLES else 2):
            raise _mla_error(where, f"{attn.key(role)!r} has shape {shape}, expected {_MLA_SHAPE_TEXT[role]}", hints)
    down = by_role.get("kv_down") or by_role["qkv_down"]
    hidden = down[1]
    latent = "q_proj" not in by_role
    r_q = (hints.q_lora_rank or (by_role["q_norm"][0] if "q_norm" in by_role else by_role["q_up"][1])) \
        if latent else None
    r_kv = hints.kv_lora_rank or (by_role["kv_norm"][0] if "kv_norm" in by_role else by_role["kv_up"][1])
    d_rope = hints.qk_pos_emb_head_dim
    if d_rope is None:
        d_rope = down[0] - r_kv - ((r_q or 0) if "qkv_down" in by_role else 0)
    q_rows = by_role["q_up" if latent else "q_proj"][0]
    if hints.qk_head_dim is not None:
        d_nope = hints.qk_head_dim
    elif q_rows % n_h == 0:
        d_nope = q_rows // n_h - d_rope
    else:
        raise _mla_error(where, f"{attn.key('q_up' if latent else 'q_proj')!r} has {q_rows} rows, not "
                                f"{n_h} heads x (qk_head_dim + qk_pos_emb_head_dim)", hints)
    kv_rows = by_role["kv_up"][0]
    if hints.v_head_dim is not None:
        d_v = hints.v_head_dim
    elif kv_rows % n_h == 0:
        d_v = kv_rows // n_h - d_nope
    else:
        raise _mla_error(where, f"{attn.key('kv_up')!r} has {kv_rows} rows, not {n_h} heads x (qk_head_dim + "
                                "v_head_dim)", hints)
    dims = MLADims(qk_head_dim=d_nope, qk_pos_emb_head_dim=d_rope, v_head_dim=d_v, q_lora_rank=r_q,
                   kv_lora_rank=r_kv)
    _check_mla_shapes(attn, by_role, n_h, hidden, dims, hints, where)
    norm = None
    if "q_norm" in by_role or "kv_norm" in by_role:
        norm = _norm_kind(hints)
        if norm.centres:
            raise ScanInputError(
                f"{where}: the latent norms of this multi-head latent attention layer are LayerNorms (normalization "
                f"from {hints.source or 'the flags'}): centring is not folded for MLA (RMSNorm is), as online.")
    return HeadCounts(num_heads=n_h, num_groups=n_h, head_dim=d_nope + d_rope, mla=dims, norm=norm)


def _check_mla_shapes(attn: AttentionKeys, by_role: Mapping[str, Shape], n_h: int, hidden: int, dims: MLADims,
                      hints: HeadHints, where: str) -> None:
    d_nope, d_rope, d_v = dims.qk_head_dim, dims.qk_pos_emb_head_dim, dims.v_head_dim
    r_q, r_kv = dims.q_lora_rank or 0, dims.kv_lora_rank
    if d_nope < 1 or d_rope < 0 or d_v < 0:
        raise _mla_error(where, f"the shapes give qk_head_dim {d_nope}, qk_pos_emb_head_dim {d_rope}, v_head_dim "
                                f"{d_v} with {n_h} heads ({', '.join(f'{k} {s}' for k, s in by_role.items())})", hints)
    expected: dict[str, Shape] = {
        "q_down": (r_q, hidden), "q_norm": (r_q,), "q_up": (n_h * (d_nope + d_rope), r_q),
        "q_proj": (n_h * (d_nope + d_rope), hidden), "qkv_down": (r_q + r_kv + d_rope, hidden),
        "kv_down": (r_kv + d_rope, hidden), "kv_norm": (r_kv,), "kv_up": (n_h * (d_nope + d_v), r_kv),
    }
    for role in attn.roles:
        if by_role[role] != expected[role]:
            raise _mla_error(
                where, f"{attn.key(role)!r} has shape {by_role[role]}, expected {expected[role]} = "
                       f"{_MLA_SHAPE_TEXT[role]} with {n_h} heads, hidden {hidden}, qk_head_dim {d_nope}, "
                       f"qk_pos_emb_head_dim {d_rope}, v_head_dim {d_v}, q_lora_rank {dims.q_lora_rank}, "
                       f"kv_lora_rank {r_kv}", hints)


# ------------------------------------------------------------------------------- tensor parallel
def replicated_roles(attn: AttentionKeys, local: Mapping[str, Shape]) -> frozenset[str]:
    """The roles whose tensor every tensor-parallel rank holds whole, from one rank's shapes.

    Norm gammas are replicated. The projections split by head (q/k rows, the MLA up projections
    and ``q_proj``) are row shards. An MLA down projection is replicated under Transformer Engine
    (``parallel_mode="duplicated"``) and a row shard under the local spec: whole when it has
    more rows than the latent(s) alone (a shard has at most ``1 / tp`` of them).
    """
    by_role = {role: local[key] for role, key in zip(attn.roles, attn.keys)}
    out = {r for r in attn.roles if r in _NORM_ROLES}
    if attn.layout == "mla":
        r_kv = by_role["kv_up"][1]  # column count: the up projection is split by rows only
        r_q = by_role["q_up"][1] if "q_up" in by_role else 0
        if "q_down" in by_role and by_role["q_down"][0] == r_q:
            out.add("q_down")
        if "kv_down" in by_role and by_role["kv_down"][0] > r_kv:
            out.add("kv_down")
        if "qkv_down" in by_role and by_role["qkv_down"][0] > r_q + r_kv:
            out.add("qkv_down")
    return frozenset(out)


# ------------------------------------------------------------------------------------- weights
def split_heads(layout: Layout, tensors: list[torch.Tensor], counts: HeadCounts) -> tuple[torch.Tensor, torch.Tensor]:
    """``wq`` ``[heads, head_dim, hidden]`` and ``wk`` ``[groups, head_dim, hidden]`` of one layer."""
    h, g, d = counts.num_heads, counts.num_groups, counts.head_dim
    if layout == "megatron_qkv":
        return split_qk(tensors[0], h, g, d)
    if layout == "separate":
        return tensors[0].reshape(h, d, -1), tensors[1].reshape(g, d, -1)
    w = tensors[0].t() if layout == "gpt2_c_attn" else tensors[0]  # Conv1D stores [in, out]
    return w[: h * d].reshape(h, d, -1), w[h * d : h * d + g * d].reshape(g, d, -1)


def _gamma(stored: torch.Tensor, kind: NormKind) -> torch.Tensor:
    """The effective gamma, as the live ``GammaReader`` reads it: float64 + 1 when zero-centred
    (the 1 added exactly), else the stored tensor."""
    return stored.to(torch.float64) + 1.0 if kind.zero_centered_gamma else stored


def _qk_norm(stored: Optional[torch.Tensor], kind: Optional[NormKind], head_dim: int) -> Optional[NormFold]:
    """A QK-norm's fold: gamma ``[head_dim]``, or ``[heads, head_dim]`` for a whole-projection norm."""
    if stored is None or kind is None:
        return None
    gamma = _gamma(stored, kind)
    if gamma.numel() != head_dim:
        gamma = gamma.reshape(-1, head_dim)
    return NormFold(gamma=gamma, centres=kind.centres)


def build_layer(attn: AttentionKeys, tensors: Mapping[str, torch.Tensor], counts: HeadCounts,
                router: Optional[torch.Tensor], where: str) -> LayerWeights:
    """The layer's :class:`LayerWeights` from its whole (TP-merged) tensors, ``tensors[role]``.

    Raises:
        ScanInputError: a tensor that is not stored as a 16-, 32- or 64-bit float (FP8 weights
            come with block scales the scan does not apply).
    """
    for role, key in zip(attn.roles, attn.keys):
        dtype = tensors[role].dtype
        if not dtype.is_floating_point or tensors[role].element_size() < 2:
            raise ScanInputError(f"{where}: {key!r} is stored as {dtype}; the scan reads float16, bfloat16, float32 "
                                 "or float64 weights (dequantise FP8 checkpoints first).")
    if attn.layout == "mla":
        return LayerWeights(layer=attn.layer, mla=_mla_heads(tensors, counts), router=router)
    qk = [tensors[r] for r in attn.roles if r not in _NORM_ROLES]
    wq, wk = split_heads(attn.layout, qk, counts)
    return LayerWeights(layer=attn.layer, wq=wq, wk=wk, router=router,
                        q_norm=_qk_norm(tensors.get("q_norm"), counts.norm, counts.head_dim),
                        k_norm=_qk_norm(tensors.get("k_norm"), counts.norm, counts.head_dim))


def _mla_heads(tensors: Mapping[str, torch.Tensor], counts: HeadCounts) -> MLAHeads:
    """The layer as the live adapter reads it (``adapters/megatron_core/mla_sites.py``): whole down
    projections, effective latent gammas, and only the key rows of the key/value up projection."""
    dims = counts.mla
    assert dims is not None
    n_h, d_nope = counts.num_heads, dims.qk_head_dim
    kind = counts.norm or NormKind()
    q_down, kv_down = tensors.get("q_down"), tensors.get("kv_down")
    if "qkv_down" in tensors:
        fused, r_q = tensors["qkv_down"], dims.q_lora_rank
        q_down, kv_down = fused[:r_q], fused[r_q:]
    assert kv_down is not None
    kv_up = tensors["kv_up"].reshape(n_h, d_nope + dims.v_head_dim, dims.kv_lora_rank)[:, :d_nope]
    kv_norm = tensors.get("kv_norm")
    kv_gamma = None if kv_norm is None else _gamma(kv_norm, kind)
    kv_keys = kv_up.reshape(n_h * d_nope, dims.kv_lora_rank)
    if "q_proj" in tensors:
        weights = MLAWeights(q_proj=tensors["q_proj"], kv_down=kv_down, kv_up=kv_keys, kv_norm=kv_gamma)
    else:
        q_norm = tensors.get("q_norm")
        q_gamma = None if q_norm is None else _gamma(q_norm, kind)
        weights = MLAWeights(q_down=q_down, q_up=tensors["q_up"], q_norm=q_gamma, kv_down=kv_down, kv_up=kv_keys,
                             kv_norm=kv_gamma)
    return MLAHeads(weights=weights, d_nope=d_nope, d_rope=dims.qk_pos_emb_head_dim, num_heads=n_h)
