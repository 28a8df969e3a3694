"""The recovery policy: which remedies (host flags) answer which alarm family, in what order.

A JSON file (docs/RECOVERY.md)::

    {"version": 1,
     "families": {"attn_delta2": "attention_precision", "router_entropy": "router", "nonfinite": null},
     "remedies": {"attention_precision": [
         {"name": "fp32-o", "why": "...",
          "alternatives": [{"set": {"--fa-fp32-o": true}},
                           {"set": {"--attention-backend": "unfused"}, "remove": ["--fp8-dot-product-attention"]}]}]}}

``families`` maps an alert family to a remedy list (``null``: stop, no remedy). The shipped policy
(``default``) takes the detector families' entries from the family table (``FamilySpec.remedy``,
``detect/families.py``) and lists only the other alert families itself. Each remedy has
alternatives, one per host; the first whose flags (and fixed choices) the host's parser has is
used. An edit can ``set`` flags (``true``: a bare switch; a list: several values; the string
``"{skip_window}"``: the iterations from the rollback checkpoint to the alarm), ``remove`` flags,
``scale`` a numeric flag already in the command, or raise one to ``at_least`` a value.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Optional, Union

from mechmon_megatron.detect.families import FAMILIES
from mechmon_megatron.session.alert import ALERT_FAMILIES
from mechmon_megatron.supervise.host import HostFlags

DEFAULT_POLICY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "default_policy.json")
SKIP_WINDOW = "{skip_window}"
POLICY_VERSION = 1


class PolicyError(ValueError):
    """The policy file is malformed or names a flag the host does not have."""


@dataclass(frozen=True)
class Edit:
    """One host's flag changes for a remedy."""

    set: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """flag -> values (empty: a bare switch)."""
    remove: tuple[str, ...] = ()
    scale: dict[str, float] = field(default_factory=dict)
    """flag -> factor for a number already in the command (e.g. ``--lr``: 0.5)."""
    at_least: dict[str, float] = field(default_factory=dict)
    """flag -> the smallest value it may have (raised if lower or absent)."""
    unless: dict[str, str] = field(default_factory=dict)
    """flag -> why: the alternative is not used for a command that has that flag (e.g. megatron-core's
    local attention cannot run ``--multi-latent-attention``)."""

    def flags(self) -> list[str]:
        return [*self.set, *self.remove, *self.scale, *self.at_least]


@dataclass(frozen=True)
class Remedy:
    name: str
    why: str
    alternatives: tuple[Edit, ...]


@dataclass(frozen=True)
class Policy:
    source: str
    """The file it was read from (``default``: the shipped one)."""
    is_default: bool
    families: dict[str, Optional[str]]
    """alert family -> remedy list name, or None (stop)."""
    remedies: dict[str, tuple[Remedy, ...]]


@dataclass(frozen=True)
class ChosenRemedy:
    """A remedy with the alternative this host can run."""

    remedy: Remedy
    edit: Edit


@dataclass(frozen=True)
class ResolvedPolicy:
    policy: Policy
    lists: dict[str, tuple[ChosenRemedy, ...]]
    notices: tuple[str, ...] = ()
    """Default-policy remedies skipped because the host has none of their alternatives."""

    def remedy_list(self, family: str) -> tuple[Optional[str], tuple[ChosenRemedy, ...]]:
        """(list name, remedies) for ``family``; (None, ()) when the policy stops on it."""
        name = self.policy.families.get(family)
        return (name, self.lists.get(name, ())) if name else (None, ())


def _values(flag: str, value: Union[bool, str, int, float, list], where: str) -> tuple[str, ...]:
    if value is True:
        return ()
    if isinstance(value, bool) or value is None:
        raise PolicyError(f"{where}: {flag} must be true, a value or a list of values (use remove to drop a flag)")
    if isinstance(value, list):
        return tuple(str(v) for v in value)
    return (str(value),)


def _flag(name: object, where: str) -> str:
    if not isinstance(name, str) or not name.startswith("--"):
        raise PolicyError(f"{where}: {name!r} is not a --flag")
    return name


def _number(flag: str, value: object, where: str, key: str, positive: bool) -> float:
    """A finite number (``positive``: > 0), else ``PolicyError`` naming the flag: a NaN or a negative
    factor would reach the host only at the relaunch (e.g. "Invalid learning rate: nan")."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise PolicyError(f"{where}: {key}.{flag} must be a number, got {value!r}")
    try:
        number = float(value)
    except ValueError:
        raise PolicyError(f"{where}: {key}.{flag} must be a number, got {value!r}") from None
    if not math.isfinite(number) or (positive and number <= 0):
        need = "a finite number > 0" if positive else "a finite number"
        raise PolicyError(f"{where}: {key}.{flag} must be {need}, got {value!r}")
    return number


def _edit(body: dict, where: str) -> Edit:
    unknown = set(body) - {"set", "remove", "scale", "at_least", "unless", "host"}
    if unknown:
        raise PolicyError(f"{where}: unknown keys {sorted(unknown)} (set, remove, scale, at_least, unless, host)")
    unless = body.get("unless") or {}
    if not isinstance(unless, dict) or not all(isinstance(v, str) for v in unless.values()):
        raise PolicyError(f"{where}: unless must map flags to the reason, e.g. "
                          '{"--multi-latent-attention": "why"}')
    try:
        return Edit(
            set={_flag(k, where): _values(k, v, where) for k, v in (body.get("set") or {}).items()},
            remove=tuple(_flag(k, where) for k in body.get("remove") or ()),
            scale={_flag(k, where): _number(k, v, where, "scale", positive=True)
                   for k, v in (body.get("scale") or {}).items()},
            at_least={_flag(k, where): _number(k, v, where, "at_least", positive=False)
                      for k, v in (body.get("at_least") or {}).items()},
            unless={_flag(k, where): v for k, v in unless.items()},
        )
    except (TypeError, ValueError, AttributeError) as exc:
        if isinstance(exc, PolicyError):
            raise
        raise PolicyError(f"{where}: {exc}") from None


def shipped_families() -> dict[str, Optional[str]]:
    """The shipped policy's remedy list for each detector family that has one (``FamilySpec.remedy``);
    a family without one is left out, so the supervisor says the policy has no remedy for it."""
    return {spec.name: spec.remedy for spec in FAMILIES if spec.remedy is not None}


def load_policy(spec: str) -> Policy:
    """``spec``: a JSON file, or ``default`` for the shipped policy."""
    is_default = spec == "default"
    path = DEFAULT_POLICY if is_default else spec
    try:
        with open(path, encoding="utf-8") as f:
            body = json.load(f)
    except (OSError, ValueError) as exc:
        raise PolicyError(f"{path}: cannot read the policy ({exc})") from None
    if not isinstance(body, dict) or body.get("version") != POLICY_VERSION:
        raise PolicyError(f"{path}: needs \"version\": {POLICY_VERSION}")
    families, lists = body.get("families"), body.get("remedies")
    if not isinstance(families, dict) or not isinstance(lists, dict):
        raise PolicyError(f"{path}: needs \"families\" and \"remedies\" objects")
    if is_default:
        families = {**shipped_families(), **families}
    remedies: dict[str, tuple[Remedy, ...]] = {}
    for list_name, items in lists.items():
        if not isinstance(items, list):
            raise PolicyError(f"{path}: remedies.{list_name} must be a list")
        parsed = []
        for k, item in enumerate(items):
            where = f"{path}: remedies.{list_name}[{k}]"
            if not isinstance(item, dict) or not item.get("alternatives"):
                raise PolicyError(f"{where} needs a name and a non-empty alternatives list")
            parsed.append(Remedy(name=str(item.get("name", f"{list_name}-{k}")), why=str(item.get("why", "")),
                                 alternatives=tuple(_edit(a, f"{where}.alternatives") for a in item["alternatives"])))
        remedies[list_name] = tuple(parsed)
    for family, list_name in families.items():
        if family not in ALERT_FAMILIES:
            raise PolicyError(f"{path}: families names {family!r}, which no alert carries (the alert families: "
                              f"{', '.join(ALERT_FAMILIES)})")
        if list_name is not None and list_name not in remedies:
            raise PolicyError(f"{path}: families.{family} names {list_name!r}, which is not in remedies")
    return Policy(source="default" if is_default else path, is_default=is_default, families=dict(families),
                  remedies=remedies)


def _excluded(edit: Edit, command_flags: Collection[str]) -> Optional[str]:
    """Why ``edit`` is not for this command (a flag of its ``unless``), or None."""
    return next((f"{flag}: {why}" for flag, why in edit.unless.items() if flag in command_flags), None)


def _usable(edit: Edit, host: HostFlags) -> Optional[str]:
    """The first flag (or value) of ``edit`` the host lacks, None when it has them all."""
    for flag in edit.flags():
        if not host.has(flag):
            return flag
    for flag, values in edit.set.items():
        for value in values:
            if value != SKIP_WINDOW and not host.accepts(flag, value):
                return f"{flag} {value}"
    return None


def resolve_policy(policy: Policy, host: HostFlags, path_for_errors: Optional[str] = None,
                   command_flags: Collection[str] = ()) -> ResolvedPolicy:
    """Pick each remedy's alternative for this host and command (``command_flags``: the flags the
    training command has). A user policy naming a flag the host lacks raises ``PolicyError`` naming
    the flag; the default policy skips such a remedy with a notice. An alternative whose ``unless``
    flag the command has is passed over (a remedy left without one is skipped with a notice)."""
    where = path_for_errors or policy.source
    lists: dict[str, tuple[ChosenRemedy, ...]] = {}
    notices: list[str] = []
    for name, remedies in policy.remedies.items():
        chosen = []
        for remedy in remedies:
            missing = [m for m in (_usable(e, host) for e in remedy.alternatives) if m is not None]
            usable = [e for e in remedy.alternatives if _usable(e, host) is None]
            excluded = [why for why in (_excluded(e, command_flags) for e in usable) if why is not None]
            usable = [e for e in usable if _excluded(e, command_flags) is None]
            if usable:
                chosen.append(ChosenRemedy(remedy, usable[0]))
            elif excluded:
                notices.append(f"remedy {name}/{remedy.name} skipped for this command ({excluded[0]})")
            elif policy.is_default:
                notices.append(f"default policy: remedy {name}/{remedy.name} skipped, the host has no {missing[0]}")
            else:
                raise PolicyError(f"policy {where}: remedy {name}/{remedy.name} names {missing[0]}, "
                                  "which the host's parser does not have")
        lists[name] = tuple(chosen)
    return ResolvedPolicy(policy=policy, lists=lists, notices=tuple(notices))
