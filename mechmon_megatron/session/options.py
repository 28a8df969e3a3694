"""What one ``MechmonConfig`` field is as a setting: :class:`Option`, its ``dataclasses.field`` metadata.

Every front end is generated from it: the ``--mechmon-*`` flags (``cli/args.py``), the keys of a
DeepSpeed ``"mechmon"`` section (``adapters/deepspeed/config.py``), the flags ``mechmon-scan``
shares with the session (``scan/cli.py``) and the flag table of docs/USAGE.md
(``cli/flag_table.py``). ``MechmonConfig.__post_init__`` runs :meth:`Option.problem` on every
field, so each front end refuses the same values with the same reason, in its own spelling
(``detect/config_error.py``).
"""

from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass
from typing import Any, Callable, Literal, Optional

from mechmon_megatron.detect.config_error import literal
from mechmon_megatron.session.webhook import check_webhook_url

__all__ = ["OPTION", "Kind", "Option", "at_least", "finite_positive", "option"]

OPTION = "mechmon_option"
"""The ``dataclasses.field`` metadata key that holds a field's :class:`Option`."""

Kind = Literal["int", "float", "bool", "str", "choice", "list", "number_or_choice"]
"""``int``, ``float`` (an int is accepted), ``bool``, ``str``; ``choice``: one of ``choices``;
``list``: some of ``choices`` (comma-separated on a command line, a JSON list or a comma string in
DeepSpeed); ``number_or_choice``: one of ``choices`` or a number (a command line gives text)."""

Check = Callable[[Any], Optional[str]]
"""A single-field validator: the reason a (well-typed) value is refused, or None."""

_PYTHON_TYPE: dict[str, type] = {"int": int, "float": float}


@dataclass(frozen=True, kw_only=True)
class Option:
    """One setting: how front ends offer it, and which values it takes."""

    kind: Kind
    help: str
    """One line: the ``--help`` of its flag (and the table's meaning unless ``doc`` says more)."""
    unit: str = ""
    """What a number counts (``steps``, ``seconds``); empty when nothing."""
    choices: tuple[str, ...] = ()
    optional: bool = False
    """None is a value: "not set"."""
    flag: str = ""
    """Its command-line flag when not ``--mechmon-<name with dashes>``."""
    negated: bool = False
    """A ``bool`` whose flag (``store_true``) sets it to False (``--mechmon-no-full-matrix-dw``)."""
    host_default: bool = False
    """The command line's default is the host's (``cli/args.py`` computes it); the field's default
    is the one of a host that says nothing."""
    check: Optional[Check] = None
    metavar: str = ""
    """The value's placeholder in the docs table (``N``, ``DIR``); choices when empty."""
    default_text: str = ""
    """The docs table's default when the field's own default does not say it (``shipped``)."""
    doc: str = ""
    """The docs table's meaning, when it says more than ``help``."""

    def normalise(self, value: Any) -> Any:
        """``value`` in the field's own type where it is one in another form: an integral number as
        int, a real one as float, a comma string or a list of names as a tuple, ``"topk"`` / ``"off"``
        / a number's text as the setting. Anything else is returned as it is (:meth:`problem` says why)."""
        if value is None or isinstance(value, bool):
            return value
        if self.kind == "int" and isinstance(value, numbers.Integral):
            return int(value)
        if self.kind in ("float", "number_or_choice") and isinstance(value, numbers.Real):
            return _float(value)
        if self.kind == "list":
            if isinstance(value, str):
                return tuple(v.strip() for v in value.split(",") if v.strip())
            if isinstance(value, (list, tuple)):
                return tuple(value)
        if self.kind == "number_or_choice" and isinstance(value, str):
            text = value.strip().lower()
            if text in self.choices:
                return text
            if text == "off":
                return 0.0
            try:
                return float(text)
            except ValueError:
                return value
        return value

    def problem(self, value: Any) -> Optional[str]:
        """Why ``value`` (normalised) cannot be the setting: its type first, then ``check``."""
        if value is None and self.optional:
            return None
        reason = self._type_problem(value)
        if reason is None and self.kind == "choice" and value not in self.choices:
            names = " or ".join(self.choices) if len(self.choices) == 2 else f"one of {list(self.choices)}"
            reason = f"must be {names}, got {literal(repr(value))}"
        if reason is None and self.check is not None:
            reason = self.check(value)
        return reason

    def _type_problem(self, value: Any) -> Optional[str]:
        got = literal(repr(value))
        number = isinstance(value, numbers.Real) and not isinstance(value, bool)
        if self.kind == "int" and not (isinstance(value, int) and not isinstance(value, bool)):
            return f"must be an integer, got {got}"
        if self.kind == "float" and not number:
            return f"must be a number, got {got}"
        if self.kind == "bool" and not isinstance(value, bool):
            return f"must be true or false, got {got}"
        if self.kind in ("str", "choice") and not isinstance(value, str):
            return f"must be a string, got {got}"
        if self.kind == "list" and not (isinstance(value, tuple) and all(isinstance(v, str) for v in value)):
            example = ", ".join(f'"{c}"' for c in self.choices)
            return f"must be a list of family names (e.g. [{example}]), got {got}"
        if self.kind == "number_or_choice" and not (number or isinstance(value, str)):
            words = ", ".join(f'"{c}"' for c in (*self.choices, "off"))
            return f"must be {words} or a number, got {got}"
        return None

    def argparse_kwargs(self, default: Any) -> dict[str, Any]:
        """``add_argument`` keywords of its flag (``default``: the field's): ``store_true`` for a
        bool; else the type argparse converts to, the default in command-line form, and the help."""
        if self.kind == "bool":
            return {"action": "store_true", "help": self.help}
        if self.host_default or default is None:
            shown = None
        elif self.kind == "list":
            shown = ",".join(default)
        elif self.kind == "number_or_choice":
            shown = str(default)
        else:
            shown = default
        return {"type": _PYTHON_TYPE.get(self.kind, str), "default": shown, "help": self.help}


def option(**kwargs: Any) -> dict[str, Option]:
    """The ``dataclasses.field(metadata=...)`` of a setting."""
    return {OPTION: Option(**kwargs)}


def _float(value: Any) -> float:
    try:
        return float(value)
    except OverflowError:  # an int beyond float range
        return math.inf if value > 0 else -math.inf


# ---------------------------------------------------------------------------- single-field validators
def at_least(low: int) -> Check:
    return lambda value: None if value >= low else f"must be >= {low}, got {value}"


def finite_positive(what: str = "number") -> Check:
    return lambda value: (None if math.isfinite(value) and value > 0
                          else f"must be a finite {what} > 0, got {value!r}")


def share(value: float) -> Optional[str]:
    return None if 0 < value <= 1 else f"must be in (0, 1], got {value!r}"


def false_alarm_rate(value: float) -> Optional[str]:
    if math.isfinite(value) and 0 < value <= 1e6:
        return None
    return f"must be a number in (0, 1e6] (false alarms per 10^6 steps), got {value!r}"


def calibration_file(path: str) -> Optional[str]:
    if os.path.isfile(path):
        return None
    return f"must be a null-tail JSON file (mechmon-calibrate), got {literal(repr(path))}"


def webhook_url(url: str) -> Optional[str]:
    # Parsed whole here, the one check every front end runs when it reads its settings: the
    # session's poster (writer rank, after the model is built) re-checks with the same function,
    # so a URL accepted here is never refused there.
    try:
        check_webhook_url(url)
    except ValueError as exc:
        return literal(exc)
    return None


def effective_experts(value: Any) -> Optional[str]:
    """``"topk"``, or a number that is 0 (off) or >= 1 (exp(entropy) is never below 1)."""
    if value == "topk":
        return None
    if isinstance(value, str):
        return f"must be topk, off, 0 or a number >= 1, got {literal(repr(value))}"
    if math.isfinite(value) and (value == 0 or value >= 1):
        return None
    return f"must be topk, off, 0 or a number >= 1 (exp(entropy) is never below 1), got {value!r}"


def some_of(choices: tuple[str, ...]) -> Check:
    def check(value: tuple[str, ...]) -> Optional[str]:
        unknown = [v for v in value if v not in choices]
        if unknown:
            return f"unknown families {literal(unknown)}; choose from {list(choices)}"
        return None if value else "must name at least one family"

    return check
