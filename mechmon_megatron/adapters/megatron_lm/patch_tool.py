"""Apply, check and revert mechmon's edit of a Megatron-LM checkout (``mechmon-patch``).

    mechmon-patch status MEGATRON_LM_DIR   # exit 0 applied, 1 not applied, 2 refused (alias: check)
    mechmon-patch apply  MEGATRON_LM_DIR   # idempotent
    mechmon-patch revert MEGATRON_LM_DIR   # byte-identical original

By default (``--release auto``) the three insertion points of ``pretrain_gpt.py`` (the import
block, the parsing call -- ``pretrain(`` up to core_v0.17, ``parse_and_validate_args(`` from
core_v0.18 on -- and its ``extra_args_provider`` argument, present or absent) are located by
content on the parsed file (:mod:`.anchors`), so any release from core_v0.16 on with the same
structure is supported without a new patch file. The release (``megatron/core/package_info.py``)
is only reported, and releases older than core_v0.16 are refused. ``--release NAME`` instead
applies the frozen unified diff ``patches/megatron-lm/NAME/*.patch`` (exact context; the line
number is a hint); both ways write byte-identical results on the releases those diffs cover.
Pure Python (no ``patch`` or ``git`` binary). Safety, in both ways:

* every change is located (and, by content, the result is parsed and reverted in memory to the
  byte-identical original) BEFORE anything is written; any doubt refuses with the tree unchanged;
* a file already carrying the edit is left alone (``apply`` twice = no change);
* a file matching neither side (edited by hand, partially patched, another structure) is
  ``modified``: refused, with the reason (the file and what was expected);
* files are written atomically (temporary file + ``os.replace``), keeping their mode; a symlink
  is followed (the file it points to is edited and reverted, the link stays a link), and a file
  that cannot be written is refused in one line before any file is written.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Literal, Optional, Sequence, cast

from mechmon_megatron.adapters.megatron_lm import anchors

AUTO = "auto"
SCRIPT = "pretrain_gpt.py"
MIN_RELEASE = (0, 16)  # the oldest release whose training loop install() is known to hook
PACKAGE_INFO = os.path.join("megatron", "core", "package_info.py")
Status = Literal["applied", "not applied", "modified"]


class PatchError(Exception):
    """A refusal: unknown release, modified file, malformed patch. The tree is unchanged."""


# ---------------------------------------------------------------------------- unified diffs
@dataclass
class Hunk:
    old_start: int  # 1-based line of the first old line (a hint; matching is by content)
    lines: list[str] = field(default_factory=list)  # ' ctx', '-old', '+new' (no newline)

    @property
    def old(self) -> list[str]:
        return [line[1:] for line in self.lines if line[:1] in (" ", "-")]

    @property
    def new(self) -> list[str]:
        return [line[1:] for line in self.lines if line[:1] in (" ", "+")]

    def reversed(self) -> Hunk:
        swap = {"+": "-", "-": "+", " ": " "}
        return Hunk(self.old_start, [swap[line[0]] + line[1:] for line in self.lines])


@dataclass
class FilePatch:
    path: str  # relative to the Megatron-LM root
    hunks: list[Hunk]

    def reversed(self) -> FilePatch:
        return FilePatch(self.path, [h.reversed() for h in self.hunks])


_HUNK_HEADER = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def _strip_prefix(name: str) -> str:
    name = name.split("\t")[0].strip()
    return name[2:] if name.startswith(("a/", "b/")) else name


def parse_patch(text: str) -> list[FilePatch]:
    """Parse a unified diff (``diff -u`` / ``git diff``) into file patches."""
    files: list[FilePatch] = []
    lines = text.splitlines()
    i = 0
    current: Optional[FilePatch] = None
    while i < len(lines):
        line = lines[i]
        if line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            current = FilePatch(_strip_prefix(lines[i + 1][4:]), [])
            files.append(current)
            i += 2
            continue
        match = _HUNK_HEADER.match(line)
        if match:
            if current is None:
                raise PatchError("malformed patch: hunk before a '--- / +++' file header")
            old_len = int(match.group(2) or 1)
            new_len = int(match.group(4) or 1)
            hunk = Hunk(int(match.group(1)))
            i += 1
            while (old_len > 0 or new_len > 0) and i < len(lines):
                body = lines[i]
                tag = body[:1] or " "  # an empty line is an empty context line
                if tag == "\\":  # "\ No newline at end of file"
                    i += 1
                    continue
                if tag not in (" ", "-", "+"):
                    raise PatchError(f"malformed patch: unexpected line {body!r} in a hunk of {current.path}")
                hunk.lines.append(tag + body[1:])
                old_len -= tag in (" ", "-")
                new_len -= tag in (" ", "+")
                i += 1
            if old_len or new_len:
                raise PatchError(f"malformed patch: truncated hunk in {current.path}")
            current.hunks.append(hunk)
            continue
        i += 1
    if not files or not all(f.hunks for f in files):
        raise PatchError("malformed patch: no hunks found")
    return files


def _find(haystack: list[str], block: list[str], hint: int) -> list[int]:
    """Start indices where ``block`` occurs in ``haystack``; the hint position first."""
    n = len(block)
    if n == 0:
        return [min(max(hint, 0), len(haystack))]
    if 0 <= hint <= len(haystack) - n and haystack[hint : hint + n] == block:
        others = [s for s in range(len(haystack) - n + 1) if s != hint and haystack[s : s + n] == block]
        return [hint] + others
    return [s for s in range(len(haystack) - n + 1) if haystack[s : s + n] == block]


def _apply_hunks(lines: list[str], hunks: Sequence[Hunk], path: str) -> list[str]:
    """Apply ``hunks`` in memory; ``PatchError`` names the first hunk that does not match."""
    out = list(lines)
    shift = 0
    for number, hunk in enumerate(hunks, 1):
        found = _find(out, hunk.old, hunk.old_start - 1 + shift)
        if len(found) != 1:
            why = "its context is not in the file" if not found else f"its context occurs {len(found)} times"
            raise PatchError(f"{path}: hunk {number} (near line {hunk.old_start}) does not apply: {why}")
        start = found[0]
        out[start : start + len(hunk.old)] = hunk.new
        shift += len(hunk.new) - len(hunk.old)
    return out


def file_status(lines: list[str], patch: FilePatch) -> Status:
    """``applied`` / ``not applied`` when every hunk matches one side uniquely, else ``modified``."""
    try:
        _apply_hunks(lines, patch.hunks, patch.path)
        return "not applied"
    except PatchError:
        pass
    try:
        _apply_hunks(lines, patch.reversed().hunks, patch.path)
        return "applied"
    except PatchError:
        return "modified"


# ---------------------------------------------------------------------------- a checkout
def detect_release(root: str) -> tuple[int, int, int]:
    """(MAJOR, MINOR, PATCH) from ``megatron/core/package_info.py`` (parsed, never imported)."""
    path = os.path.join(root, PACKAGE_INFO)
    if not os.path.isfile(path):
        raise PatchError(f"{root} is not a Megatron-LM checkout: {PACKAGE_INFO} not found")
    values: dict[str, int] = {}
    for node in ast.parse(open(path, encoding="utf-8").read()).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id in ("MAJOR", "MINOR", "PATCH") and isinstance(node.value, ast.Constant):
                values[node.targets[0].id] = int(node.value.value)
    try:
        return values["MAJOR"], values["MINOR"], values["PATCH"]
    except KeyError as exc:
        raise PatchError(f"{path} has no {exc.args[0]} = <int>; cannot tell the Megatron-LM release") from None


def default_patches_dir() -> str:
    """``$MECHMON_PATCHES_DIR``, else ``patches/megatron-lm`` of the source tree holding this file
    (editable install), else the copy a wheel installs under ``<prefix>/share/mechmon-megatron``."""
    env = os.environ.get("MECHMON_PATCHES_DIR")
    if env:
        return env
    here = os.path.dirname(os.path.abspath(__file__))
    source_tree = os.path.join(here, os.pardir, os.pardir, os.pardir, "patches", "megatron-lm")
    if os.path.isdir(source_tree):
        return source_tree
    return os.path.join(sys.prefix, "share", "mechmon-megatron", "patches", "megatron-lm")


def select_release(release: str, patches_dir: str) -> str:
    """A pinned patch set (a directory of ``*.patch`` files under ``patches_dir``)."""
    if not os.path.isdir(os.path.join(patches_dir, release)):
        available = sorted(d for d in os.listdir(patches_dir) if os.path.isdir(os.path.join(patches_dir, d))) \
            if os.path.isdir(patches_dir) else []
        raise PatchError(
            f"patch set {release!r} not found in {os.path.normpath(patches_dir)} "
            f"(available: {', '.join(available) or 'none'}; or --release {AUTO})"
        )
    return release


def load_patches(patches_dir: str, release: str) -> list[FilePatch]:
    directory = os.path.join(patches_dir, release)
    patches: list[FilePatch] = []
    for name in sorted(os.listdir(directory)):
        if name.endswith(".patch"):
            with open(os.path.join(directory, name), encoding="utf-8") as f:
                patches.extend(parse_patch(f.read()))
    if not patches:
        raise PatchError(f"no *.patch files in {directory}")
    return patches


def _read_text(root: str, name: str) -> str:
    path = os.path.join(root, name)
    if not os.path.isfile(path):
        raise PatchError(f"{name} not found under {root}")
    with open(path, encoding="utf-8", newline="") as f:
        text = f.read()
    if "\r\n" in text or "\r" in text:
        raise PatchError(f"{name} has Windows line endings; mechmon-patch expects '\\n'")
    return text


def _read_lines(root: str, patch: FilePatch) -> tuple[list[str], bool]:
    text = _read_text(root, patch.path)
    return text.split("\n")[:-1] if text.endswith("\n") else text.split("\n"), text.endswith("\n")


def _write_atomic(path: str, lines: list[str], final_newline: bool) -> None:
    text = "\n".join(lines) + ("\n" if final_newline else "")
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".mechmon-", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(text)
        os.chmod(tmp, os.stat(path).st_mode & 0o7777)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


@dataclass
class Report:
    release: str  # what was used: "Megatron-LM 0.19.1, located by content" or a pinned patch set name
    status: dict[str, Status]
    changed: list[str] = field(default_factory=list)
    reasons: dict[str, str] = field(default_factory=dict)

    @property
    def overall(self) -> Status:
        states = set(self.status.values())
        return states.pop() if len(states) == 1 else "modified"


def _content_check(root: str) -> Report:
    version = detect_release(root)
    if version[:2] < MIN_RELEASE:
        raise PatchError(
            f"Megatron-LM {'.'.join(map(str, version))} is older than core_v{MIN_RELEASE[0]}.{MIN_RELEASE[1]}, "
            "the oldest release mechmon supports; nothing was changed"
        )
    status, why = anchors.state(_read_text(root, SCRIPT), SCRIPT)
    label = f"Megatron-LM {'.'.join(map(str, version))}, located by content"
    return Report(label, {SCRIPT: cast(Status, status)}, reasons={SCRIPT: why})


def check(root: str, release: Optional[str] = None, patches_dir: Optional[str] = None) -> Report:
    """Status of the checkout; ``release`` None / ``auto``: by content, else a pinned patch set."""
    if release in (None, AUTO):
        return _content_check(root)
    patches_dir = patches_dir or default_patches_dir()
    release = select_release(release, patches_dir)
    status = {}
    for patch in load_patches(patches_dir, release):
        lines, _ = _read_lines(root, patch)
        status[patch.path] = file_status(lines, patch)
    return Report(release, status)


def _refusal(report: Report) -> PatchError:
    bad = [p for p, s in report.status.items() if s == "modified"] or list(report.status)
    if report.reasons:
        why = "; ".join(report.reasons.get(p, "") for p in bad)
        return PatchError(f"{why}. Nothing was changed. Restore the file (e.g. `git checkout -- {bad[0]}`), apply "
                          "the change by hand (patches/README.md), or start with mechmon-run (no patch needed).")
    return PatchError(
        f"{', '.join(bad)} matches neither the original nor the patched {report.release} file "
        "(edited by hand, or another release?); nothing was changed. "
        "Restore the file (e.g. `git checkout -- pretrain_gpt.py`), apply the change by hand, or use --release auto."
    )


def _transform(root: str, release: Optional[str], patches_dir: Optional[str], reverse: bool) -> Report:
    report = check(root, release, patches_dir)
    if report.overall == "modified":
        raise _refusal(report)
    target: Status = "not applied" if reverse else "applied"
    if report.overall == target:
        return report  # idempotent: nothing to do
    pending = []  # everything in memory first: no half-applied tree
    if release in (None, AUTO):
        text = _read_text(root, SCRIPT)
        try:
            lines = anchors.plan_revert(text, SCRIPT) if reverse else anchors.plan_apply(text, SCRIPT)
        except anchors.AnchorError as exc:
            raise PatchError(f"{exc}; nothing was changed") from None
        pending.append((os.path.join(root, SCRIPT), lines, text.endswith("\n"), SCRIPT))
    else:
        for patch in load_patches(patches_dir or default_patches_dir(), report.release):
            lines, newline = _read_lines(root, patch)
            hunks = patch.reversed().hunks if reverse else patch.hunks
            pending.append((os.path.join(root, patch.path), _apply_hunks(lines, hunks, patch.path), newline,
                            patch.path))
    # A symlinked file (a checkout that links pretrain_gpt.py from elsewhere) is edited where it
    # lives: the link stays a link, and revert restores the file it points to.
    pending = [(os.path.realpath(path), lines, newline, name) for path, lines, newline, name in pending]
    for path, _, _, name in pending:  # every file writable before the first is written
        problem = _write_problem(path)
        if problem:
            raise PatchError(f"{name}: cannot write {path} ({problem}); nothing was changed")
    for path, lines, newline, name in pending:
        try:
            _write_atomic(path, lines, newline)
        except OSError as exc:
            raise PatchError(f"{name}: cannot write {path} ({exc.strerror or exc})") from None
        report.changed.append(name)
        report.status[name] = target
    return report


def _write_problem(path: str) -> Optional[str]:
    """Why ``path`` cannot be replaced by its edited copy (read-only, immutable, a read-only
    folder), or None. Opening for append changes nothing; the probe file is removed at once."""
    try:
        with open(path, "ab"):
            pass
        fd, probe = tempfile.mkstemp(prefix=".mechmon-", dir=os.path.dirname(path))
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def apply(root: str, release: Optional[str] = None, patches_dir: Optional[str] = None) -> Report:
    return _transform(root, release, patches_dir, reverse=False)


def revert(root: str, release: Optional[str] = None, patches_dir: Optional[str] = None) -> Report:
    return _transform(root, release, patches_dir, reverse=True)


# ---------------------------------------------------------------------------- CLI
EXIT_APPLIED, EXIT_NOT_APPLIED, EXIT_REFUSED = 0, 1, 2


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="mechmon-patch", description="Patch a Megatron-LM checkout for mechmon.")
    parser.add_argument("command", choices=("status", "check", "apply", "revert"), help="check = status")
    parser.add_argument("megatron_lm_dir", help="root of the Megatron-LM checkout (holds pretrain_gpt.py)")
    parser.add_argument(
        "--release",
        default=AUTO,
        help="auto (default): locate the edits by content, for any release from core_v0.16 on; or the name of a "
        "frozen patch set under --patches-dir (core_v0.16.x, main) to apply that exact diff",
    )
    parser.add_argument(
        "--patches-dir", default=None, help="directory holding the patch sets (default: patches/megatron-lm)"
    )
    args = parser.parse_args(argv)
    try:
        if args.command in ("status", "check"):
            report = check(args.megatron_lm_dir, args.release, args.patches_dir)
        elif args.command == "apply":
            report = apply(args.megatron_lm_dir, args.release, args.patches_dir)
        else:
            report = revert(args.megatron_lm_dir, args.release, args.patches_dir)
    except PatchError as exc:
        print(f"mechmon-patch: refused: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    for path, status in report.status.items():
        verb = (
            "patched"
            if path in report.changed and args.command == "apply"
            else "restored"
            if path in report.changed
            else status
        )
        print(f"{path}: {verb} ({report.release})")
        if args.command in ("status", "check") and status == "modified" and path in report.reasons:
            print(f"  {report.reasons[path]}")
    if args.command in ("status", "check"):
        return {"applied": EXIT_APPLIED, "not applied": EXIT_NOT_APPLIED}.get(report.overall, EXIT_REFUSED)
    return 0


if __name__ == "__main__":
    sys.exit(main())
