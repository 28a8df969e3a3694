"""What ``pip install`` puts in a user's environment: the product wheel, built here and listed.

The wheel holds ``mechmon_megatron`` without its ``research`` and ``testing`` sub-packages (they
run from a checkout), ``null_tails.json``, the Megatron-LM patch files (as data under
``share/mechmon-megatron``) and nothing else: no top-level ``gpt_trainer``, which is the example
trainer's own distribution (``examples/pretrain_scripts/setup.py``, built and listed here too).
Both carry the one version number, ``mechmon_megatron.__version__``.

The wheels are built offline (``--no-build-isolation --no-index``: the venv's setuptools, pinned in
tools/requirements) from a copy of the files the builds read, so nothing is written into the
checkout and no stale ``build/`` folder of an earlier build can leak into the wheel. About 10 s.
"""

from __future__ import annotations

import email.parser
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import mechmon_megatron

pytest.importorskip("setuptools", minversion="70.1")  # bdist_wheel built in, as pyproject.toml asks

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mechmon_megatron"
EXAMPLES = ROOT / "examples" / "pretrain_scripts"
NOT_SHIPPED = ("research", "testing")
"""Sub-packages of mechmon_megatron that stay in the source tree."""
BUILD_INPUTS = ("setup.py", "pyproject.toml", "README.md", "mechmon_megatron", "patches",
                "examples/pretrain_scripts/setup.py", "examples/pretrain_scripts/gpt_trainer")
"""Everything setup.py and examples/pretrain_scripts/setup.py read."""
PRODUCT_SUBPACKAGES = ("monitors", "detect", "session", "adapters/megatron_core", "adapters/megatron_lm",
                       "adapters/deepspeed", "cli", "plan", "scan", "scan/readers", "supervise", "calibrate")
CONSOLE_SCRIPTS = ("mechmon-patch", "mechmon-run", "mechmon-plan", "mechmon-scan", "mechmon-supervise",
                   "mechmon-calibrate")


def _copy_build_inputs(dest: Path) -> Path:
    for rel in BUILD_INPUTS:
        src, dst = ROOT / rel, dest / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(src, dst)
    return dest


def _build_wheel(project: Path, out: Path) -> Path:
    out.mkdir(exist_ok=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "--disable-pip-version-check", "-q", "-w", str(out), str(project)],
        check=True, timeout=300, capture_output=True, text=True,
    )
    (wheel,) = out.glob("*.whl")
    return wheel


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> dict[str, Path]:
    """``{"product": wheel, "examples": wheel}``, built once for this module."""
    tmp = tmp_path_factory.mktemp("wheels")
    src = _copy_build_inputs(tmp / "src")
    return {"product": _build_wheel(src, tmp / "product"),
            "examples": _build_wheel(src / "examples" / "pretrain_scripts", tmp / "examples")}


def _names(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        return z.namelist()


def _metadata(wheel: Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as z:
        (meta,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        return email.parser.Parser().parsestr(z.read(meta).decode("utf-8"))


def _source_modules(root: Path, skip: tuple[str, ...] = ()) -> set[str]:
    """``.py`` files under ``root`` as wheel paths (relative to root's parent), minus ``skip`` folders."""
    found = set()
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if "__pycache__" in rel.parts or (rel.parts and rel.parts[0] in skip):
            continue
        found.add(path.relative_to(root.parent).as_posix())
    return found


def test_product_wheel_lists_the_product_and_nothing_else(wheels):
    names = _names(wheels["product"])
    version = mechmon_megatron.__version__
    dist, data = f"mechmon_megatron-{version}.dist-info", f"mechmon_megatron-{version}.data"
    assert {n.split("/")[0] for n in names} == {"mechmon_megatron", dist, data}
    assert not [n for n in names if n.startswith(("gpt_trainer/", *(f"mechmon_megatron/{s}/" for s in NOT_SHIPPED)))]

    shipped = {n for n in names if n.startswith("mechmon_megatron/") and n.endswith(".py")}
    assert shipped == _source_modules(PACKAGE, skip=NOT_SHIPPED)  # every product module, no other
    for sub in PRODUCT_SUBPACKAGES:
        assert f"mechmon_megatron/{sub}/__init__.py" in shipped, sub

    other = {n for n in names if n.startswith("mechmon_megatron/") and not n.endswith(".py")}
    # the shipped null tails and the supervisor's default policy: the product's only data files
    assert other == {"mechmon_megatron/detect/null_tails.json", "mechmon_megatron/supervise/default_policy.json"}
    patches = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "patches" / "megatron-lm").glob("*/*.patch"))
    assert patches and sorted(n.split("/share/mechmon-megatron/", 1)[1] for n in names
                              if n.startswith(data)) == patches


def test_wheel_version_is_the_package_version(wheels):
    for wheel in wheels.values():
        assert _metadata(wheel)["Version"] == mechmon_megatron.__version__, wheel.name
    assert _metadata(wheels["product"])["Name"] == "mechmon-megatron"


def test_product_wheel_declares_the_console_scripts(wheels):
    with zipfile.ZipFile(wheels["product"]) as z:
        (entry,) = [n for n in z.namelist() if n.endswith(".dist-info/entry_points.txt")]
        text = z.read(entry).decode("utf-8")
    for script in CONSOLE_SCRIPTS:
        assert f"{script} = mechmon_megatron." in text, script


def test_examples_wheel_holds_the_example_trainer_only(wheels):
    names = _names(wheels["examples"])
    version = mechmon_megatron.__version__
    assert {n.split("/")[0] for n in names} == {"gpt_trainer", f"mechmon_megatron_examples-{version}.dist-info"}
    assert {n for n in names if n.startswith("gpt_trainer/")} == _source_modules(EXAMPLES / "gpt_trainer")
    meta = _metadata(wheels["examples"])
    assert meta["Name"] == "mechmon-megatron-examples"
    assert f"mechmon-megatron=={version}" in meta.get_all("Requires-Dist")


def test_installed_product_wheel_imports_without_the_source_tree(wheels, tmp_path):
    """Installed alone (``--target``, first on the path), the product imports and finds its null
    tails, and research, testing and gpt_trainer are absent: nothing in it needs the checkout."""
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--no-compile", "-q",
         "--disable-pip-version-check", "--target", str(target), str(wheels["product"])],
        check=True, timeout=300, capture_output=True, text=True,
    )
    code = (
        "import importlib.util, sys\n"
        # A user's environment has no editable finders of this checkout: drop them.
        "sys.meta_path[:] = [f for f in sys.meta_path if not f.__module__.startswith('__editable__')]\n"
        "import mechmon_megatron\n"
        f"assert mechmon_megatron.__file__.startswith({str(target)!r}), mechmon_megatron.__file__\n"
        "import mechmon_megatron.monitors, mechmon_megatron.session.session, mechmon_megatron.cli.args\n"
        "import mechmon_megatron.plan.cli, mechmon_megatron.scan.cli\n"
        "from mechmon_megatron.detect import load_tail_table\n"
        "assert load_tail_table().tails  # the shipped null_tails.json\n"
        "for name in ('mechmon_megatron.research', 'mechmon_megatron.testing', 'gpt_trainer'):\n"
        "    assert importlib.util.find_spec(name) is None, name\n"
        "print(mechmon_megatron.__version__)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == mechmon_megatron.__version__
