"""Let ``--override-opt_param-scheduler`` override the LR bounds saved in the optimizer state too.

megatron-core keeps each optimizer param group's ``max_lr`` / ``min_lr`` in the group, and the
scheduler reads them there before its own (``OptimizerParamScheduler.get_lr``). A load restores
the checkpoint's groups, so Megatron-LM's ``--override-opt_param-scheduler`` alone does not move
the LR on core_v0.16-0.19; and from core_v0.19 on the groups are matched to the checkpoint's by
an identifier that includes ``max_lr`` / ``min_lr``, so a resume with another ``--lr`` fails
("Could not find parameter group with key ..."). mechmon-supervise's LR remedies relaunch with a
new ``--lr`` and this switch; this module rewrites the loaded groups' bounds to the flags' before
the optimizer state is applied, as Megatron-LM main does after it. Nothing changes without the
switch.
"""

from __future__ import annotations

from typing import Any, Optional

LR_KEYS = ("max_lr", "min_lr")


def flag_bounds(args: Any, group: dict) -> tuple[Optional[float], Optional[float]]:
    """The (max_lr, min_lr) the flags give ``group``: the decoupled LR for its decoupled group."""
    if group.get("is_decoupled_lr", False):
        return getattr(args, "decoupled_lr", None), getattr(args, "decoupled_min_lr", None)
    return getattr(args, "lr", None), getattr(args, "min_lr", None)


def retarget_param_groups(state: Any, args: Any) -> int:
    """Set ``max_lr`` / ``min_lr`` of every optimizer param group found in ``state`` (a loaded
    state dict, any nesting of dicts and lists: chained, distributed or plain optimizers) to the
    flags' values; returns how many groups changed."""
    changed = 0
    if isinstance(state, dict):
        groups = state.get("param_groups")
        if isinstance(groups, list):
            for group in groups:
                if isinstance(group, dict) and any(k in group for k in LR_KEYS):
                    changed += _retarget(group, args)
        for key, value in state.items():
            if key != "param_groups":
                changed += retarget_param_groups(value, args)
    elif isinstance(state, (list, tuple)):
        for value in state:
            changed += retarget_param_groups(value, args)
    return changed


def _retarget(group: dict, args: Any) -> int:
    before = tuple(group.get(k) for k in LR_KEYS)
    for key, value in zip(LR_KEYS, flag_bounds(args, group)):
        if value is not None and key in group:
            group[key] = value
    return int(tuple(group.get(k) for k in LR_KEYS) != before)
