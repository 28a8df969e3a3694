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
