"""Shared pytest configuration: markers and the opt-in switch for slow tests."""

import os

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: long-running test; run with MECHMON_SLOW=1 (make test-slow)")
    config.addinivalue_line("markers", "distributed: launches several processes with torchrun (gloo)")


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    if os.environ.get("MECHMON_SLOW") == "1":
        return
    skip_slow = pytest.mark.skip(reason="slow test: set MECHMON_SLOW=1 or run `make test-slow`")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip_slow)


@pytest.fixture(scope="module")
def model_parallel():
    """A one-process gloo group with megatron-core's parallel state (CPU compat applied)."""
    pytest.importorskip("megatron.core")
    import socket

    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from mechmon_megatron.testing.cpu_megatron import enable_cpu_compat

    enable_cpu_compat()
    created = not dist.is_initialized()
    if created:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(1234)
    yield
    parallel_state.destroy_model_parallel()
    if created:
        dist.destroy_process_group()
