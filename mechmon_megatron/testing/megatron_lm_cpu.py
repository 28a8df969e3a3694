"""Run Megatron-LM's own training loop on CPU (gloo): tests and laptops only.

    python -m mechmon_megatron.testing.megatron_lm_cpu [--launch run|patch] pretrain_gpt.py <flags>
    torchrun --nproc-per-node 2 -m mechmon_megatron.testing.megatron_lm_cpu pretrain_gpt.py ...

``--launch run`` (the default) is ``mechmon-run`` on CPU: an unmodified (or patched)
``pretrain_gpt.py`` runs through :func:`mechmon_megatron.adapters.megatron_lm.run.main`, which
installs the hooks and the ``--mechmon*`` flags, and the CPU layer below is applied at its
``on_enter`` point (the script's first ``parse_args`` / ``parse_and_validate_args`` /
``pretrain`` call: after its imports, before Megatron initialises) or at the script's own
``mechmon.install()``, whichever comes first. ``--launch patch`` runs a patched script as
``python pretrain_gpt.py`` would, with the CPU layer applied at its ``mechmon.install()`` only
(the patch path without any help of mechmon-run). This is the explicit opt-in of the CPU
launchers (``examples/pretrain_scripts/pretrain_gpt_mechmon.sh`` without a GPU,
``tests/megatron_lm``): the product adapter never applies it (``mechmon-run`` has no CPU mode;
the dependency goes from this testing module to the product, never back).

``enable_megatron_lm_cpu_compat()`` first applies megatron-core's CPU layer
(:func:`mechmon_megatron.testing.cpu_megatron.enable_cpu_compat`), then neutralises the CUDA
assumptions met on the code path of ``pretrain_gpt.py --transformer-impl local
--distributed-backend gloo --mock-data`` in ``megatron.training`` (checked on core_v0.16.1).
Every patch is feature-detected and listed in ``PATCHES``; nothing happens when CUDA is
available. Never use this for real training.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import os
import runpy
import sys
from types import SimpleNamespace
from typing import Any

import torch

from mechmon_megatron.testing.cpu_megatron import _CpuCuda, _CpuTorch, enable_cpu_compat

logger = logging.getLogger(__name__)

PATCHES: tuple[str, ...] = (
    "allow-no-cuda",  # initialize_megatron asserts torch.cuda.is_available()
    "no-fused-kernels",  # fused_kernels.load compiles CUDA extensions
    "training-cuda-proxy",  # torch.cuda.* and device='cuda' in megatron.training modules
    "prebuilt-dataset-helpers",  # skip `make` of helpers_cpp when an importable build exists
    "get-model-stays-on-cpu",  # get_model (and 0.19's model builders) call model_module.cuda(...)
    "batch-stays-on-cpu",  # get_batch_on_this_tp_rank / the script's get_batch call Tensor.cuda()
)

# megatron.training modules whose ``torch`` global gets the CPU proxy (device='cuda' factories,
# torch.cuda.current_device / synchronize / memory queries).
TRAINING_CUDA_MODULES: tuple[str, ...] = (
    "megatron.training.training",
    "megatron.training.initialize",
    "megatron.training.utils",
    "megatron.training.utils.common_utils",  # megatron-core 0.19: utils became a package
    "megatron.training.utils.utils",
    "megatron.training.checkpointing",
    "megatron.training.theoretical_memory_usage",
    "megatron.training.async_utils",
    "megatron.training.models.dist_utils",  # megatron-core 0.19's model builders (DDP stream)
    "megatron.core.timers",  # cross-rank timer min/max buffers
    "megatron.core.rerun_state_machine",
    "megatron.core.energy_monitor",
    "megatron.core.datasets.blended_megatron_dataset_builder",
    "megatron.core.transformer.moe.experts",
    "pretrain_gpt",
    "__main__",
)

_applied: list[str] = []


class _NullStream:
    """Stands in for ``torch.cuda.Stream`` (CPU work is synchronous)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _TrainingCpuCuda(_CpuCuda):
    """``torch.cuda`` inside megatron.training: one pretend device, memory queries return 0."""

    device_count = staticmethod(lambda: 1)  # initialize builds the model-parallel groups only then
    set_device = staticmethod(lambda device: None)
    empty_cache = staticmethod(lambda: None)
    reset_peak_memory_stats = staticmethod(lambda device=None: None)
    memory_allocated = staticmethod(lambda device=None: 0)
    max_memory_allocated = staticmethod(lambda device=None: 0)
    memory_reserved = staticmethod(lambda device=None: 0)
    max_memory_reserved = staticmethod(lambda device=None: 0)
    memory_stats = staticmethod(lambda device=None: {})
    mem_get_info = staticmethod(lambda device=None: (0, 0))
    # megatron-core 0.19 asks the architecture when validating TP / CP arguments: pre-Hopper.
    get_device_properties = staticmethod(lambda device=None: SimpleNamespace(major=0, minor=0, name="cpu"))
    Stream = _NullStream
    current_stream = staticmethod(lambda device=None: _NullStream())
    stream = staticmethod(lambda stream: contextlib.nullcontext())


class _TrainingCpuTorch(_CpuTorch):
    def __init__(self) -> None:
        super().__init__()
        self.cuda = _TrainingCpuCuda()


def _patch_initialize_megatron() -> bool:
    training = importlib.import_module("megatron.training.training")
    original = getattr(training, "initialize_megatron", None)
    if original is None or getattr(original, "_mechmon_cpu", False):
        return False

    @functools.wraps(original)
    def initialize_megatron(*args: Any, **kwargs: Any):
        kwargs["allow_no_cuda"] = True
        return original(*args, **kwargs)

    initialize_megatron._mechmon_cpu = True
    training.initialize_megatron = initialize_megatron
    return True


def _patch_fused_kernels() -> bool:
    try:
        fused_kernels = importlib.import_module("megatron.legacy.fused_kernels")
    except ImportError:
        return False
    fused_kernels.load = lambda args: None
    return True


# Functions that build model chunks and move them with ``Module.cuda(...)``: (module, name).
MODEL_BUILDERS: tuple[tuple[str, str], ...] = (
    ("megatron.training.training", "get_model"),  # core_v0.16 and later
    ("megatron.training.models.dist_utils", "prepare_existing_model_chunks_for_distributed_training"),  # 0.19
)


def _keep_model_on_cpu(module_name: str, name: str) -> bool:
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return False
    original = getattr(module, name, None)
    if original is None or getattr(original, "_mechmon_cpu", False):
        return False
    setattr(module, name, _cuda_is_identity(original, torch.nn.Module))
    return True


def _patch_get_model() -> bool:
    return any([_keep_model_on_cpu(module, name) for module, name in MODEL_BUILDERS])


def _cuda_is_identity(original: Any, owner: type) -> Any:
    """``original`` with ``owner.cuda`` (``torch.nn.Module`` or ``torch.Tensor``) returning its
    object unchanged while it runs."""

    @functools.wraps(original)
    def wrapped(*args: Any, **kwargs: Any):
        cuda = owner.cuda
        owner.cuda = lambda obj, *a, **k: obj
        try:
            return original(*args, **kwargs)
        finally:
            owner.cuda = cuda

    wrapped._mechmon_cpu = True
    return wrapped


SCRIPT_MODULES = ("pretrain_gpt", "__main__")


def _patch_get_batch() -> bool:
    """Batches move with ``tensor.cuda(non_blocking=True)``: in ``get_batch_on_this_tp_rank``
    (imported by name into the script) and, from core_v0.19, in the script's own ``get_batch``.
    Both become CPU identities."""
    utils = importlib.import_module("megatron.training.utils")
    original = getattr(utils, "get_batch_on_this_tp_rank", None)
    patched = False
    if original is not None and not getattr(original, "_mechmon_cpu", False):
        wrapped = _cuda_is_identity(original, torch.Tensor)
        utils.get_batch_on_this_tp_rank = wrapped
        for name in ("megatron.training.utils", *SCRIPT_MODULES):
            module = sys.modules.get(name)
            if module is not None and getattr(module, "get_batch_on_this_tp_rank", None) is original:
                module.get_batch_on_this_tp_rank = wrapped
        patched = True
    for name in SCRIPT_MODULES:
        module = sys.modules.get(name)
        script_get_batch = getattr(module, "get_batch", None) if module is not None else None
        if callable(script_get_batch) and not getattr(script_get_batch, "_mechmon_cpu", False):
            module.get_batch = _cuda_is_identity(script_get_batch, torch.Tensor)
            patched = True
    return patched


def _patch_compile_helpers() -> bool:
    """Megatron runs ``make`` for the dataset helpers on every start; skip it when a build of
    ``helpers_cpp`` for this interpreter is already importable (e.g. the megatron-core wheel's)."""
    try:
        utils = importlib.import_module("megatron.core.datasets.utils")
        importlib.import_module("megatron.core.datasets.helpers_cpp")
    except ImportError:
        return False
    original = getattr(utils, "compile_helpers", None)
    if original is None:
        return False
    utils.compile_helpers = lambda: None
    return True


def _patch_training_modules() -> list[str]:
    from mechmon_megatron.testing.cpu_megatron import replace_module_torch

    return replace_module_torch(TRAINING_CUDA_MODULES, _TrainingCpuTorch())


def enable_megatron_lm_cpu_compat() -> list[str]:
    """Apply megatron-core's and Megatron-LM's CPU patches once; no-op with CUDA."""
    if torch.cuda.is_available():
        return []
    if _applied:
        return list(_applied)
    _applied.extend(enable_cpu_compat())
    if _patch_initialize_megatron():
        _applied.append("allow-no-cuda")
    if _patch_fused_kernels():
        _applied.append("no-fused-kernels")
    if _patch_get_model():
        _applied.append("get-model-stays-on-cpu")
    if _patch_get_batch():
        _applied.append("batch-stays-on-cpu")
    if _patch_compile_helpers():
        _applied.append("prebuilt-dataset-helpers")
    modules = _patch_training_modules()
    if modules:
        _applied.append("training-cuda-proxy")
        logger.info("megatron-lm cpu compat: cuda proxy on %s", modules)
    return list(_applied)


def _enable_on_install() -> None:
    """Make ``mechmon.install()`` (the patched script's call) apply the CPU layer first."""
    import mechmon_megatron.megatron_lm as alias
    from mechmon_megatron.adapters import megatron_lm as adapter

    original = adapter.install

    @functools.wraps(original)
    def install(*args: Any, **kwargs: Any):
        enable_megatron_lm_cpu_compat()
        return original(*args, **kwargs)

    alias.install = adapter.install = install


LAUNCHES = ("run", "patch")
USAGE = "usage: python -m mechmon_megatron.testing.megatron_lm_cpu [--launch run|patch] pretrain_gpt.py [ARGS...]"


def main(argv: Any = None) -> None:
    """Run ``SCRIPT ARGS...`` as ``__main__`` on CPU (see the module docstring for ``--launch``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    launch = "run"
    if argv and (argv[0] == "--launch" or argv[0].startswith("--launch=")):
        value = argv[0].partition("=")[2] if "=" in argv[0] else (argv[1] if len(argv) > 1 else "")
        argv = argv[1:] if "=" in argv[0] else argv[2:]
        if value not in LAUNCHES:
            print(f"{USAGE}\nerror: --launch must be one of {LAUNCHES}, got {value!r}", file=sys.stderr)
            raise SystemExit(2)
        launch = value
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        raise SystemExit(0 if argv else 2)
    _enable_on_install()
    if launch == "run":
        from mechmon_megatron.adapters.megatron_lm import run

        raise SystemExit(run.main(argv, on_enter=enable_megatron_lm_cpu_compat))
    script = os.path.abspath(argv[0])
    sys.argv = [script, *argv[1:]]
    sys.path.insert(0, os.path.dirname(script))  # as `python SCRIPT` does
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":  # run the imported module, so its state is the one install() sees
    from mechmon_megatron.testing import megatron_lm_cpu

    megatron_lm_cpu.main()
