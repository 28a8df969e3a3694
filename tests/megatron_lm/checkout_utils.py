"""Shared by the opt-in Megatron-LM tests: a runnable copy of a checkout, patched or not."""

from __future__ import annotations

import filecmp
import glob
import os
import shutil

from mechmon_megatron.adapters.megatron_lm import patch_tool as mp

SOURCES = ("megatron", "pretrain_gpt.py", "gpt_builders.py", "model_provider.py")


def copy_checkout(source: str, root: str, patch: bool = False) -> str:
    """Copy the sources pretrain_gpt.py needs (never the .git) to ``root``; ``patch``: apply our
    patch (the ``mechmon-patch`` way), else leave pretrain_gpt.py unmodified (``mechmon-run``)."""
    os.makedirs(root, exist_ok=True)
    for name in SOURCES:
        src = os.path.join(source, name)
        if os.path.exists(src):
            (shutil.copytree if os.path.isdir(src) else shutil.copy2)(src, os.path.join(root, name))
    if patch:
        mp.apply(root)
    _provide_dataset_helpers(root)
    return root


def copy_patched_checkout(source: str, root: str) -> str:
    return copy_checkout(source, root, patch=True)


def _provide_dataset_helpers(root: str) -> None:
    """Megatron builds megatron/core/datasets/helpers_cpp with make + pybind11 on start; reuse the
    installed megatron-core wheel's build when it was compiled from the same helpers.cpp (our CPU
    compat then skips make)."""
    target = os.path.join(root, "megatron", "core", "datasets")
    if glob.glob(os.path.join(target, "helpers_cpp*.so")):
        return
    try:
        import megatron.core.datasets as installed
    except ImportError:
        return
    source = os.path.dirname(installed.__file__)
    sources = [os.path.join(directory, "helpers.cpp") for directory in (source, target)]
    if not all(map(os.path.exists, sources)) or not filecmp.cmp(*sources, shallow=False):
        return
    for built in glob.glob(os.path.join(source, "helpers_cpp*.so")):
        shutil.copy2(built, target)
