"""Run megatron-core on CPU (gloo) for tests and laptops: ``enable_cpu_compat()``.

megatron-core assumes CUDA in a handful of places on the code path of a small GPTModel trained
with the local (non-Transformer-Engine) layer spec, Megatron DDP, the Megatron optimizer and the
pipeline schedules. This module neutralises exactly those assumptions, and only when
``torch.cuda.is_available()`` is False. On a machine with a GPU it does nothing.

Design: no global monkey-patching of ``torch``. Where a megatron module allocates on
``device='cuda'`` or calls ``torch.cuda.*``, we replace *that module's* ``torch`` global with a
small proxy (:class:`_CpuTorch`) that maps the CUDA device to the CPU and turns CUDA-only calls
into their CPU equivalents. Everything else (your code, the monitors, torch itself) sees the real
``torch``. Every patch is feature-detected (module or attribute present) rather than pinned to a
megatron-core version, and is listed in :data:`PATCHES` with its reason.

Patches (see ``PATCHES`` for the exact module list):

1. ``cuda-device-proxy``: modules that call ``torch.cuda.current_device()`` or allocate with the
   literal ``device='cuda'`` (DDP grad buffers, global memory buffer, Router, rotary embedding,
   p2p shape buffers, optimizer scalars, grad-norm scratch tensors, schedules' token counters,
   TP all-gather buffers, dist_checkpointing's pre-save synchronize and flags) get a proxy
   ``torch`` whose ``cuda.current_device()`` is ``"cpu"``, whose tensor factories map ``'cuda'``
   to ``'cpu'``, and whose ``cuda.synchronize`` is a no-op (batched p2p synchronises after
   ``batch_isend_irecv``).
2. ``cpu-rng-tracker``: ``tensor_parallel.random`` keeps the tensor-parallel RNG states with the
   CUDA generator; on CPU the tracker forks the CPU default generator instead
   (``torch.cuda.{get,set}_rng_state, manual_seed`` -> ``torch.{get,set}_rng_state,
   manual_seed``). ``model_parallel_cuda_manual_seed`` therefore also (re)seeds the CPU
   generator with the data-parallel seed, as it seeds the CUDA generator on GPU.
3. ``clip-grad-type-check``: ``clip_grad_by_total_norm_fp32`` asserts
   ``grad.type() == 'torch.cuda.FloatTensor'``; replaced by the same in-place scaling with a
   dtype check instead of the CUDA type string.
4. ``te-general-gemm``: ``moe_utils`` references ``te_general_gemm`` that is only bound when
   Transformer Engine imports; bind it to ``None`` so the router falls back to ``torch.mm``.
5. ``torch-norm-sequence-parallel``: ``WrappedTorchNorm`` refuses ``sequence_parallel`` (apex and
   TE norms support it by tagging their parameters). We build the torch norm and tag its
   parameters with ``sequence_parallel = True``, so ``finalize_model_grads`` all-reduces their
   gradients over the tensor-parallel group exactly as for TE norms.
6. ``embedding-tie-cuda``: under pipeline parallelism ``LanguageModule.
   setup_embeddings_and_output_layer`` moves the tied embedding with ``weight.data.cuda()``
   before all-reducing it over the embedding group; during that one call ``Tensor.cuda`` returns
   the tensor unchanged.
7. ``optimizer-type-check``: the Float16 (bf16/fp16) and distributed optimizers sort their
   parameters by ``Tensor.type()`` against CUDA type names (``'torch.cuda.BFloat16Tensor'``) in
   their constructors and raise TypeError for CPU tensors; during those two constructors only, a
   CPU tensor's ``type()`` answers with the CUDA name.
8. ``cuda-stream-stub`` (megatron-core >= 0.19): DDP's ``start_grad_sync`` (in
   ``param_and_grad_buffer``, a module of patch 1) now asks ``torch.cuda.current_stream()`` for
   the stream that must wait on the weight-gradient events of a local CUDA-graph replay, before
   every gradient reduction, even when no CUDA graph is in use; on a machine without a driver this
   fails ("Found no NVIDIA driver", or "Torch not compiled with CUDA enabled" with a CPU build
   of torch) at the first step. The proxy's ``cuda.current_stream()`` returns a stream stand-in
   whose ``wait_event`` / ``wait_stream`` / ``synchronize`` are no-ops (CPU work is
   synchronous; no parameter carries a CUDA-graph event on CPU). Reported as applied when the
   installed ``start_grad_sync`` calls ``current_stream``; megatron-core 0.16 does not, and
   behaves exactly as before.

9. ``attention-head-dims``: multi-head latent attention builds its core attention with
   ``k_channels`` / ``v_channels`` (query/key and value head dims differ), which megatron-core's
   local ``DotProductAttention`` refuses in 0.16.1 and 0.19 (only Transformer Engine's takes
   them). The wrapper accepts both and sizes the output from ``v_channels``; the rest of the
   local forward already follows the tensors' shapes. Applied when the installed class lacks the
   argument.

Which release needs what (checked on the code paths of ``tests/megatron_core``, ``tests/session``,
``tests/deepspeed`` and ``python -m gpt_trainer``): megatron-core 0.16.1 (Python 3.11) needs 1-7 (and 9 for MLA);
0.19.2 (Python 3.12, torch's CUDA build on a machine without a GPU) needs 1-3 and 5-8 (and 9), and binds
``te_general_gemm`` itself (patch 4 is then skipped).

Not patched (unsupported on CPU, fail loudly): the alltoall/flex MoE token dispatchers (CUDA
streams), FSDP, CUDA graphs, Transformer Engine. Use ``--moe-token-dispatcher-type allgather``.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
from typing import Any, Callable

import torch

logger = logging.getLogger(__name__)

# Modules whose ``torch`` global is replaced by the CPU proxy (patch 1 and 2). A module that is
# absent in the installed megatron-core release is skipped.
CUDA_DEVICE_MODULES: tuple[str, ...] = (
    "megatron.core.utils",  # GlobalMemoryBuffer, local_multi_tensor_l2_norm
    "megatron.core.distributed.param_and_grad_buffer",  # DDP grad buffers
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.distributed.finalize_model_grads",
    "megatron.core.optimizer.optimizer",  # found_inf / scale scalars, state .cuda()
    "megatron.core.optimizer.clip_grads",  # grad-norm scratch tensors
    "megatron.core.pipeline_parallel.schedules",  # total_num_tokens counters
    "megatron.core.pipeline_parallel.p2p_communication",  # shape buffers, synchronize
    "megatron.core.tensor_parallel.mappings",  # all-gather output buffers
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.random",  # RNG tracker (patch 2)
    "megatron.core.transformer.moe.router",  # router weight / aux-loss scalars
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.transformer.transformer_layer",
    "megatron.core.transformer.attention",
    "megatron.core.transformer.utils",  # get_default_causal_mask
    # dist_checkpointing save/load: synchronize before preloading tensors, result flags
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.strategies.async_utils",
)

PATCHES: tuple[str, ...] = (
    "cuda-device-proxy",
    "cpu-rng-tracker",
    "clip-grad-type-check",
    "te-general-gemm",
    "torch-norm-sequence-parallel",
    "embedding-tie-cuda",
    "optimizer-type-check",
    "cuda-stream-stub",
)

_applied: list[str] = []


def _cpu_device(device: Any) -> Any:
    """Map a CUDA device spec ('cuda', 'cuda:0', torch.device('cuda'), an int) to 'cpu'."""
    if isinstance(device, int) and not isinstance(device, bool):
        return "cpu"
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


def _wrap_factory(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def factory(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return fn(*args, **kwargs)

    return factory


_FACTORIES = ("empty", "zeros", "ones", "full", "tensor", "arange", "rand", "randn", "empty_like",
              "zeros_like", "ones_like", "full_like")


class _CpuStream:
    """A CUDA stream stand-in on CPU: work is synchronous, so waiting and recording are no-ops."""

    def wait_event(self, event: Any) -> None:
        return None

    def wait_stream(self, stream: Any) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def record_event(self, event: Any = None) -> Any:
        return event


_CPU_STREAM = _CpuStream()


class _CpuCuda:
    """Stands in for ``torch.cuda`` inside a patched megatron module."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device() -> str:
        return "cpu"

    @staticmethod
    def synchronize(device: Any = None) -> None:
        return None

    # Patch 8 (megatron-core >= 0.19): DDP's start_grad_sync waits on the current stream for
    # CUDA-graph weight-gradient events before each gradient reduction.
    @staticmethod
    def current_stream(device: Any = None) -> _CpuStream:
        return _CPU_STREAM

    # CPU generator stands in for the CUDA generator (patch 2).
    get_rng_state = staticmethod(lambda device="cuda": torch.get_rng_state())
    set_rng_state = staticmethod(lambda new_state, device="cuda": torch.set_rng_state(new_state))
    manual_seed = staticmethod(lambda seed: torch.manual_seed(seed))


class _CpuTorch:
    """Stands in for the ``torch`` module inside a patched megatron module."""

    def __init__(self) -> None:
        self.cuda = _CpuCuda()
        for name in _FACTORIES:
            setattr(self, name, _wrap_factory(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _patch_device_modules() -> list[str]:
    return replace_module_torch(CUDA_DEVICE_MODULES, _CpuTorch())


def replace_module_torch(module_names, proxy) -> list[str]:
    """Point the module-level ``torch`` of each importable module at ``proxy`` (global torch untouched)."""
    patched = []
    for name in module_names:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if getattr(module, "torch", None) is torch:
            module.torch = proxy
            patched.append(name)
    return patched


def _patch_rng_tracker() -> bool:
    from megatron.core.tensor_parallel import random as tp_random

    if not hasattr(tp_random, "_set_cuda_rng_state"):
        return False

    def _get_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False):
        state = torch.get_rng_state()
        return state.clone() if clone else state

    def _set_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False):
        torch.set_rng_state(new_state)

    tp_random._get_cuda_rng_state = _get_state
    tp_random._set_cuda_rng_state = _set_state
    return True


def _clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """CPU twin of megatron's ``clip_grad_by_total_norm_fp32`` (scales grads in place)."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr).detach() for p in parameters if getattr(p, attr, None) is not None]
    for grad in grads:
        assert grad.dtype in (torch.float32, torch.bfloat16), grad.dtype
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        for grad in grads:
            grad.mul_(clip_coeff)


def _patch_clip_grad() -> bool:
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as mc_optimizer

    patched = False
    for module in (clip_grads, mc_optimizer):
        if hasattr(module, "clip_grad_by_total_norm_fp32"):
            module.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32
            patched = True
    return patched


def _patch_te_general_gemm() -> bool:
    from megatron.core.transformer.moe import moe_utils

    if hasattr(moe_utils, "te_general_gemm"):
        return False
    moe_utils.te_general_gemm = None
    return True


def _patch_torch_norm() -> bool:
    try:
        from megatron.core.transformer import torch_norm
    except ImportError:
        return False
    wrapped = getattr(torch_norm, "WrappedTorchNorm", None)
    if wrapped is None or getattr(wrapped.__new__, "_mechmon_cpu", False):
        return False
    original_new = wrapped.__new__

    def __new__(cls, config, hidden_size, eps=1e-5, *args, **kwargs):
        if not config.sequence_parallel:
            return original_new(cls, config, hidden_size, eps, *args, **kwargs)
        config.sequence_parallel = False
        try:
            norm = original_new(cls, config, hidden_size, eps, *args, **kwargs)
        finally:
            config.sequence_parallel = True
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    __new__._mechmon_cpu = True
    wrapped.__new__ = __new__
    return True


def _patch_embedding_tie() -> bool:
    try:
        from megatron.core.models.common.language_module.language_module import LanguageModule
    except ImportError:
        return False
    original = getattr(LanguageModule, "setup_embeddings_and_output_layer", None)
    if original is None or getattr(original, "_mechmon_cpu", False):
        return False

    @functools.wraps(original)
    def setup_embeddings_and_output_layer(self, *args, **kwargs):
        tensor_cuda = torch.Tensor.cuda
        torch.Tensor.cuda = lambda tensor, *a, **k: tensor
        try:
            return original(self, *args, **kwargs)
        finally:
            torch.Tensor.cuda = tensor_cuda

    setup_embeddings_and_output_layer._mechmon_cpu = True
    LanguageModule.setup_embeddings_and_output_layer = setup_embeddings_and_output_layer
    return True


def _patch_optimizer_type_check() -> bool:
    classes = []
    for module, name in (("megatron.core.optimizer.optimizer", "Float16OptimizerWithFloat16Params"),
                         ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer")):
        try:
            classes.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            continue
    real_type = torch.Tensor.type

    def cuda_type_name(tensor, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs and tensor.device.type == "cpu":
            return real_type(tensor).replace("torch.", "torch.cuda.", 1)
        return real_type(tensor, dtype, non_blocking, **kwargs)

    patched = False
    for cls in classes:
        original = cls.__init__
        if getattr(original, "_mechmon_cpu", False):
            continue

        @functools.wraps(original)
        def __init__(self, *args, _original=original, **kwargs):
            torch.Tensor.type = cuda_type_name
            try:
                _original(self, *args, **kwargs)
            finally:
                torch.Tensor.type = real_type

        __init__._mechmon_cpu = True
        cls.__init__ = __init__
        patched = True
    return patched


def _uses_cuda_current_stream() -> bool:
    """Patch 8 is in the proxy; report it when the proxied DDP bucket group calls current_stream."""
    try:
        from megatron.core.distributed import param_and_grad_buffer
    except ImportError:
        return False
    group = getattr(param_and_grad_buffer, "_ParamAndGradBucketGroup", None)
    code = getattr(getattr(group, "start_grad_sync", None), "__code__", None)
    return (code is not None and "current_stream" in code.co_names
            and isinstance(getattr(param_and_grad_buffer, "torch", None), _CpuTorch))


def _patch_attention_head_dims() -> bool:
    """Patch 9: let the local ``DotProductAttention`` take MLA's ``k_channels`` / ``v_channels``.

    ``MultiLatentAttention`` builds its core attention with ``k_channels`` (the query/key head dim
    ``qk_head_dim + qk_pos_emb_head_dim``) and ``v_channels`` (``v_head_dim``), which only
    Transformer Engine's attention accepts; the local one raises TypeError. Its forward works from
    the tensors' shapes except for the output width, ``hidden_size_per_partition`` (``kv_channels``
    heads): the wrapper takes both arguments and sets that width from ``v_channels``. MLA passes
    its own ``softmax_scale`` (``1 / sqrt(k_channels)``, or the YaRN-scaled one), so the default
    scale from ``kv_channels`` is never used there.
    """
    try:
        from megatron.core.transformer import dot_product_attention as dpa
    except ImportError:
        return False
    cls = dpa.DotProductAttention
    original = cls.__init__
    if "k_channels" in inspect.signature(original).parameters or getattr(original, "_mechmon_cpu", False):
        return False

    @functools.wraps(original)
    def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
        original(self, *args, **kwargs)
        if v_channels is not None:
            self.hidden_size_per_partition = int(v_channels) * self.num_attention_heads_per_partition

    __init__._mechmon_cpu = True  # type: ignore[attr-defined]
    cls.__init__ = __init__
    return True


def enable_cpu_compat() -> list[str]:
    """Apply the CPU patches once (idempotent); no-op when CUDA is available.

    Call before building the model. Returns the names of the patches applied so far.
    """
    if torch.cuda.is_available():
        return []
    if _applied:
        return list(_applied)
    modules = _patch_device_modules()
    if modules:
        _applied.append("cuda-device-proxy")
        logger.info("cpu compat: cuda-device-proxy on %d modules: %s", len(modules), modules)
    for name, fn in (
        ("cpu-rng-tracker", _patch_rng_tracker),
        ("clip-grad-type-check", _patch_clip_grad),
        ("te-general-gemm", _patch_te_general_gemm),
        ("torch-norm-sequence-parallel", _patch_torch_norm),
        ("embedding-tie-cuda", _patch_embedding_tie),
        ("optimizer-type-check", _patch_optimizer_type_check),
        ("cuda-stream-stub", _uses_cuda_current_stream),
        ("attention-head-dims", _patch_attention_head_dims),
    ):
        if fn():
            _applied.append(name)
            logger.info("cpu compat: applied %s", name)
    return list(_applied)
