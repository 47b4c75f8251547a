"""Kernel tests run the Triton kernels through the interpreter on CPU tensors.

TRITON_INTERPRET must be set before any kernel is decorated; the kernel modules import triton
lazily (on first forced-Triton call), so setting it here, at collection, is early enough.

Intra-op threads: ``ORBITKV_TEST_THREADS`` (default 1; ``all`` for every core). The claims here
(fast path == reference, byte for byte) must hold at any count, so CI runs this folder twice.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


def test_threads() -> int:
    value = os.environ.get("ORBITKV_TEST_THREADS", "1").strip().lower()
    if value == "all":
        return len(os.sched_getaffinity(0))
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"ORBITKV_TEST_THREADS: expected a positive int or 'all', got {value!r}")
    return int(value)


test_threads.__test__ = False  # a helper, not a test


@pytest.fixture(autouse=True)
def _threads_and_seed(real_set_num_threads):
    threads = torch.get_num_threads()
    real_set_num_threads(test_threads())
    torch.manual_seed(0)
    yield
    real_set_num_threads(threads)


@pytest.fixture(scope="session")
def bindings(tmp_path_factory):
    """The native library as each binding loads it: ``[module, ctypes]`` (the module only where
    this Python has headers), built afresh once for the session."""
    from orbitkv.kernels import native

    libs = []
    if native.python_include() is not None:
        libs.append(native._load(native.build(tmp_path_factory.mktemp("module"))))
    saved = native.python_include
    native.python_include = lambda: None
    try:
        libs.append(native._load(native.build(tmp_path_factory.mktemp("plain"))))
    finally:
        native.python_include = saved
    return libs
