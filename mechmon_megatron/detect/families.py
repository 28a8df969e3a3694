"""The detector's families, declared once: every room of the package reads this table.

A family is one kind of detector input -- a scalar the monitors write per layer (or per query
head of a layer) -- with the direction a fault moves it in. Who reads what:

* the core detector (``pooled_cusum``, ``null_model``): the names and the directions;
* the session: the scalars (to attribute recorded streams offline, ``session/detector_inputs.py``),
  the monitor and switch (which families a configuration feeds, ``session/detector_setup.py``,
  ``session/startup.py``) and the lines users see at start-up (``label``, ``no_signal``);
* ``mechmon-scan``: which families a checkpoint series can feed (``from_checkpoints``);
* ``mechmon-supervise``: the remedy list its shipped policy answers each family with (``remedy``).

It lives in the core because the core is the one layer every other room may import, and it
imports the standard library only (plus ``robust_trend``'s ``Direction``, itself standard
library only), so that the supervisor, which must run without torch, can read it too
(``tests/test_architecture.py``). The order of :data:`FAMILIES` is the order tables, replays and
start-up lines list the families in.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal, Optional

from mechmon_megatron.detect.robust_trend import Direction

__all__ = [
    "ATTN_DELTA2",
    "ATTN_DELTA2_SHORT",
    "ATTN_DW",
    "FAMILIES",
    "FAMILY_BY_NAME",
    "FAMILY_NAMES",
    "ROUTER_ENTROPY",
    "ROUTER_WEIGHTS",
    "FamilyName",
    "FamilySpec",
    "Monitor",
    "Window",
    "family_spec",
]

FamilyName = Literal["attn_delta2", "attn_dw", "router_entropy", "router_weights", "attn_delta2_short"]
"""The names of :data:`FAMILIES`, as a type (``tests/detect/test_families.py`` keeps the two equal)."""

Monitor = Literal["attn", "router"]
"""A ``--mechmon-monitors`` entry (``session.config.MONITOR_FAMILIES``)."""

Window = Literal["check", "interval", "delta"]
"""What a family's first value after a start waits for: ``check``, the first check; ``interval``, a
snapshot one check interval old; ``delta``, a snapshot ``--mechmon-delta`` steps old."""


@dataclass(frozen=True, kw_only=True, slots=True)
class FamilySpec:
    """One detector family: what it reads, which way its fault moves it, what switches it on,
    what users are told about it, and what the shipped recovery policy answers its alarm with."""

    name: FamilyName
    """Its name in streams, thresholds, calibration files, alerts, policies and ``mechmon/detect/<name>/*``."""
    direction: Direction
    """Which way a fault moves its values: ``drop`` (an entropy collapses) or ``rise`` (router rows align)."""
    monitor: Monitor
    """The ``--mechmon-monitors`` entry that feeds it; its scalars are ``mechmon/<monitor>/...``."""
    scalars: tuple[str, ...]
    """The scalar(s) it reads, ``mechmon/<monitor>/<scalar>/layer_L`` (``session/names.py``)."""
    per_head: bool = False
    """True: one stream per query head, ``.../layer_L/head_H`` (member ``head_H``); False: one stream
    per scalar and layer (member: the scalar's name)."""
    limit_scalar: Optional[str] = None
    """The scalar that holds the absolute limit of its streams, ``mechmon/<monitor>/<limit_scalar>/layer_L``
    (the routing-entropy floor); None: no absolute limit."""
    window: Window
    """What its first value after a start waits for (the start-up arming line, ``detector_setup.arm_step``)."""
    label: str
    """Its short name in start-up lines (families with one label are listed once)."""
    no_signal: str
    """Why a job that could feed it has no layer that does (the start-up notice of families left out
    of the union bound); the settings it names are ``$field`` placeholders, spelled by whoever
    shows it (``detect/config_error.py``)."""
    switch: Optional[str] = None
    """The ``MechmonConfig`` boolean field that must be on for a job to feed it; None: fed whenever
    its monitor has a layer. A switch moved from its default turns an optional family on, or a
    default one off (the setting, spelled by whoever shows it, is then the start-up reason it has
    no signal: ``--mechmon-no-full-matrix-dw`` on a command line)."""
    optional: bool = False
    """Off by default: a calibration file may lack its tails, and only a job that asks for it (its
    ``switch``) needs them (the shipped ``null_tails.json`` covers the other families)."""
    remedy: Optional[str] = None
    """The remedy list of the shipped supervisor policy (``supervise/default_policy.json``) that answers
    its alarm; None: the shipped policy has none, and the supervisor stops on it."""
    from_checkpoints: bool = False
    """``mechmon-scan`` can feed it from saved weights alone (the routing entropy needs tokens; the
    short window needs a checkpoint every check interval)."""
    phase_corrected: bool = False
    """Its healthy level still moves early in training, so while a stream's baseline is young its
    residual is standardised by the calibration's phase moments (``detect/phase_moments.py``)."""


_ATTN_NO_SIGNAL = "no attention layer is monitored"
_ROUTER_NO_SIGNAL = "no MoE router is monitored (a dense model, or $monitors without router)"

ATTN_DELTA2 = FamilySpec(
    name="attn_delta2", direction="drop", monitor="attn", scalars=("delta2_entropy",), per_head=True,
    window="delta", label="Delta2",
    no_signal=f"{_ATTN_NO_SIGNAL} ($monitors without attn, or none found)",
    remedy="attention_precision", from_checkpoints=True, phase_corrected=True,
)
ATTN_DW = FamilySpec(
    name="attn_dw", direction="drop", monitor="attn", scalars=("dw_entropy", "dwk_entropy"), window="delta",
    label="dW", no_signal=_ATTN_NO_SIGNAL, switch="full_matrix_dw",
    remedy="attention_precision", from_checkpoints=True, phase_corrected=True,
)
ROUTER_ENTROPY = FamilySpec(
    name="router_entropy", direction="drop", monitor="router", scalars=("token_entropy",),
    limit_scalar="token_entropy_floor", window="check", label="routers", no_signal=_ROUTER_NO_SIGNAL,
    remedy="router",
)
ROUTER_WEIGHTS = FamilySpec(
    name="router_weights", direction="rise", monitor="router", scalars=("weight_similarity",), window="check",
    label="routers", no_signal=_ROUTER_NO_SIGNAL, remedy="router", from_checkpoints=True,
)
ATTN_DELTA2_SHORT = FamilySpec(
    name="attn_delta2_short", direction="drop", monitor="attn", scalars=("delta2_entropy_short",), per_head=True,
    window="interval", label="short-window Delta2", no_signal=_ATTN_NO_SIGNAL, switch="short_window",
    optional=True,
    # No shipped remedy: the family is off until calibrated (docs/RESULTS.md), so a person decides.
    remedy=None,
)

FAMILIES: tuple[FamilySpec, ...] = (ATTN_DELTA2, ATTN_DW, ROUTER_ENTROPY, ROUTER_WEIGHTS, ATTN_DELTA2_SHORT)
"""Every detector family, in the order the package lists them."""

FAMILY_NAMES: tuple[str, ...] = tuple(spec.name for spec in FAMILIES)

FAMILY_BY_NAME: Mapping[str, FamilySpec] = MappingProxyType({spec.name: spec for spec in FAMILIES})


def family_spec(name: str) -> FamilySpec:
    """The family called ``name``; ``ValueError`` naming the known ones otherwise."""
    spec = FAMILY_BY_NAME.get(name)
    if spec is None:
        raise ValueError(f"unknown detector family {name!r}; known: {sorted(FAMILY_NAMES)}.")
    return spec
