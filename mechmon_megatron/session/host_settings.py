"""Host settings that change what a training forward means for the monitors.

Both read megatron-core's names (``TransformerConfig`` fields, which are also the ``dest`` of
Megatron-LM's flags), from any object that has them, so one rule serves the parsed flags and
the model's config; no host framework is imported.

* Activation recompute (``--recompute-granularity full``, or ``selective`` with ``moe`` in
  ``--recompute-modules``) runs the MoE layer's forward, router included, a second time inside
  the backward pass. :func:`in_backward` tells the capture hooks which pass they are in, so a
  check step's tokens are counted once, in the first forward, whatever the checkpoint flavour:
  reentrant checkpoints (megatron-core's ``tensor_parallel.checkpoint``, DeepSpeed's) run the
  first forward without grad and recompute with grad inside the backward; non-reentrant ones
  (``torch.utils.checkpoint(use_reentrant=False)``) run both with grad; only the recompute runs
  inside the autograd engine.
* A CUDA-graphed router (``--cuda-graph-impl local|transformer_engine``, or the deprecated
  ``--enable-cuda-graph`` / ``--external-cuda-graph``, with a scope that holds the router) is
  replayed without running Python: the capture wrapper runs while the graph is recorded and
  never again, so the router monitors would report nothing (or the warm-up's tokens).
  :func:`graphed_router` names the setting; the session refuses it at start-up.
"""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["ROUTER_GRAPH_SCOPES", "graphed_router", "in_backward"]

ROUTER_GRAPH_SCOPES = frozenset({"full", "full_iteration", "moe", "moe_router"})
"""``--cuda-graph-scope`` values whose graphs hold the MoE router (an empty scope is the whole layer)."""


def in_backward() -> bool:
    """True while the autograd engine runs a backward pass on this thread (where activation
    recompute re-runs forwards); False in the training forward. No device sync."""
    import torch  # here, not at module level: the flag parsing (and the patch tool) must not need torch

    return torch._C._current_graph_task_id() != -1


def _scope_names(scope: Any) -> list[str]:
    if scope is None:
        return []
    if isinstance(scope, str):
        return [s.strip() for s in scope.split(",") if s.strip()]
    if isinstance(scope, (list, tuple)):
        return [str(getattr(s, "name", s)) for s in scope]
    return [str(getattr(scope, "name", scope))]


def graphed_router(settings: Any) -> Optional[str]:
    """The flags that put the MoE router inside a CUDA graph, as the user wrote them; None if none.

    ``settings``: a Megatron-style namespace or a ``TransformerConfig`` (absent fields: off).
    """
    impl = getattr(settings, "cuda_graph_impl", None) or "none"
    if getattr(settings, "enable_cuda_graph", False):
        flag = "--enable-cuda-graph"
    elif getattr(settings, "external_cuda_graph", False):
        flag = "--external-cuda-graph"
    elif impl != "none":
        flag = f"--cuda-graph-impl {impl}"
    else:
        return None
    scopes = _scope_names(getattr(settings, "cuda_graph_scope", None))
    if scopes and not ROUTER_GRAPH_SCOPES & set(scopes):
        return None  # e.g. attention only: the router runs eagerly
    return f"{flag} (--cuda-graph-scope {','.join(scopes) or 'full'})"
