"""Compiled Triton on a real GPU (skipped without one; see kernels_gpu_check.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.gpu
def test_compiled_triton_matches_torch():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("kernels_gpu_check.py")
    proc = subprocess.run([sys.executable, str(script)], env=env, cwd=script.parent,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
