"""Router-logit capture for DeepSpeed's ``deepspeed.moe.sharded_moe.TopKGate``.

``TopKGate.forward(input, used_token, ...)`` applies its ``wg`` weight functionally
(``F.linear(input.float(), wg.weight.float())``), so hooks on ``wg`` never fire and the full
softmax is never materialised. A forward pre-hook on the gate recomputes the logits
``[num_tokens, num_experts]`` from the gate input -- only while capture is armed (training
forwards of a check step) and reduces them at once to the router summary (``RouterSite.capture``);
on every other forward the hook costs one boolean test.

Notes: with ``noisy_gate_policy="Jitter"`` the gate sees a jittered input; we recompute from the
clean input (the routing distribution without the training noise). Tokens masked out by
``used_token`` are left out, as the gate leaves them out of its load: as a mask inside the
summary (``summarize_routing(token_mask=...)``), never by boolean indexing, whose output size
would have to be read back to the host in the middle of the forward.
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch

from mechmon_megatron.session.host import RouterSite
from mechmon_megatron.session.host_settings import in_backward


def find_gates(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """``(name, TopKGate)`` pairs in module order (empty when DeepSpeed's MoE is absent)."""
    try:
        from deepspeed.moe.sharded_moe import TopKGate
    except ImportError:  # deepspeed missing: nothing to find
        return iter(())
    return ((name, m) for name, m in model.named_modules() if isinstance(m, TopKGate))


def gate_logits(gate: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The gate's full logits ``[num_tokens, num_experts]`` (fp32) for its input ``[..., hidden]``."""
    with torch.no_grad():
        flat = tokens.detach().reshape(-1, tokens.shape[-1]).float()
        return torch.nn.functional.linear(flat, gate.wg.weight.detach().float())


def install_gate_capture(gate: torch.nn.Module, site: RouterSite, armed: Callable[[], bool]):
    """Register the capture pre-hook on ``gate``; returns the hook handle (``.remove()`` detaches)."""
    if getattr(gate, "_mechmon_capture", False):
        raise RuntimeError(f"gate {site.name} already has a mechmon capture hook (attach once per engine)")

    def pre_hook(module: torch.nn.Module, args: tuple) -> None:
        # in_backward: an activation-checkpoint recompute of the gate's forward counts no tokens again.
        if not (module.training and armed()) or not args or in_backward():
            return None
        used_token = args[1] if len(args) > 1 and isinstance(args[1], torch.Tensor) else None
        try:
            logits = gate_logits(module, args[0])
        except Exception as exc:  # noqa: BLE001 -- never kill the training forward; the check counts it
            site.capture_error = site.capture_error or exc
            return None
        # Reduced at once to a small summary (no logits kept); used_token masks, it never indexes.
        site.capture(logits, token_mask=None if used_token is None else used_token.detach())
        return None

    handle = gate.register_forward_pre_hook(pre_hook)
    gate._mechmon_capture = True
    return handle
