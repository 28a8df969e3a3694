"""Apply one remedy (a policy ``Edit``) and the rollback selection to the host's flags."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from mechmon_megatron.supervise.command import flag_values, host_flag_names, remove_flag, set_flag
from mechmon_megatron.supervise.host import HostFlags
from mechmon_megatron.supervise.policy import SKIP_WINDOW, Edit

SCHEDULE_OVERRIDE = "--override-opt_param-scheduler"
"""Megatron-LM's switch (the example trainer and the DeepSpeed example have the same): on a load,
the LR / weight-decay schedule comes from the flags, not from the checkpoint. Without it a
checkpoint's scheduler state wins and an LR remedy does nothing after a rollback."""
USE_CHECKPOINT_SCHEDULE = "--use-checkpoint-opt_param-scheduler"
"""Megatron-LM's opposite switch; the two together are refused by its scheduler."""


def is_schedule_flag(flag: str) -> bool:
    """A flag the host's LR / weight-decay scheduler reads (and a checkpoint's scheduler overrides):
    ``--lr*``, ``--min-lr``, ``--*weight-decay*``, ``--decoupled-*lr``."""
    return (flag.startswith("--lr") or flag == "--min-lr" or "weight-decay" in flag
            or (flag.startswith("--decoupled-") and flag.endswith("lr")))


@dataclass
class Applied:
    """The host flags after the edit, and what changed (``--flag value`` strings)."""

    args: list[str]
    removed: list[str] = field(default_factory=list)
    added: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _show(args: Sequence[str], flag: str) -> str:
    values = flag_values(args, flag)
    return " ".join([flag, *(values or [])])


def apply_edit(args: Sequence[str], edit: Edit, skip_window: Sequence[int] = ()) -> Applied:
    """``args`` (the host part of the command) with ``edit`` applied."""
    out = Applied(args=list(args))

    def put(flag: str, values: Sequence[str]) -> None:
        if flag_values(out.args, flag) is not None:
            if flag_values(out.args, flag) == list(values):
                out.notes.append(f"{_show(out.args, flag)} already in effect")
                return
            out.removed.append(_show(out.args, flag))
        out.args = set_flag(out.args, flag, values)
        out.added.append(" ".join([flag, *values]))

    for flag in edit.remove:
        if flag_values(out.args, flag) is not None:
            out.removed.append(_show(out.args, flag))
            out.args = remove_flag(out.args, flag)
    for flag, values in edit.set.items():
        expanded = [str(i) for i in skip_window] if list(values) == [SKIP_WINDOW] else list(values)
        if not expanded and list(values) == [SKIP_WINDOW]:
            out.notes.append(f"{flag}: empty skip window, not set")
            continue
        put(flag, expanded)
    for flag, factor in edit.scale.items():
        current = flag_values(out.args, flag)
        if not current:
            out.notes.append(f"{flag} is not in the command: cannot scale the host's default, left unchanged")
            continue
        put(flag, [repr(float(current[0]) * factor)])
    for flag, floor in edit.at_least.items():
        current = flag_values(out.args, flag)
        if current and float(current[0]) >= floor:
            out.notes.append(f"{flag} {current[0]} is already >= {floor:g}")
            continue
        put(flag, [repr(floor)])
    return out


def select_checkpoint_flags(args: Sequence[str], save: str, select_flag: str | None, value: str) -> list[str]:
    """Point ``--load`` at ``save`` and, when the host has one, name the checkpoint with ``select_flag``."""
    args = set_flag(args, "--load", [save])
    if select_flag:
        args = set_flag(args, select_flag, [value])
    return args


def diff_flags(before: Sequence[str], after: Sequence[str]) -> tuple[list[str], list[str]]:
    """(removed, added) as ``--flag values`` strings, between two host argument lists."""
    removed, added = [], []
    for flag in dict.fromkeys(host_flag_names(before) + host_flag_names(after)):
        old, new = flag_values(before, flag), flag_values(after, flag)
        if old != new:
            if old is not None:
                removed.append(" ".join([flag, *old]))
            if new is not None:
                added.append(" ".join([flag, *new]))
    return removed, added


def let_flags_set_schedule(args: Sequence[str], changes: Sequence[str],
                           host: HostFlags) -> tuple[list[str], Optional[str]]:
    """``args`` with :data:`SCHEDULE_OVERRIDE` when ``changes`` (``--flag values`` strings) touch the
    schedule, so that the remedy takes effect wherever the rollback lands; (args, note)."""
    flags = [c.split(" ", 1)[0] for c in changes]
    touched = sorted({f for f in flags if is_schedule_flag(f)})
    if not touched:
        return list(args), None
    if not host.has(SCHEDULE_OVERRIDE):
        return list(args), (f"the host has no {SCHEDULE_OVERRIDE}: after a load, its checkpoint's LR schedule may "
                            f"win over {', '.join(touched)}")
    out = list(args)
    if flag_values(out, USE_CHECKPOINT_SCHEDULE) is not None:
        out = remove_flag(out, USE_CHECKPOINT_SCHEDULE)
    if flag_values(out, SCHEDULE_OVERRIDE) is not None:
        return out, None
    return (set_flag(out, SCHEDULE_OVERRIDE, []),
            f"{SCHEDULE_OVERRIDE} added: {', '.join(touched)} win over the checkpoint's LR schedule")
