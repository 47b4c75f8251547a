"""vLLM's CPU attention on AMX machines: a process whose first forward is a short prompt completes.

vLLM 0.32 runs AMX tile instructions without asking Linux for the tile state; before OrbitKV's
plugin asks (``kernels/paged_amx.request_amx_permission``), such a process died of SIGILL (exit
132), with or without a KV connector. On a CPU without AMX the engine takes the vec ISA and this
only checks that the plugin's request is harmless there."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.vllm

CHILD = textwrap.dedent(
    """
    import os, sys
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    llm = LLM(model=sys.argv[1], dtype="bfloat16", block_size=32, max_model_len=256,
              enforce_eager=True, num_gpu_blocks_override=12, gpu_memory_utilization=0.3)
    out = llm.generate([{"prompt_token_ids": [100, 101, 102]}], SamplingParams(max_tokens=2, temperature=0))
    print("tokens", list(out[0].outputs[0].token_ids))
    """
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from orbitkv.models.make_model import make_model

    return make_model(tmp_path_factory.mktemp("model") / "qwen2", "qwen2")


def test_a_short_first_prompt_completes_without_a_connector(model_dir):
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(model_dir)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr[-3000:]}"
    assert "tokens [" in proc.stdout
