"""Runs the LMCache interop cases (``lmcache_interop_cases.py``) in their own interpreter.

LMCache 0.5.6's Redis connector imports numba, and with it llvmlite, whose ``ffi.lib`` object answers
any attribute (``__dict__`` included). vLLM 0.32's Triton-override scan walks every module namespace
when an engine starts and crashes on it, so an in-process engine started later in the same pytest
process would fail. The peer runs apart, as a real LMCache peer does; its verdict comes back here.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

CASES = Path(__file__).with_name("lmcache_interop_cases.py")


@pytest.mark.redis
def test_lmcache_interop_cases_pass_in_their_own_process() -> None:
    # Found, not imported: importing lmcache here would load numba into this process (above).
    if importlib.util.find_spec("lmcache") is None:
        pytest.skip("lmcache==0.5.6 is installed by `make venv`")
    env = {**os.environ, "PYTHONHASHSEED": os.environ.get("PYTHONHASHSEED", "0")}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(CASES)],
        cwd=CASES.parents[2],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, tail
    summary = re.search(r"(\d+) passed", proc.stdout)
    assert summary and int(summary.group(1)) >= 19, tail
    assert " failed" not in proc.stdout and " error" not in proc.stdout, tail
