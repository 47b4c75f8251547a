"""Shared pytest set-up: opt-in suites, device gating, and a guard on torch's thread setting."""

from __future__ import annotations

import os

import pytest
import torch

# vLLM's CPU worker replaces ``torch.set_num_threads`` with a no-op for the whole process (it binds
# OpenMP threads itself). After an in-process engine, a later test could no longer choose its
# thread count and would silently run with another one: keep the real function and put it back.
_REAL_SET_NUM_THREADS = torch.set_num_threads

# The suite's engine tests compute a prompt once and check what a second request loads: they run
# with every computed chunk saved on first sight. The default policy (``save_admission:
# recurring``) is tested where it is named (tests/connector/test_save_admission.py, test_demo.py).
os.environ.setdefault("ORBITKV_SAVE_ADMISSION", "all")


@pytest.fixture(autouse=True)
def _restore_set_num_threads():
    yield
    if torch.set_num_threads is not _REAL_SET_NUM_THREADS:
        torch.set_num_threads = _REAL_SET_NUM_THREADS


@pytest.fixture
def real_set_num_threads():
    return _REAL_SET_NUM_THREADS


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    run_slow = os.environ.get("ORBITKV_SLOW") == "1" or "slow" in (config.getoption("-m") or "")
    has_cuda = torch.cuda.is_available()
    skip_slow = pytest.mark.skip(reason="slow suite: set ORBITKV_SLOW=1 or pass -m slow")
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "slow" in item.keywords and not run_slow:
            item.add_marker(skip_slow)
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)
