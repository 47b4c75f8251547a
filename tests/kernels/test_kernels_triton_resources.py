"""Every Triton launch configuration fits the shared memory of the GPUs vLLM serves on.

Compiled ahead of time for sm_80 and sm_90 with Triton's own ``ptxas``, so no GPU is needed. The
fused load's patch loop once asked 260 KiB for MLA rows (an H200 refused it at launch, 227 KiB);
the limit here is the smallest of the targets (sm_86/sm_89 consumer parts: 99 KiB per block).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SMALLEST_SHARED_NBYTES = 99 * 1024


def _has_ptxas() -> bool:
    try:
        import triton
    except ImportError:
        return False
    return (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists()


@pytest.mark.skipif(not _has_ptxas(), reason="Triton's NVIDIA backend (ptxas) is not installed")
def test_every_launch_fits_shared_memory():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    script = Path(__file__).with_name("triton_shared_memory.py")
    proc = subprocess.run([sys.executable, str(script), "80", "90"], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {r["case"] for r in rows} >= {"load D=576 patched", "load D=128 patched", "apply_patch"}
    over = [r for r in rows if r["shared_nbytes"] > SMALLEST_SHARED_NBYTES]
    assert not over, over
