"""The README's commands, run as written: the CPU ``vllm`` server line with OrbitKV on a tiny model."""

from __future__ import annotations

import json
import re
import shlex
import time
import urllib.request
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_command(marker: str) -> list[str]:
    """The bash block of the README whose command contains ``marker``, as argv."""
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S)
    (block,) = [b for b in blocks if marker in b]
    return shlex.split(block.replace("\\\n", " "))


def test_readme_cpu_command_is_the_server_module_with_the_connector():
    argv = readme_command("vllm.entrypoints.openai.api_server")
    assert argv[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"]
    ktc = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert ktc["kv_connector"] == "OrbitKVConnector" and ktc["kv_load_failure_policy"] == "recompute"
    from orbitkv.config import OrbitKVConfig

    OrbitKVConfig.from_kv_connector_extra_config(ktc["kv_connector_extra_config"])  # valid keys
    from orbitkv.serving.encoder_cache import ec_transfer_config
    from orbitkv.serving.server_process import SCHEDULER_CLS

    assert argv[argv.index("--scheduler-cls") + 1] == SCHEDULER_CLS
    assert json.loads(argv[argv.index("--ec-transfer-config") + 1]) == ec_transfer_config()


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


@pytest.mark.vllm
def test_readme_cpu_server_line_runs_and_reuses(tmp_path):
    """The README's line, with MODEL and the store directory filled in, serves a repeated prompt
    from OrbitKV's store (exact chunks), as its response's kv_transfer_params say. The model has
    a vision encoder (SmolVLM): vLLM takes the line's encoder-cache connector only there."""
    import sys

    from orbitkv.models.make_model import make_model
    from orbitkv.serving.server_process import VLLMServer, free_port, vllm_env

    model_dir = make_model(tmp_path / "smolvlm", "smolvlm")
    argv = readme_command("vllm.entrypoints.openai.api_server")
    argv[0] = sys.executable
    argv[argv.index("MODEL")] = str(model_dir)
    i = argv.index("--kv-transfer-config") + 1
    argv[i] = argv[i].replace("/var/cache/orbitkv", str(tmp_path / "store"))
    port = free_port()
    # Test-only flags after the README's: a port, a small model length, and vLLM's own prefix
    # cache off, so that what the third request reuses can only come from OrbitKV's store.
    argv += ["--port", str(port), "--max-model-len", "512", "--enforce-eager",
             "--block-size", "32", "--disable-uvicorn-access-log", "--no-enable-prefix-caching"]
    # Dev mode for /reset_encoder_cache: vLLM's own encoder cache would otherwise serve the image.
    server = VLLMServer(argv, port, tmp_path / "server.log",
                        env=vllm_env(1.0, {"VLLM_SERVER_DEV_MODE": "1"}), startup_timeout_s=300)
    prompt = [10 + (7 * i) % 900 for i in range(200)]  # token ids
    body = {"model": str(model_dir), "prompt": prompt, "max_tokens": 2, "temperature": 0.0}
    from orbitkv.agent.workload import image_data_url

    image = {"type": "image_url", "image_url": {"url": image_data_url(7, 1)}}

    def chat(text: str) -> dict:
        content = [{"type": "text", "text": text}, image]
        return {"model": str(model_dir), "messages": [{"role": "user", "content": content}],
                "max_tokens": 2, "temperature": 0.0,
                # exact reuse only: the image behind new text is computed again, its encoder not
                "kv_transfer_params": {"orbitkv": {"modes": ["exact"]}}}

    with server:
        first = _post(f"{server.base_url}/v1/completions", body)
        # Another prompt in between, so vLLM's own prefix cache is not what serves the third.
        second = _post(f"{server.base_url}/v1/completions", {**body, "prompt": [5] + prompt})
        third = _post(f"{server.base_url}/v1/completions", body)
        seen = _post(f"{server.base_url}/v1/chat/completions", chat("Look at this."))
        # The image's encoder output reached the store's disk tier, which the scheduler (in
        # another process than the worker, vLLM's default layout here) reads.
        time.sleep(1.0)
        with urllib.request.urlopen(urllib.request.Request(
                f"{server.base_url}/reset_encoder_cache", method="POST"), timeout=60) as resp:
            assert resp.status == 200
        again = _post(f"{server.base_url}/v1/chat/completions", chat("Now look again, closely."))
    assert first["kv_transfer_params"]["orbitkv"]["num_saved_chunks"] > 0
    assert second["choices"][0]["text"] is not None
    reused = third["kv_transfer_params"]["orbitkv"]["reused_tokens_by_mode"]
    assert reused == {"exact": len(prompt) - 1}, third["kv_transfer_params"]
    assert seen["kv_transfer_params"]["orbitkv"]["num_encoded_items"] == 1
    assert seen["kv_transfer_params"]["orbitkv"]["num_loaded_encoder_items"] == 0
    assert again["kv_transfer_params"]["orbitkv"]["num_encoded_items"] == 0, again["kv_transfer_params"]
    assert again["kv_transfer_params"]["orbitkv"]["num_loaded_encoder_items"] == 1
