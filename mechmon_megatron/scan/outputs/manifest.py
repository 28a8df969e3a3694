"""What ``mechmon-scan`` wrote in ``OUT``: a manifest, so that nothing else is ever replaced.

``OUT/.mechmon-scan.json`` lists the entries the scan owns (``{"written_by": "mechmon-scan",
"version": 1, "entries": [...]}``). A scan writes only into a folder that is new, empty or
marked by this manifest, and only replaces the entries the manifest lists; a folder holding
anything else (a run folder with its checkpoints and the training's ``tensorboard/``, another
tool's ``report.html``) is refused naming ``--out``, before anything is read or written.

The manifest is written before the first byte of cache, and every entry is added to it before
the entry is moved in: an interrupted scan leaves only listed entries (and staging folders,
removed by the next run).
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Optional

from mechmon_megatron.scan.errors import ScanInputError
from mechmon_megatron.scan.outputs.staging import write_text_atomic

__all__ = ["MANIFEST", "check", "claim", "clean_stale", "record"]

MANIFEST = ".mechmon-scan.json"
VERSION = 1
ALWAYS_OURS = ("cache",)
"""Entries of a marked folder owned by the scan whether listed or not (the pair cache)."""
STALE_PREFIXES = (".staging-", ".old-", ".tmp-")
"""Left by a scan that was killed while writing its outputs (see ``staging.py``)."""


def _read(out: str) -> Optional[list[str]]:
    """The entries listed in ``out``'s manifest, or None when ``out`` carries none."""
    path = os.path.join(out, MANIFEST)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        entries = data["entries"]
        if data.get("written_by") != "mechmon-scan" or not all(isinstance(e, str) for e in entries):
            raise ValueError("not a mechmon-scan manifest")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ScanInputError(f"--out {out!r}: its {MANIFEST} cannot be read ({exc}); choose a new folder") from None
    return list(entries)


def _write(out: str, entries: list[str]) -> None:
    payload = {"written_by": "mechmon-scan", "version": VERSION, "entries": sorted(set(entries))}
    write_text_atomic(os.path.join(out, MANIFEST), json.dumps(payload, indent=1) + "\n")


def check(out: str) -> None:
    """``ScanInputError`` naming ``--out`` when it holds data this tool did not write. Writes nothing."""
    if not os.path.isdir(out):
        return
    names = sorted(os.listdir(out))
    listed = _read(out)
    ours = set(ALWAYS_OURS) | set(listed or ()) | {MANIFEST}
    foreign = [n for n in names if n not in ours and not n.startswith(STALE_PREFIXES)]
    if listed is None and names:
        foreign = names
    if foreign:
        shown = ", ".join(foreign[:4]) + (f" and {len(foreign) - 4} more" if len(foreign) > 4 else "")
        raise ScanInputError(
            f"--out {out!r} holds data mechmon-scan did not write ({shown}); a scan replaces what it finds "
            "there, so give it a new or empty folder (e.g. --out RUN/mechmon_scan)"
        )


def claim(out: str) -> bool:
    """Create or mark ``out`` as the scan's folder (after :func:`check`); True when it was created."""
    created = not os.path.exists(out)
    os.makedirs(out, exist_ok=True)
    _write(out, _read(out) or [])
    return created


def clean_stale(out: str) -> list[str]:
    """Remove what an interrupted scan left in its staging area; the names removed."""
    removed = []
    for name in sorted(os.listdir(out)):
        if not name.startswith(STALE_PREFIXES):
            continue
        path = os.path.join(out, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.remove(path)
        removed.append(name)
    return removed


def record(out: str, entries: list[str]) -> None:
    """Add ``entries`` to the manifest (before they are moved in)."""
    _write(out, (_read(out) or []) + list(entries))
