"""``RopeSpec.from_hf_config`` edge cases: configs as vLLM leaves them, and rope types it must refuse."""

from __future__ import annotations

import functools

import pytest
import torch
from orbitkv.kernels.rope import RopeSpec

from orbitkv.models.make_model import build_config


@functools.cache
def _spec(arch: str) -> RopeSpec:
    return RopeSpec.from_hf_config(build_config(arch)[0])


@pytest.mark.parametrize("renamed", ["deepseek_yarn", "deepseek_llama_scaling"])
def test_vllm_renamed_deepseek_rope_type_gives_the_same_spec(renamed: str) -> None:
    """vLLM's deepseek_v2.py rewrites rope_type in the live hf_config at model build time."""
    cfg, _ = build_config("deepseek-v2")
    cfg.rope_parameters["rope_type"] = renamed
    spec = RopeSpec.from_hf_config(cfg)
    assert spec == _spec("deepseek-v2")
    assert spec.fingerprint() == _spec("deepseek-v2").fingerprint()
    assert cfg.rope_parameters["rope_type"] == renamed  # the caller's config is left alone


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope", "no-such-rope"])
def test_unrelocatable_or_unknown_rope_types_are_refused(rope_type: str) -> None:
    cfg, _ = build_config("llama")
    cfg.rope_parameters = dict(cfg.rope_parameters, rope_type=rope_type, factor=2.0)
    with pytest.raises(ValueError, match="rope type"):
        RopeSpec.from_hf_config(cfg)


def test_partial_rotary_factor_inside_rope_parameters() -> None:
    cfg, _ = build_config("stablelm")
    assert cfg.rope_parameters["partial_rotary_factor"] == 0.25
    cfg.partial_rotary_factor = None
    assert RopeSpec.from_hf_config(cfg).rotary_dim == 8


@pytest.mark.parametrize(("arch", "theta", "factor"), [("llama-yarn", 1e4, 4.0), ("llama3-scaled", 5e5, 8.0)])
def test_scaled_specs_carry_scaled_frequencies(arch: str, theta: float, factor: float) -> None:
    """High frequencies stay, the lowest is divided by the factor (else the checks prove nothing)."""
    plain = 1.0 / theta ** (torch.arange(0, 32, 2, dtype=torch.float64) / 32)
    scaled = _spec(arch).inv_freq_tensor()
    assert scaled[0] == pytest.approx(float(plain[0]), rel=1e-6)
    assert scaled[-1] == pytest.approx(float(plain[-1]) / factor, rel=1e-5)
