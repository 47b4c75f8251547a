"""vLLM on the CPU loads the generated qwen2 and smolvlm directories (dummy weights) and generates;
smolvlm with two images in one prompt. Both engines run in one subprocess, one after the other."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from orbitkv.models.make_model import ensure_models

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

SMOKE = Path(__file__).with_name("vllm_smoke.py")


@pytest.fixture(scope="module")
def rows(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    paths = ensure_models(tmp_path_factory.getbasetemp() / "orbitkv-tiny-models", ("qwen2", "smolvlm"))
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, str(SMOKE), *map(str, paths.values())],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    found = {}
    for line in proc.stdout.splitlines():
        if line.startswith("SMOKE "):
            row = json.loads(line[len("SMOKE ") :])
            found[row["arch"]] = row
    assert found, f"vLLM smoke produced no rows (rc={proc.returncode}):\n{proc.stderr[-4000:]}"
    return found


def test_qwen2_generates(rows: dict[str, dict]) -> None:
    row = rows["qwen2"]
    assert row["ok"], row.get("error")
    assert len(row["output_ids"]) == 4


def test_smolvlm_serves_two_images(rows: dict[str, dict]) -> None:
    row = rows["smolvlm"]
    assert row["ok"], row.get("error")
    assert row["image_tokens"] == 2 * 16
