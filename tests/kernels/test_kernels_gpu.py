"""Compiled Triton on a real GPU against the torch references (skipped without one).

``orbitkv check gpu --parts kernels`` does the comparison (``orbitkv_bench.checks.gpu_kernels``), in a
fresh process: the interpreter flag the other kernel tests set would otherwise turn these kernels
into interpreted ones.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


@pytest.mark.gpu
def test_compiled_triton_matches_torch():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "orbitkv.cli", "check", "gpu", "--json", "--device", "cuda",
           "--parts", "kernels"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    doc = json.loads(proc.stdout)
    kernels = doc["parts"]["kernels"]
    assert doc["is_gpu_figure"] and kernels["triton"] == "compiled"
    assert kernels["ok"], [r for r in kernels["rows"] if not r["ok"]]
