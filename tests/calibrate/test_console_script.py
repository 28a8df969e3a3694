"""``mechmon-calibrate`` is a console script of the product: setup.py declares it, it resolves to
``calibrate.cli.main``, and the room ships in the wheel (it is not under ``research``)."""

from __future__ import annotations

import ast
import importlib.metadata
import subprocess
import sys
from pathlib import Path

from mechmon_megatron.calibrate import cli

ROOT = Path(__file__).resolve().parents[2]


def _declared_scripts() -> dict[str, str]:
    """``console_scripts`` of setup.py, read from its source (the installed metadata of an editable
    checkout can predate a new script)."""
    for node in ast.walk(ast.parse((ROOT / "setup.py").read_text(encoding="utf-8"))):
        if isinstance(node, ast.keyword) and node.arg == "entry_points":
            scripts = ast.literal_eval(node.value)["console_scripts"]
            return dict(s.replace(" ", "").split("=", 1) for s in scripts)
    raise AssertionError("setup.py declares no entry_points")


def test_the_console_script_resolves_to_the_cli():
    value = _declared_scripts()["mechmon-calibrate"]
    entry = importlib.metadata.EntryPoint(name="mechmon-calibrate", value=value, group="console_scripts")
    assert entry.load() is cli.main
    installed = [e for e in importlib.metadata.entry_points(group="console_scripts") if e.name == "mechmon-calibrate"]
    for e in installed:  # present once the checkout is reinstalled (make venv): the same target
        assert e.value.replace(" ", "") == value


def test_the_calibrate_room_is_in_the_wheel_package_list():
    """setup.py's own ``find_packages(...)`` call, evaluated on this tree."""
    from setuptools import find_packages

    (call,) = [node for node in ast.walk(ast.parse((ROOT / "setup.py").read_text(encoding="utf-8")))
               if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "find_packages"]
    kwargs = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
    assert "mechmon_megatron.calibrate" in find_packages(str(ROOT), **kwargs)


def test_help_runs_as_a_module():
    done = subprocess.run([sys.executable, "-m", "mechmon_megatron.calibrate", "--help"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.startswith("usage: mechmon-calibrate")
    assert "--leave-one-out" in done.stdout and "--force" in done.stdout
