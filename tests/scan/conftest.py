"""Session fixtures: the real checkpoint series, trained once per test session (tests/scan/series.py)."""

from __future__ import annotations

import pytest

from tests.scan import series as S


@pytest.fixture(scope="session")
def runs(tmp_path_factory):
    return tmp_path_factory.mktemp("scan_runs")


@pytest.fixture(scope="session")
def healthy(runs) -> S.Series:
    pytest.importorskip("megatron.core")
    return S.train_healthy(runs)


@pytest.fixture(scope="session")
def fault(runs, healthy) -> S.Series:
    return S.train_fault(runs, healthy)
