"""Kernel tests run the Triton kernels through the interpreter on CPU tensors.

TRITON_INTERPRET must be set before any kernel is decorated; the kernel modules import triton
lazily (on first forced-Triton call), so setting it here, at collection, is early enough.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _one_thread_and_seed():
    # The machine is shared: one intra-op thread keeps the suite from starving its neighbours.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    yield
    torch.set_num_threads(threads)
