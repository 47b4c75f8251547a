"""``RopeSpec.from_vllm_rotary`` on vLLM's own rotary modules agrees bit for bit with
``RopeSpec.from_hf_config``, in a bf16 model too (where vLLM's cos/sin buffer is bf16)."""

from __future__ import annotations

import functools

import pytest
import torch
from orbitkv.kernels.rope import RopeSpec

from orbitkv.models.make_model import ARCHES, build_config

pytest.importorskip("vllm")


@pytest.fixture(scope="module")
def get_rope():
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with set_current_vllm_config(VllmConfig()):
        yield get_rope


def _vllm_rotary(get_rope, arch: str, dtype: torch.dtype, rope_parameters: dict | None = None):
    """The rotary module vLLM's model file builds for this config (mirrors its get_rope call)."""
    cfg = _config(arch)
    text = cfg.get_text_config()
    params = dict(rope_parameters or text.rope_parameters)
    if arch == "deepseek-v2":
        params["rope_type"] = "deepseek_yarn"  # what vLLM's deepseek_v2.py renames "yarn" to
        return cfg, get_rope(text.qk_rope_head_dim, text.max_position_embeddings, False, params, dtype=dtype)
    head = text.hidden_size // text.num_attention_heads
    return cfg, get_rope(head, text.max_position_embeddings, True, params, dtype=dtype)


@functools.cache
def _config(arch: str):
    return build_config(arch)[0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("arch", [a for a in ARCHES if a != "smolvlm"])
def test_vllm_and_hf_specs_agree(get_rope, arch: str, dtype: torch.dtype) -> None:
    cfg, rotary = _vllm_rotary(get_rope, arch, dtype)
    hf = RopeSpec.from_hf_config(cfg)
    spec = RopeSpec.from_vllm_rotary(rotary, head_dim=hf.head_dim, rope_offset=hf.rope_offset)
    assert spec == hf
    assert spec.fingerprint() == hf.fingerprint()


def test_linear_scaling_frequencies(get_rope) -> None:
    """Linear scaling divides positions in vLLM and frequencies in HF: both are f / factor."""
    params = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}
    _, rotary = _vllm_rotary(get_rope, "llama", torch.bfloat16, params)
    spec = RopeSpec.from_vllm_rotary(rotary)
    plain = 1.0 / 10000.0 ** (torch.arange(0, 32, 2, dtype=torch.float32) / 32)
    torch.testing.assert_close(spec.inv_freq_tensor(), plain.double() / 4.0, rtol=1e-7, atol=0)
