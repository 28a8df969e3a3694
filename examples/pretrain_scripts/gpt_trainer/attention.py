"""Registry of core-attention backends for ``--attention-backend`` (only ``local`` for now).

A backend is a zero-argument factory returning the module class (or ``ModuleSpec``) to plug in as
``self_attention.submodules.core_attention`` of the layer spec; ``None`` keeps megatron-core's
default ``DotProductAttention`` of the local spec. Another backend (e.g. one that records
attention statistics) registers itself before the parser is built::

    register_attention_backend("flash", lambda: MyFlashCoreAttention)
"""

from __future__ import annotations

from typing import Any, Callable, Optional

ATTENTION_BACKENDS: dict[str, Optional[Callable[[], Any]]] = {"local": None}


def register_attention_backend(name: str, factory: Callable[[], Any]) -> None:
    ATTENTION_BACKENDS[name] = factory
