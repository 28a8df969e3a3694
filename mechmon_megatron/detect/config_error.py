"""A bad setting, named by its ``MechmonConfig`` field and spelled by whoever shows it.

The core and the session name a setting by its field (``false_alarm_rate``), never by a flag:
one setting is ``--mechmon-false-alarm-rate`` on the command line, ``ds_config.mechmon.false_alarm_rate``
in a DeepSpeed config and ``--false-alarm-rate`` under ``mechmon-scan``. A reason names the
other settings it mentions as ``$field`` placeholders (``"needs $delta a multiple of
$interval"``); each front end renders the whole message once, with its own spelling
(:meth:`ConfigError.render`). Standard library only.
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from typing import Callable

__all__ = ["ConfigError", "ConfigNote", "Spelling", "bare", "literal", "render", "substitute"]

Spelling = Callable[[str], str]
"""Field name -> how a front end writes it (``interval`` -> ``--mechmon-interval``)."""


def bare(name: str) -> str:
    """The field name itself (the spelling of ``str()``: a library user's own keyword)."""
    return name


def literal(text: object) -> str:
    """``text`` (a user's value: a path, a URL, a repr) as it must stand in a reason to render as
    itself: a ``$`` in it is no placeholder."""
    return str(text).replace("$", "$$")


class _Spelled(dict):
    """Every ``$name`` placeholder, spelled (``string.Template`` looks each one up here)."""

    def __init__(self, spell: Spelling) -> None:
        super().__init__()
        self.spell = spell

    def __missing__(self, name: str) -> str:
        return self.spell(name)


def substitute(text: str, spell: Spelling) -> str:
    """``text`` with every ``$field`` placeholder spelled (and ``$$`` back to ``$``)."""
    return string.Template(text).safe_substitute(_Spelled(spell))


def render(field: str, reason: str, spell: Spelling) -> str:
    """``spell(field)``, a space, and ``reason`` with its placeholders spelled; no space before a
    reason that starts with punctuation (``"--mechmon-detector-calibration: no usable ..."``)."""
    text = substitute(reason, spell)
    return f"{spell(field)}{'' if text[:1] in (':', ';', ',', '.') else ' '}{text}"


class ConfigError(ValueError):
    """A value of ``field`` (a ``MechmonConfig`` field name) that cannot be used, and why.

    ``reason`` reads after the field's name (``"must be >= 1, got 0"``) and names other settings
    as ``$field`` placeholders; ``str()`` spells every name bare, a front end calls :meth:`render`
    with its own spelling."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(field, reason)
        self.field = field
        self.reason = reason

    def render(self, spell: Spelling) -> str:
        return render(self.field, self.reason, spell)

    def __str__(self) -> str:
        return self.render(bare)


@dataclass(frozen=True)
class ConfigNote:
    """A start-up warning about ``field`` (same ``reason`` rules as :class:`ConfigError`):
    nothing is wrong, but the user should know (e.g. no check falls within the run)."""

    field: str
    reason: str

    def render(self, spell: Spelling) -> str:
        return render(self.field, self.reason, spell)

    def __str__(self) -> str:
        return self.render(bare)
