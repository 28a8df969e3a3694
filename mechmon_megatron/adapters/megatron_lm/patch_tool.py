"""Apply, check and revert mechmon's patch of a Megatron-LM checkout (``mechmon-patch``).

    python tools/mechmon_patch.py check  MEGATRON_LM_DIR   # exit 0 applied, 1 not applied, 2 refused
    python tools/mechmon_patch.py apply  MEGATRON_LM_DIR   # idempotent
    python tools/mechmon_patch.py revert MEGATRON_LM_DIR   # exact reverse of the patch

The release is read from ``megatron/core/package_info.py`` (MAJOR, MINOR) and mapped to a patch
set under ``patches/megatron-lm/`` (``RELEASES``); ``--release NAME`` overrides the detection.
Pure Python (no ``patch`` or ``git`` binary). Safety:

* every hunk is located (exact context, unique match; the line number in the diff is only a
  hint) for every file BEFORE anything is written; any mismatch refuses with the tree unchanged;
* a file already carrying the patch is left alone (``apply`` twice = no change);
* a file matching neither side (edited by hand, another release) is ``modified``: refused;
* files are written atomically (temporary file + ``os.replace``), keeping their mode.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Literal, Optional, Sequence

# (MAJOR, MINOR) of megatron/core/package_info.py -> patch set directory under patches/megatron-lm.
RELEASES: dict[tuple[int, int], str] = {
    (0, 16): "core_v0.16.x",
    (0, 20): "main",  # Megatron-LM main as of 2026-08 (package_info 0.20.0, pretrain(full_config, ...))
}
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


def select_release(root: str, release: Optional[str], patches_dir: str) -> str:
    if release is None:
        version = detect_release(root)
        release = RELEASES.get(version[:2])
        if release is None:
            supported = ", ".join(f"{a}.{b}.x ({name})" for (a, b), name in sorted(RELEASES.items()))
            raise PatchError(
                f"Megatron-LM {'.'.join(map(str, version))} has no mechmon patch set (supported: {supported}). "
                "Apply the three-line change of patches/README.md by hand, or force a set with --release NAME."
            )
    if not os.path.isdir(os.path.join(patches_dir, release)):
        raise PatchError(f"patch set {release!r} not found in {os.path.normpath(patches_dir)}")
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


def _read_lines(root: str, patch: FilePatch) -> tuple[list[str], bool]:
    path = os.path.join(root, patch.path)
    if not os.path.isfile(path):
        raise PatchError(f"{patch.path} not found under {root}")
    with open(path, encoding="utf-8", newline="") as f:
        text = f.read()
    if "\r\n" in text:
        raise PatchError(f"{patch.path} has Windows line endings; the patch expects '\\n'")
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
    release: str
    status: dict[str, Status]
    changed: list[str] = field(default_factory=list)

    @property
    def overall(self) -> Status:
        states = set(self.status.values())
        return states.pop() if len(states) == 1 else "modified"


def check(root: str, release: Optional[str] = None, patches_dir: Optional[str] = None) -> Report:
    patches_dir = patches_dir or default_patches_dir()
    release = select_release(root, release, patches_dir)
    status = {}
    for patch in load_patches(patches_dir, release):
        lines, _ = _read_lines(root, patch)
        status[patch.path] = file_status(lines, patch)
    return Report(release, status)


def _transform(root: str, release: Optional[str], patches_dir: Optional[str], reverse: bool) -> Report:
    report = check(root, release, patches_dir)
    if report.overall == "modified":
        bad = [p for p, s in report.status.items() if s == "modified"] or list(report.status)
        raise PatchError(
            f"{', '.join(bad)} matches neither the original nor the patched {report.release} file "
            "(edited by hand, or another release?); nothing was changed. "
            "Restore the file (e.g. `git checkout -- pretrain_gpt.py`) or apply the change by hand."
        )
    target: Status = "not applied" if reverse else "applied"
    if report.overall == target:
        return report  # idempotent: nothing to do
    patches = load_patches(patches_dir or default_patches_dir(), report.release)
    pending = []
    for patch in patches:  # everything in memory first: no half-applied tree
        lines, newline = _read_lines(root, patch)
        hunks = patch.reversed().hunks if reverse else patch.hunks
        pending.append((os.path.join(root, patch.path), _apply_hunks(lines, hunks, patch.path), newline, patch.path))
    for path, lines, newline, name in pending:
        _write_atomic(path, lines, newline)
        report.changed.append(name)
        report.status[name] = target
    return report


def apply(root: str, release: Optional[str] = None, patches_dir: Optional[str] = None) -> Report:
    return _transform(root, release, patches_dir, reverse=False)


def revert(root: str, release: Optional[str] = None, patches_dir: Optional[str] = None) -> Report:
    return _transform(root, release, patches_dir, reverse=True)


# ---------------------------------------------------------------------------- CLI
EXIT_APPLIED, EXIT_NOT_APPLIED, EXIT_REFUSED = 0, 1, 2


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="mechmon-patch", description="Patch a Megatron-LM checkout for mechmon.")
    parser.add_argument("command", choices=("check", "apply", "revert"))
    parser.add_argument("megatron_lm_dir", help="root of the Megatron-LM checkout (holds pretrain_gpt.py)")
    parser.add_argument(
        "--release", default=None, help=f"patch set to use instead of detecting it: {sorted(set(RELEASES.values()))}"
    )
    parser.add_argument(
        "--patches-dir", default=None, help="directory holding the patch sets (default: patches/megatron-lm)"
    )
    args = parser.parse_args(argv)
    try:
        if args.command == "check":
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
    if args.command == "check":
        return {"applied": EXIT_APPLIED, "not applied": EXIT_NOT_APPLIED}.get(report.overall, EXIT_REFUSED)
    return 0


if __name__ == "__main__":
    sys.exit(main())
