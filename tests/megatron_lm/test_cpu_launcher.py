"""The CPU launcher of Megatron-LM runs (``python -m mechmon_megatron.testing.megatron_lm_cpu``).

``--launch patch``: a stand-in patched ``pretrain_gpt.py`` with stub ``megatron.training``
modules (the megatron-core wheel has no ``megatron.training``): the CPU layer is applied when the
script calls ``mechmon.install()``, after the script's own imports, and never by ``install()``
alone. The default ``--launch run`` (mechmon-run on CPU) is tested in ``test_run.py``.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("megatron.core")

STUBS = textwrap.dedent(
    """
    import sys, types
    training = types.ModuleType("megatron.training.training")
    for name in ("train_step", "post_training_step_callbacks", "save_checkpoint", "train",
                 "initialize_megatron", "get_model"):
        setattr(training, name, lambda *a, **k: None)
    utils = types.ModuleType("megatron.training.utils")
    utils.get_batch_on_this_tp_rank = lambda *a, **k: None
    global_vars = types.ModuleType("megatron.training.global_vars")
    global_vars.get_tensorboard_writer = lambda: None
    checkpointing = types.ModuleType("megatron.training.checkpointing")
    for name in ("generate_state_dict", "_load_global_dist_base_checkpoint"):
        setattr(checkpointing, name, lambda *a, **k: None)
    package = types.ModuleType("megatron.training")
    package.training, package.utils, package.global_vars = training, utils, global_vars
    package.checkpointing = checkpointing
    package.get_args = lambda: None
    sys.modules.update({"megatron.training": package, "megatron.training.training": training,
                        "megatron.training.utils": utils, "megatron.training.global_vars": global_vars,
                        "megatron.training.checkpointing": checkpointing})
    """
)

SCRIPT = STUBS + textwrap.dedent(
    """
    import torch
    from mechmon_megatron import megatron_lm as mechmon

    if __name__ == "__main__":
        assert type(torch).__name__ == "module"  # before install: the real torch
        mechmon.install()
        applied = sorted(getattr(sys.modules.get("mechmon_megatron.testing.megatron_lm_cpu"), "_applied", []))
        print("applied:", applied)
        print("script torch:", type(globals()["torch"]).__name__)
        print("args:", sys.argv[1:])
        sys.exit(42)
    """
)


def test_cpu_launcher_applies_the_cpu_layer_at_install(tmp_path):
    script = tmp_path / "pretrain_gpt.py"
    script.write_text(SCRIPT)
    proc = subprocess.run(
        [sys.executable, "-m", "mechmon_megatron.testing.megatron_lm_cpu", "--launch", "patch", str(script),
         "--train-iters", "3"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )
    assert proc.returncode == 42, proc.stdout + proc.stderr
    assert "allow-no-cuda" in proc.stdout and "training-cuda-proxy" in proc.stdout, proc.stdout
    assert "script torch: _TrainingCpuTorch" in proc.stdout  # the script's own torch global is proxied
    assert "args: ['--train-iters', '3']" in proc.stdout


def test_install_alone_applies_no_cpu_layer(tmp_path):
    script = tmp_path / "pretrain_gpt.py"
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 42, proc.stdout + proc.stderr
    assert "applied: []" in proc.stdout and "script torch: module" in proc.stdout


def test_unknown_launch_is_a_usage_error(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "mechmon_megatron.testing.megatron_lm_cpu", "--launch", "gpu", "x.py"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )
    assert proc.returncode == 2 and "--launch must be one of" in proc.stderr
