"""The Megatron-LM patch tool on synthetic checkouts (Megatron-LM's own files are never committed).

A synthetic ``pretrain_gpt.py`` holds exactly the context lines each patch needs (taken from the
patch's own "before" side) at the line numbers the patch names, between filler lines.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mechmon_megatron.adapters.megatron_lm import patch_tool as mp

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PATCHES = os.path.join(REPO, "patches", "megatron-lm")
VERSIONS = {"core_v0.16.x": (0, 16, 1), "main": (0, 20, 0)}


def synthetic_original(release: str) -> str:
    """A file on which ``release``'s patch applies exactly as on the real pretrain_gpt.py."""
    lines: list[str] = []
    for patch in mp.load_patches(PATCHES, release):
        for hunk in patch.hunks:
            while len(lines) < hunk.old_start - 1:
                lines.append(f"filler_{len(lines) + 1} = None  # synthetic")
            lines.extend(hunk.old)
    lines.append("# end of synthetic pretrain_gpt.py")
    return "\n".join(lines) + "\n"


def make_tree(root, release: str = "core_v0.16.x", version=None) -> str:
    major, minor, patch = version or VERSIONS[release]
    info = root / "megatron" / "core"
    info.mkdir(parents=True)
    (info / "package_info.py").write_text(f'MAJOR = {major}\nMINOR = {minor}\nPATCH = {patch}\nPRE_RELEASE = ""\n')
    (root / "pretrain_gpt.py").write_text(synthetic_original(release))
    return str(root)


def snapshot(root) -> dict:
    return {p: open(os.path.join(dp, p), "rb").read() for dp, _, files in os.walk(root) for p in files}


@pytest.mark.parametrize("release", sorted(VERSIONS))
def test_apply_check_revert_round_trip(tmp_path, release):
    root = make_tree(tmp_path, release)
    original = (tmp_path / "pretrain_gpt.py").read_text()
    assert mp.check(root, patches_dir=PATCHES).overall == "not applied"

    report = mp.apply(root, patches_dir=PATCHES)
    assert report.release == release and report.changed == ["pretrain_gpt.py"]
    patched = (tmp_path / "pretrain_gpt.py").read_text()
    assert "mechmon.install()" in patched and "mechmon.extra_args_provider(" in patched
    assert "from mechmon_megatron import megatron_lm as mechmon" in patched
    assert mp.check(root, patches_dir=PATCHES).overall == "applied"

    assert mp.revert(root, patches_dir=PATCHES).changed == ["pretrain_gpt.py"]
    assert (tmp_path / "pretrain_gpt.py").read_text() == original


def test_apply_twice_changes_nothing(tmp_path):
    root = make_tree(tmp_path)
    mp.apply(root, patches_dir=PATCHES)
    before = snapshot(root)
    assert mp.apply(root, patches_dir=PATCHES).changed == []
    assert snapshot(root) == before
    assert mp.revert(root, patches_dir=PATCHES).changed == ["pretrain_gpt.py"]
    assert mp.revert(root, patches_dir=PATCHES).changed == []


def test_patch_tolerates_shifted_lines(tmp_path):
    root = make_tree(tmp_path)
    path = tmp_path / "pretrain_gpt.py"
    path.write_text("# a local comment at the top\n" * 7 + path.read_text())
    mp.apply(root, patches_dir=PATCHES)
    assert mp.check(root, patches_dir=PATCHES).overall == "applied"


def test_unknown_release_is_refused(tmp_path):
    root = make_tree(tmp_path, version=(0, 99, 0))
    before = snapshot(root)
    with pytest.raises(mp.PatchError, match=r"0\.99\.0 has no mechmon patch set .*--release"):
        mp.apply(root, patches_dir=PATCHES)
    assert snapshot(root) == before


def test_not_a_checkout_is_refused(tmp_path):
    with pytest.raises(mp.PatchError, match="not a Megatron-LM checkout"):
        mp.check(str(tmp_path), patches_dir=PATCHES)


def test_modified_file_is_refused_and_left_unchanged(tmp_path):
    root = make_tree(tmp_path)
    path = tmp_path / "pretrain_gpt.py"
    path.write_text(path.read_text().replace("        store=store,", "        store=my_store,"))
    before = snapshot(root)
    assert mp.check(root, patches_dir=PATCHES).overall == "modified"
    with pytest.raises(mp.PatchError, match="matches neither the original nor the patched"):
        mp.apply(root, patches_dir=PATCHES)
    with pytest.raises(mp.PatchError, match="matches neither"):
        mp.revert(root, patches_dir=PATCHES)
    assert snapshot(root) == before


def test_main_release_patch_does_not_fit_a_016_file(tmp_path):
    root = make_tree(tmp_path, "core_v0.16.x")
    assert mp.check(root, release="main", patches_dir=PATCHES).overall == "modified"


def test_parse_rejects_malformed_patches():
    with pytest.raises(mp.PatchError, match="no hunks"):
        mp.parse_patch("just text\n")
    with pytest.raises(mp.PatchError, match="truncated hunk"):
        mp.parse_patch("--- a/x.py\n+++ b/x.py\n@@ -1,3 +1,4 @@\n a\n+b\n")


def test_cli_exit_codes(tmp_path):
    root = make_tree(tmp_path)
    tool = [sys.executable, os.path.join(REPO, "tools", "mechmon_patch.py")]

    def run(*args):
        return subprocess.run(tool + list(args) + [root], capture_output=True, text=True)

    assert run("check").returncode == mp.EXIT_NOT_APPLIED
    applied = run("apply")
    assert applied.returncode == 0 and "pretrain_gpt.py: patched (core_v0.16.x)" in applied.stdout
    assert run("check").returncode == mp.EXIT_APPLIED
    assert run("revert").returncode == 0 and run("check").returncode == mp.EXIT_NOT_APPLIED
    (tmp_path / "megatron" / "core" / "package_info.py").write_text("MAJOR = 9\nMINOR = 9\nPATCH = 9\n")
    refused = run("apply")
    assert refused.returncode == mp.EXIT_REFUSED and "refused" in refused.stderr
