"""The Megatron-LM patch tool on synthetic checkouts (Megatron-LM's own files are never committed).

By content (the default): the release-structured ``pretrain_gpt.py`` files of
``release_fixtures`` (core_v0.16 .. core_v0.19, main), edge cases, and refusals. The frozen
per-release diffs (``--release core_v0.16.x|main``): on files holding exactly their context, and
byte-identical to the content-located edit.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from release_fixtures import RELEASES, make_checkout, pretrain_gpt_source

from mechmon_megatron.adapters.megatron_lm import anchors
from mechmon_megatron.adapters.megatron_lm import patch_tool as mp

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PATCHES = os.path.join(REPO, "patches", "megatron-lm")
PINNED = {"core_v0.16.x": "core_v0.16", "main": "core_v0.19"}  # frozen diff -> a release it fits


def snapshot(root) -> dict:
    return {p: open(os.path.join(dp, p), "rb").read() for dp, _, files in os.walk(root) for p in files}


def script(root) -> bytes:
    return open(os.path.join(str(root), "pretrain_gpt.py"), "rb").read()


# ---------------------------------------------------------------------------- by content
@pytest.mark.parametrize("release", sorted(RELEASES))
def test_round_trip_on_each_release_structure(tmp_path, release):
    root = make_checkout(tmp_path, release)
    original = script(root)
    report = mp.check(root)
    assert report.overall == "not applied" and "located by content" in report.release
    assert ".".join(map(str, RELEASES[release])) in report.release

    assert mp.apply(root).changed == ["pretrain_gpt.py"]
    patched = script(root).decode()
    added = [line for line in patched.splitlines() if line.endswith(anchors.MARKER)]
    assert added[0] == anchors.IMPORT_LINE and added[1].strip() == "mechmon.install()  # [mechmon]"
    assert "extra_args_provider=mechmon.extra_args_provider(add_modelopt_args if has_nvidia_modelopt else None)," \
        in added[2]
    compile(patched, "pretrain_gpt.py", "exec")
    # install() comes before the call that parses the arguments
    parse_call = "parse_and_validate_args(" if release not in ("core_v0.16", "core_v0.17") else "    pretrain(\n"
    assert patched.index("mechmon.install()") < patched.index(parse_call, patched.index("if __name__"))
    assert patched.index(anchors.IMPORT_LINE) < patched.index("stimer = ")
    assert mp.check(root).overall == "applied"

    before = snapshot(root)
    assert mp.apply(root).changed == []  # idempotent
    assert snapshot(root) == before
    assert mp.revert(root).changed == ["pretrain_gpt.py"]
    assert script(root) == original  # byte-identical
    assert mp.revert(root).changed == []


@pytest.mark.parametrize("pinned", sorted(PINNED))
def test_frozen_diff_and_content_edit_are_byte_identical(tmp_path, pinned):
    """Checkouts patched by the older, diff-based tool are recognised and reverted by content."""
    by_diff = make_checkout(tmp_path / "diff", PINNED[pinned])
    by_content = make_checkout(tmp_path / "content", PINNED[pinned])
    assert mp.check(by_diff, release=pinned, patches_dir=PATCHES).overall == "not applied"
    mp.apply(by_diff, release=pinned, patches_dir=PATCHES)
    mp.apply(by_content)
    assert script(by_diff) == script(by_content)
    assert mp.check(by_diff).overall == "applied"
    mp.revert(by_diff)
    assert script(by_diff) == pretrain_gpt_source(PINNED[pinned]).encode()


def test_frozen_diffs_do_not_fit_core_v018(tmp_path):
    root = make_checkout(tmp_path, "core_v0.18")
    for pinned in PINNED:
        assert mp.check(root, release=pinned, patches_dir=PATCHES).overall == "modified"
    assert mp.check(root).overall == "not applied"


def test_shifted_lines_and_non_ascii_text(tmp_path):
    source = pretrain_gpt_source("core_v0.16").replace(
        "        extra_args_provider=", "        args_note='µ-batch ünïcode', extra_args_provider="
    )
    root = make_checkout(tmp_path, "core_v0.16", source="# local note\n" * 9 + source)
    original = script(root)
    mp.apply(root)
    text = script(root).decode()
    assert "args_note='µ-batch ünïcode', extra_args_provider=mechmon.extra_args_provider(add_modelopt_args" in text
    mp.revert(root)
    assert script(root) == original


def test_value_over_two_lines(tmp_path):
    source = _edit("core_v0.16", PROVIDER_016, "        extra_args_provider=(add_modelopt_args\n"
                   "                             if has_nvidia_modelopt else None),\n")
    root = make_checkout(tmp_path, "core_v0.16", source=source)
    mp.apply(root)
    text = script(root).decode()
    assert "        extra_args_provider=(mechmon.extra_args_provider(add_modelopt_args\n" in text  # inside the parens
    assert "                             if has_nvidia_modelopt else None)),  # [mechmon]\n" in text
    assert mp.check(root).overall == "applied"
    mp.revert(root)
    assert script(root) == source.encode()


PRETRAIN_NO_PROVIDER = '''import os

from megatron.training import pretrain


def forward_step(data_iterator, model):
    return None


if __name__ == "__main__":
    pretrain(
        None,
        None,
        None,
        forward_step,
        args_defaults={},
    )
'''


_CALL = PRETRAIN_NO_PROVIDER[PRETRAIN_NO_PROVIDER.index("    pretrain(") : -1]
_ONE_LINE = PRETRAIN_NO_PROVIDER.replace(_CALL, "    pretrain(None, None, None, forward_step)")
_PARSE = PRETRAIN_NO_PROVIDER.replace(
    _CALL, "    args = parse_and_validate_args()\n    pretrain(args, None, None, forward_step)"
).replace("import pretrain", "import parse_and_validate_args, pretrain")
_ADDED = "extra_args_provider=mechmon.extra_args_provider()"


@pytest.mark.parametrize(
    "source, added",
    [
        (PRETRAIN_NO_PROVIDER, f"        {_ADDED},  # [mechmon]"),
        (_ONE_LINE, f"    pretrain(None, None, None, forward_step, {_ADDED})  # [mechmon]"),
        (_PARSE, f"    args = parse_and_validate_args({_ADDED})  # [mechmon]"),
    ],
    ids=["multi-line", "one-line", "parse-call"],
)
def test_absent_provider_is_added_and_removed_exactly(tmp_path, source, added):
    root = make_checkout(tmp_path, "core_v0.19", source=source)
    mp.apply(root)
    text = script(root).decode()
    assert added in text.splitlines(), text
    assert text.index("mechmon.install()") < text.index("extra_args_provider=")
    compile(text, "pretrain_gpt.py", "exec")
    assert mp.check(root).overall == "applied"
    mp.revert(root)
    assert script(root) == source.encode()


# ---------------------------------------------------------------------------- refusals
def _edit(release: str, old: str, new: str, count: int = 1) -> str:
    source = pretrain_gpt_source(release)
    assert old in source, old
    return source.replace(old, new, count)


PROVIDER_016 = "        extra_args_provider=add_modelopt_args if has_nvidia_modelopt else None,\n"
REFUSALS = {
    "no main block": (_edit("core_v0.16", 'if __name__ == "__main__":', "def main():"), "__main__"),
    "two provider calls": (
        _edit("core_v0.19", "    full_config = ", "    parse_and_validate_args(extra_args_provider=None)\n"
              "    full_config = "), "passed by 2 calls"),
    "two pretrain calls": (
        _edit("core_v0.16", PROVIDER_016, "") + "    pretrain(None, None, None, None)\n", "2 calls of pretrain("),
    "kwargs": (_edit("core_v0.16", PROVIDER_016, "        **extra,\n"), "**kwargs"),
    "positional provider": (
        _edit("core_v0.16", PROVIDER_016, "").replace(
            "        forward_step,\n", "        forward_step,\n        None,\n        add_modelopt_args,\n"),
        "positionally"),
    "name taken": (_edit("core_v0.16", "stimer = StragglerDetector()", "mechmon = object()"), "mechmon"),
    "no import block": ('if __name__ == "__main__":\n    pretrain(None, None, None, None)\n', "import block"),
    "shared line": (_edit("core_v0.16", "    pretrain(\n", "    x = 1; pretrain(\n"), "another statement"),
    "continuation": (
        _edit("core_v0.16", PROVIDER_016, PROVIDER_016.replace(",\n", ", \\\n")), "'\\'"),
    "syntax error": (pretrain_gpt_source("core_v0.16") + "def broken(:\n", "does not parse"),
    "hand-made edit": (_edit("core_v0.16", "stimer = ", "from mechmon_megatron import megatron_lm\n"
                             "stimer = "), "without the"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_doubt_refuses_and_changes_nothing(tmp_path, case):
    source, reason = REFUSALS[case]
    root = make_checkout(tmp_path, "core_v0.19", source=source)
    before = snapshot(root)
    report = mp.check(root)
    assert report.overall == "modified" and reason in report.reasons["pretrain_gpt.py"], report.reasons
    for action in (mp.apply, mp.revert):
        with pytest.raises(mp.PatchError, match="nothing was changed|Nothing was changed") as info:
            action(root)
        assert "pretrain_gpt.py" in str(info.value)
    assert snapshot(root) == before


@pytest.mark.parametrize(
    "damage",
    [
        lambda t: t.replace("    mechmon.install()  # [mechmon]\n", ""),  # partially reverted by hand
        lambda t: t.replace("mechmon.extra_args_provider(add_modelopt_args if has_nvidia_modelopt else None)",
                            "add_modelopt_args"),  # unwrapped by hand, marker kept
        lambda t: t.replace(anchors.IMPORT_LINE + "\n\n", anchors.IMPORT_LINE + "\n"),  # blank line removed
        lambda t: t + "x = 1  # [mechmon]\n",  # a fourth marked line
    ],
    ids=["missing-install", "edited-value", "blank-line", "extra-marker"],
)
def test_damaged_patch_is_modified_and_refused(tmp_path, damage):
    root = make_checkout(tmp_path, "core_v0.16")
    mp.apply(root)
    path = os.path.join(root, "pretrain_gpt.py")
    damaged = damage(open(path).read())
    with open(path, "w") as f:
        f.write(damaged)
    assert mp.check(root).overall == "modified"
    with pytest.raises(mp.PatchError):
        mp.revert(root)
    with pytest.raises(mp.PatchError):
        mp.apply(root)
    assert open(path).read() == damaged


def test_older_release_not_a_checkout_and_crlf_are_refused(tmp_path):
    old = make_checkout(tmp_path / "old", "core_v0.16")
    with open(os.path.join(old, "megatron", "core", "package_info.py"), "w") as f:
        f.write("MAJOR = 0\nMINOR = 15\nPATCH = 3\n")
    with pytest.raises(mp.PatchError, match=r"0\.15\.3 is older than core_v0\.16"):
        mp.apply(old)
    with pytest.raises(mp.PatchError, match="not a Megatron-LM checkout"):
        mp.check(str(tmp_path))
    crlf_text = pretrain_gpt_source("core_v0.16").replace("\n", "\r\n")
    crlf = make_checkout(tmp_path / "crlf", "core_v0.16", source=crlf_text)
    with pytest.raises(mp.PatchError, match="Windows line endings"):
        mp.apply(crlf)


def test_unknown_pinned_set_is_refused(tmp_path):
    root = make_checkout(tmp_path, "core_v0.16")
    with pytest.raises(mp.PatchError, match="patch set 'core_v0.99.x' not found .*available: core_v0.16.x, main"):
        mp.apply(root, release="core_v0.99.x", patches_dir=PATCHES)


def test_parse_rejects_malformed_patches():
    with pytest.raises(mp.PatchError, match="no hunks"):
        mp.parse_patch("just text\n")
    with pytest.raises(mp.PatchError, match="truncated hunk"):
        mp.parse_patch("--- a/x.py\n+++ b/x.py\n@@ -1,3 +1,4 @@\n a\n+b\n")


@pytest.mark.slow  # fast leg budget (tests/README.md): runs in `make test-slow` and in CI
def test_cli_exit_codes(tmp_path):
    root = make_checkout(tmp_path, "core_v0.18")
    tool = [sys.executable, os.path.join(REPO, "tools", "mechmon_patch.py")]

    def run(*args):
        return subprocess.run(tool + list(args) + [root], capture_output=True, text=True)

    assert run("status").returncode == mp.EXIT_NOT_APPLIED
    applied = run("apply")
    assert applied.returncode == 0, applied.stderr
    assert "pretrain_gpt.py: patched (Megatron-LM 0.18.2, located by content)" in applied.stdout
    assert run("check").returncode == mp.EXIT_APPLIED  # `check` is the old name of `status`
    assert run("revert").returncode == 0 and run("status").returncode == mp.EXIT_NOT_APPLIED
    with open(os.path.join(root, "pretrain_gpt.py"), "a") as f:
        f.write("pretrain(extra_args_provider=None)\n")  # a second provider call? no: outside __main__
    assert run("status").returncode == mp.EXIT_NOT_APPLIED
    with open(os.path.join(root, "pretrain_gpt.py"), "w") as f:
        f.write("import os\n")
    status = run("status")
    assert status.returncode == mp.EXIT_REFUSED and "__main__" in status.stdout
    refused = run("apply")
    assert refused.returncode == mp.EXIT_REFUSED and "refused" in refused.stderr and "pretrain_gpt.py" in refused.stderr


def test_patch_tool_imports_without_torch():
    """``mechmon-patch`` is a text tool: the adapter package loads its hooks (torch, megatron-core)
    only when they are used, so the console script starts without them."""
    code = ("import sys; import mechmon_megatron.adapters.megatron_lm.patch_tool; "
            "import mechmon_megatron.adapters.megatron_lm as adapter; adapter.install; "
            "print(sorted(m for m in ('torch', 'megatron.core') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHONPATH=REPO))
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr


# ---------------------------------------------------------------------------- a patched script that is a symlink
def test_symlinked_script_is_edited_where_it_lives_and_reverted(tmp_path):
    """A checkout whose pretrain_gpt.py links to a shared copy: the link stays a link, the file it
    points to is patched, and revert restores that file byte for byte."""
    root = make_checkout(tmp_path, "core_v0.18")
    shared = tmp_path / "shared"
    shared.mkdir()
    os.replace(os.path.join(root, "pretrain_gpt.py"), shared / "pretrain_gpt.py")
    os.symlink(shared / "pretrain_gpt.py", os.path.join(root, "pretrain_gpt.py"))
    original = (shared / "pretrain_gpt.py").read_bytes()
    assert mp.main(["apply", str(root)]) == 0
    assert os.path.islink(os.path.join(root, "pretrain_gpt.py"))
    assert anchors.IMPORT_LINE in (shared / "pretrain_gpt.py").read_text()
    assert mp.main(["revert", str(root)]) == 0
    assert os.path.islink(os.path.join(root, "pretrain_gpt.py"))
    assert (shared / "pretrain_gpt.py").read_bytes() == original
    assert sorted(os.listdir(shared)) == ["pretrain_gpt.py"]  # no temporary file left beside it


def test_a_file_that_cannot_be_written_is_one_line_and_nothing_changes(tmp_path, capsys):
    root = make_checkout(tmp_path, "core_v0.18")
    path = os.path.join(root, "pretrain_gpt.py")
    original = script(root)
    if subprocess.run(["chattr", "+i", path], capture_output=True).returncode != 0:
        os.chmod(root, 0o555)  # no chattr here: a read-only folder (refuses a non-root writer)
        if os.access(root, os.W_OK):
            os.chmod(root, 0o755)
            pytest.skip("neither chattr +i nor a read-only folder stops this user from writing")
    try:
        assert mp.main(["apply", str(root)]) == mp.EXIT_REFUSED
    finally:
        subprocess.run(["chattr", "-i", path], capture_output=True)
        os.chmod(root, 0o755)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("mechmon-patch: refused: pretrain_gpt.py: cannot write ") and "nothing was changed" in err
    assert script(root) == original
