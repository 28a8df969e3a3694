"""Find attention Q/K weights in the layouts DeepSpeed users train, or in a user-described one.

Known layouts (tried in this order on every module, outermost match wins):

``megatron_qkv``
    Megatron-DeepSpeed ``ParallelAttention.query_key_value``: one fused ``[rows, hidden]`` weight,
    rows grouped per query group ``[q x r | k | v]`` (``r`` heads per group; plain MHA is r = 1,
    i.e. per-head interleaved ``[q_h | k_h | v_h]``).
``separate``
    Hugging Face style ``q_proj`` / ``k_proj`` (``nn.Linear``, ``[heads * head_dim, hidden]`` and
    ``[groups * head_dim, hidden]``).
``gpt2_c_attn``
    GPT-2 ``c_attn``: a ``Conv1D`` weight ``[hidden, 3 * hidden]`` (input-major), columns
    ``[q | k | v]``.
``stacked_qkv``
    ``torch.nn.MultiheadAttention.in_proj_weight``: ``[3 * hidden, hidden]``, rows ``[q | k | v]``.

Head counts come from the usual attribute names (``num_attention_heads_per_partition``,
``num_heads``, ``num_key_value_heads``, ``head_dim``, ... or the module's ``config``). A module
that looks like attention (class name contains "Attention") but matches none of these is skipped
with one notice line; describe it with ``"attention_mapping"`` in the ``"mechmon"`` section::

    "attention_mapping": [{"match": "blocks.*.attn", "layout": "separate",
                           "q": "wq.weight", "k": "wk.weight", "num_heads": 8, "num_kv_heads": 2}]

``match`` is an ``fnmatch`` pattern on the module name (as in ``model.named_modules()``); ``layout``
is one of the names above; ``qkv`` (fused layouts) or ``q``/``k`` (``separate``) are parameter
paths relative to the module; ``head_dim`` defaults to ``q rows / num_heads``; ``"skip": true``
silences a module. Optional ``q_norm`` / ``k_norm``: the path of a norm applied to the projected
queries / keys (its module, or its gamma parameter, e.g. ``"q_norm.weight"``).

QK-norms (``qk_norms.py``): a detected module's ``q_norm`` / ``k_norm`` (Qwen3, Gemma 3: per head;
OLMo 2: over the whole projection) are recorded and folded into the rows the monitors read; one
the monitors cannot fold leaves the layer monitored without it, with one start-up warning.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional, Sequence

import torch

from mechmon_megatron.adapters.deepspeed.qk_norms import NormNotFolded, QKNorm, find_qk_norm, read_gamma
from mechmon_megatron.session.log import mechmon_log
from mechmon_megatron.session.qkv_layout import split_qk

log = mechmon_log(__name__)

LAYOUTS = ("megatron_qkv", "separate", "gpt2_c_attn", "stacked_qkv")

# ``read_param(param) -> full fp32/bf16 tensor`` (ZeRO-aware, may be a collective).
ParamReader = Callable[[torch.nn.Parameter], torch.Tensor]


@dataclass
class FoundAttention:
    """One attention module and how to cut its Q/K rows out of its parameters."""

    name: str
    layout: str
    num_heads: int
    num_groups: int
    head_dim: int
    params: tuple  # the parameters read (one fused weight, or (q, k))
    q_norm: Optional[QKNorm] = None
    k_norm: Optional[QKNorm] = None
    unfolded: tuple[str, ...] = ()
    """The norms found after the Q/K projections and not folded, each ``path (Class): why``."""

    @property
    def norm_params(self) -> tuple:
        """The QK-norm weights read beside ``params`` (after them, in this order: q, then k)."""
        return tuple(n.weight for n in (self.q_norm, self.k_norm) if n is not None and n.weight is not None)

    def read_norms(self, read_param: ParamReader) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """The weights of ``q_norm`` and ``k_norm`` as read (``[head_dim]`` or ``[n * head_dim]``;
        None where there is no norm or no weight); every rank reads them in this order."""
        return read_gamma(self.q_norm, read_param), read_gamma(self.k_norm, read_param)

    def read(self, read_param: ParamReader) -> tuple[torch.Tensor, torch.Tensor]:
        """``wq`` ``[num_heads, head_dim, hidden]``, ``wk`` ``[num_groups, head_dim, hidden]``."""
        h, g, d = self.num_heads, self.num_groups, self.head_dim
        if self.layout == "megatron_qkv":
            return split_qk(read_param(self.params[0]), h, g, d)
        if self.layout == "separate":
            wq, wk = read_param(self.params[0]), read_param(self.params[1])
            return wq.reshape(h, d, -1), wk.reshape(g, d, -1)
        if self.layout == "gpt2_c_attn":
            w = read_param(self.params[0]).t()  # Conv1D stores [in, out]
        else:  # stacked_qkv
            w = read_param(self.params[0])
        return w[: h * d].reshape(h, d, -1), w[h * d : h * d + g * d].reshape(g, d, -1)


@dataclass(frozen=True)
class MappingEntry:
    """One user-described attention layout (an item of ``"attention_mapping"``)."""

    match: str
    layout: Optional[str] = None
    qkv: Optional[str] = None
    q: Optional[str] = None
    k: Optional[str] = None
    num_heads: Optional[int] = None
    num_kv_heads: Optional[int] = None
    head_dim: Optional[int] = None
    q_norm: Optional[str] = None
    k_norm: Optional[str] = None
    skip: bool = False


def parse_mapping(items: Any, where: str) -> tuple[MappingEntry, ...]:
    """Validate the ``attention_mapping`` list; errors name ``where[i].key``."""
    if isinstance(items, Sequence) and all(isinstance(i, MappingEntry) for i in items):
        return tuple(items)
    if not isinstance(items, list):
        raise ValueError(f"{where} must be a list of objects, got {type(items).__name__}")
    fields = set(MappingEntry.__dataclass_fields__)
    out = []
    for i, item in enumerate(items):
        at = f"{where}[{i}]"
        if not isinstance(item, dict):
            raise ValueError(f"{at} must be an object, got {item!r}")
        unknown = sorted(set(item) - fields)
        if unknown:
            raise ValueError(f"{at}: unknown key(s) {unknown}; known keys: {sorted(fields)}")
        if not isinstance(item.get("match"), str):
            raise ValueError(f"{at}.match must be a module-name pattern (string)")
        entry = MappingEntry(**item)
        if entry.skip:
            out.append(entry)
            continue
        if entry.layout not in LAYOUTS:
            raise ValueError(f"{at}.layout must be one of {list(LAYOUTS)}, got {entry.layout!r}")
        needed = ("q", "k") if entry.layout == "separate" else ("qkv",)
        for key in (*needed, "num_heads"):
            if getattr(entry, key) is None:
                raise ValueError(f"{at}.{key} is required for layout {entry.layout!r}")
        for key in ("q_norm", "k_norm"):
            value = getattr(entry, key)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{at}.{key} must be a module or parameter path (string), got {value!r}")
        for key in ("num_heads", "num_kv_heads", "head_dim"):
            value = getattr(entry, key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{at}.{key} must be a positive integer, got {value!r}")
        out.append(entry)
    return tuple(out)


# ---------------------------------------------------------------------------------- detection
def _attr(module: torch.nn.Module, *names: str) -> Optional[int]:
    """First integer attribute among ``names`` on the module or its ``config``."""
    for holder in (module, getattr(module, "config", None)):
        if holder is None:
            continue
        for name in names:
            value = getattr(holder, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def _heads(module: torch.nn.Module) -> Optional[int]:
    return _attr(module, "num_attention_heads_per_partition", "num_heads", "num_attention_heads", "n_head", "n_heads")


def _groups(module: torch.nn.Module, heads: int) -> int:
    return _attr(module, "num_key_value_heads_per_partition", "num_query_groups_per_partition", "num_key_value_heads",
                 "num_key_value_groups_total", "num_query_groups", "n_kv_heads", "num_kv_heads") or heads


def _head_dim(module: torch.nn.Module) -> Optional[int]:
    return _attr(module, "hidden_size_per_attention_head", "head_dim", "kv_channels")


def _weight(module: Optional[torch.nn.Module]) -> Optional[torch.nn.Parameter]:
    w = getattr(module, "weight", None) if module is not None else None
    return w if isinstance(w, torch.nn.Parameter) else None


def _param(module: torch.nn.Module, path: str) -> torch.nn.Parameter:
    try:
        return module.get_parameter(path)
    except AttributeError as exc:
        raise ValueError(f"attention_mapping: module has no parameter {path!r}") from exc


def _rows(param: torch.nn.Parameter) -> int:
    # ZeRO-3 partitions parameters in place: the original shape is kept in ds_shape.
    shape = getattr(param, "ds_shape", None) or param.shape
    return int(shape[0])


def _shape(param: torch.nn.Parameter) -> tuple:
    return tuple(getattr(param, "ds_shape", None) or param.shape)


def detect(name: str, module: torch.nn.Module) -> Optional[FoundAttention]:
    """The known layout of ``module`` with its ``q_norm`` / ``k_norm`` when it has them, or None."""
    found = _layout(name, module)
    return None if found is None else with_norms(found, module, "q_norm", "k_norm", required=False)


def _layout(name: str, module: torch.nn.Module) -> Optional[FoundAttention]:
    """The known Q/K layout of ``module``, or None."""
    qkv = getattr(module, "query_key_value", None)
    if _weight(qkv) is not None:
        heads, head_dim = _heads(module), _head_dim(module)
        if heads and head_dim:
            return FoundAttention(name, "megatron_qkv", heads, _groups(module, heads), head_dim, (qkv.weight,))
        return None
    q, k = _weight(getattr(module, "q_proj", None)), _weight(getattr(module, "k_proj", None))
    if q is not None and k is not None:
        heads = _heads(module)
        if heads and _rows(q) % heads == 0:
            head_dim = _head_dim(module) or _rows(q) // heads
            if _rows(q) != heads * head_dim:
                return None  # more than the queries in q_proj (Qwen3-Next's per-head output gate): unknown
            groups = _rows(k) // head_dim if _rows(k) % head_dim == 0 else _groups(module, heads)
            return FoundAttention(name, "separate", heads, groups, head_dim, (q, k))
        return None
    c_attn = _weight(getattr(module, "c_attn", None))
    if c_attn is not None and not getattr(module, "is_cross_attention", False):
        heads = _heads(module)
        hidden, out = _shape(c_attn)
        if heads and out == 3 * hidden and hidden % heads == 0:
            return FoundAttention(name, "gpt2_c_attn", heads, heads, hidden // heads, (c_attn,))
        return None
    if isinstance(module, torch.nn.MultiheadAttention) and module._qkv_same_embed_dim:
        heads = module.num_heads
        return FoundAttention(name, "stacked_qkv", heads, heads, module.head_dim, (module.in_proj_weight,))
    return None


def from_mapping(name: str, module: torch.nn.Module, entry: MappingEntry) -> FoundAttention:
    heads = int(entry.num_heads)
    groups = int(entry.num_kv_heads or heads)
    if entry.layout == "separate":
        params = (_param(module, entry.q), _param(module, entry.k))
        rows = _rows(params[0])
    else:
        params = (_param(module, entry.qkv),)
        rows = _shape(params[0])[1] // 3 if entry.layout == "gpt2_c_attn" else _rows(params[0])
        if entry.layout == "megatron_qkv":
            rows = rows * heads // (heads + 2 * groups)
        elif entry.layout == "stacked_qkv":
            rows = rows * heads // (heads + 2 * groups)
    head_dim = int(entry.head_dim or rows // heads)
    found = FoundAttention(name, entry.layout, heads, groups, head_dim, params)
    return with_norms(found, module, entry.q_norm, entry.k_norm, required=True)


def with_norms(found: FoundAttention, module: torch.nn.Module, q_path: Optional[str], k_path: Optional[str],
               required: bool) -> FoundAttention:
    """``found`` with the norms at ``q_path`` / ``k_path`` (relative to ``module``) to fold.

    Both or neither: when one cannot be folded, neither is (a half-folded layer would be
    monitored on a matrix the logits never see either), and ``unfolded`` says why.
    ``required``: the paths come from ``attention_mapping``, a missing one is an error."""
    norms: list[Optional[QKNorm]] = []
    unfolded: list[str] = []
    for path, count in ((q_path, found.num_heads), (k_path, found.num_groups)):
        norm = None
        if path is not None:
            try:
                norm = find_qk_norm(module, path, count, found.head_dim, required=required)
            except NormNotFolded as exc:
                unfolded.append(str(exc))
        norms.append(norm)
    if unfolded:
        return replace(found, unfolded=tuple(unfolded))
    return replace(found, q_norm=norms[0], k_norm=norms[1])


def find_attention(
    model: torch.nn.Module, mapping: Sequence[MappingEntry] = (), notice: bool = True
) -> list[FoundAttention]:
    """Attention modules of ``model`` in module order; unknown attention-like modules get one notice."""
    found: list[FoundAttention] = []
    claimed: list[str] = []  # names of matched / skipped / noticed modules (their children are theirs)
    unknown: list[str] = []
    modules = list(model.named_modules())
    for name, module in modules:
        if any(_inside(name, c) for c in claimed):
            continue
        entry = next((e for e in mapping if fnmatch.fnmatchcase(name, e.match)), None)
        if entry is not None:
            claimed.append(name)
            if not entry.skip:
                found.append(from_mapping(name, module, entry))
            continue
        hit = detect(name, module)
        if hit is not None:
            found.append(hit)
            claimed.append(name)
    for name, module in modules:
        if "attention" not in type(module).__name__.lower() or any(
            _inside(name, c) or _inside(c, name) for c in claimed
        ):
            continue
        if any(_inside(name, u) for u in unknown):
            continue
        unknown.append(name)
    if notice:
        _warn_unfolded(found)
    if unknown and notice:
        log.warning(
            "%d attention module(s) with an unknown Q/K layout skipped (%s); describe them with "
            "\"attention_mapping\" in the mechmon config (docs/DEEPSPEED.md)",
            len(unknown),
            ", ".join(unknown[:4]) + (", ..." if len(unknown) > 4 else ""),
        )
    return found


def _warn_unfolded(found: Sequence[FoundAttention]) -> None:
    """One start-up warning for the layers whose QK-norm is not folded (they stay monitored)."""
    lines = [f"{f.name}.{reason}" for f in found for reason in f.unfolded]
    if lines:
        log.warning(
            "%d attention layer(s) monitored without folding their QK-norm (Delta2 then reads the "
            "projection rows without the norm's scale): %s",
            sum(1 for f in found if f.unfolded), "; ".join(lines[:4]) + ("; ..." if len(lines) > 4 else ""),
        )


def _inside(name: str, parent: str) -> bool:
    return parent == "" or name == parent or name.startswith(parent + ".")


def layer_numbers(names: Sequence[str]) -> list[int]:
    """Global 1-based layer numbers: the first integer path component + 1 ("blocks.3.attn" -> 4);
    module order (1, 2, ...) when a name has none or two names share a number."""
    numbers = []
    for name in names:
        index = next((int(part) for part in name.split(".") if re.fullmatch(r"\d+", part)), None)
        numbers.append(None if index is None else index + 1)
    if None in numbers or len(set(numbers)) != len(numbers):
        return list(range(1, len(names) + 1))
    return numbers
