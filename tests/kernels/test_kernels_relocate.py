"""Relocation: Triton vs torch, group law, agreement with RoPE computed from scratch in fp64."""

from __future__ import annotations

import pytest
import torch
from kernels_testlib import DTYPES, angles_for, assert_ulp_close, make_spec, rope_fp64
from orbitkv.kernels.relocate import relocate, relocate_ref
from orbitkv.kernels.rope import RopeSpec

NUM_TOKENS = 19
NUM_HEADS = 2

# name -> (spec, is_mla). MLA rows are [kv_c | k_pe]: only the trailing band rotates.
SPECS = {
    "neox": (make_spec("neox", 64, 64), False),
    "gptj": (make_spec("gptj", 64, 64), False),
    "neox_partial": (make_spec("neox", 80, 32), False),
    "gptj_partial": (make_spec("gptj", 64, 16), False),
    "mla_gptj": (make_spec("gptj", 64, 16, rope_offset=48), True),
    "mla_neox": (make_spec("neox", 64, 16, rope_offset=48), True),
}


def _keys(spec: RopeSpec, is_mla: bool, dtype=torch.float64, num_tokens=NUM_TOKENS):
    shape = (num_tokens, spec.head_dim) if is_mla else (num_tokens, NUM_HEADS, spec.head_dim)
    return torch.randn(shape, dtype=torch.float64).to(dtype)


def _band(spec: RopeSpec) -> slice:
    return slice(spec.rope_offset, spec.rope_offset + spec.rotary_dim)


def _row_max(x: torch.Tensor) -> torch.Tensor:
    return x.double().abs().amax(dim=-1, keepdim=True)


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("per_token", [False, True], ids=["scalar", "per_token"])
def test_triton_matches_reference(name, dtype, per_token):
    spec, is_mla = SPECS[name]
    k = _keys(spec, is_mla, dtype)
    delta = torch.randint(-4000, 4000, (NUM_TOKENS,)) if per_token else 1234
    got = relocate(k, delta, spec, backend="triton")
    want = relocate_ref(k, delta, spec)
    # The interpreter rounds fp32 -> bf16 differently from torch: one ULP apart at most.
    assert_ulp_close(got, want, ulps=1 if dtype != torch.float32 else 0)
    outside = torch.ones(spec.head_dim, dtype=torch.bool)
    outside[_band(spec)] = False
    assert torch.equal(got[..., outside], k[..., outside])


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_rope_from_scratch(name, dtype):
    """Keys rotated at p, relocated by delta, equal keys rotated at p + delta in fp64."""
    spec, is_mla = SPECS[name]
    x = _keys(spec, is_mla)
    positions = torch.randint(0, 8000, (NUM_TOKENS,))
    delta = torch.randint(-3000, 3000, (NUM_TOKENS,)).maximum(-positions)
    stored = rope_fp64(x, angles_for(positions, spec), spec).to(dtype)
    want = rope_fp64(x, angles_for(positions + delta, spec), spec)
    eps = torch.finfo(dtype).eps
    for backend in ("torch", "triton"):
        got = relocate(stored, delta, spec, backend=backend)
        # Two roundings to dtype (storing, relocating), each at most half an ULP of the row scale.
        err = (got.double() - want).abs()
        assert bool((err <= 2 * eps * _row_max(want)).all()), f"{backend}: max err {float(err.max())}"
        outside = torch.ones(spec.head_dim, dtype=torch.bool)
        outside[_band(spec)] = False
        assert torch.equal(got[..., outside], stored[..., outside]), "untouched dims must be bit-exact"


@pytest.mark.parametrize("name", ["neox", "gptj_partial", "mla_gptj"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_group_law(name, dtype):
    spec, is_mla = SPECS[name]
    k = _keys(spec, is_mla, dtype)
    a = torch.randint(-5000, 5000, (NUM_TOKENS,))
    b = torch.randint(-5000, 5000, (NUM_TOKENS,))
    twice = relocate(relocate(k, a, spec), b, spec)
    once = relocate(k, a + b, spec)
    bound = (4 if dtype == torch.float32 else 2) * torch.finfo(dtype).eps * _row_max(k)
    assert bool(((twice.double() - once.double()).abs() <= bound).all())
    back = relocate(relocate(k, 777, spec), -777, spec)
    assert bool(((back.double() - k.double()).abs() <= bound).all())


def test_zero_delta_is_identity():
    spec, _ = SPECS["neox"]
    k = _keys(spec, False, torch.bfloat16)
    for backend in ("torch", "triton"):
        assert torch.equal(relocate(k, 0, spec, backend=backend), k)


@pytest.mark.parametrize("rope_type", ["yarn", "llama3", "linear"])
def test_scaled_rope_is_a_pure_rotation(rope_type):
    """Stored keys carry YaRN's mscale; relocation must rotate them without applying it again."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": rope_type, "factor": 4.0, "rope_theta": 10000.0,
              "original_max_position_embeddings": 512}
    if rope_type == "llama3":
        params.update(low_freq_factor=1.0, high_freq_factor=4.0)
    cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, rope_parameters=params)
    inv_freq, mscale = ROPE_INIT_FUNCTIONS[rope_type](cfg, "cpu")
    spec = RopeSpec("neox", 64, 64, tuple(float(f) for f in inv_freq.double()))
    x = torch.randn(NUM_TOKENS, NUM_HEADS, 64, dtype=torch.float64)
    positions = torch.randint(0, 2000, (NUM_TOKENS,))
    stored = (mscale * rope_fp64(x, angles_for(positions, spec), spec)).float()
    want = mscale * rope_fp64(x, angles_for(positions + 1500, spec), spec)
    got = relocate(stored, 1500, spec)
    assert bool(((got.double() - want).abs() <= 4 * torch.finfo(torch.float32).eps * _row_max(want)).all())


@pytest.mark.parametrize("assign", ["sections", "interleaved"])
def test_mrope_uniform_shift_is_a_1d_rotation(assign):
    """Qwen2-VL M-RoPE: frequency i reads the t, h or w stream; shifting all three by delta is
    relocation by delta (in M-RoPE position units)."""
    spec = make_spec("neox", 64, 64, is_mrope=True)
    half = spec.rotary_dim // 2
    if assign == "sections":  # Qwen2-VL mrope_section = [8, 12, 12]
        stream = torch.tensor([0] * 8 + [1] * 12 + [2] * 12)
    else:  # Qwen3-VL interleaves t/h/w across frequencies
        stream = torch.arange(half) % 3
    pos = torch.randint(0, 300, (NUM_TOKENS, 3))
    inv = torch.tensor(spec.inv_freq, dtype=torch.float64)

    def angles(p):
        return p.double()[:, stream] * inv[None, :]

    x = torch.randn(NUM_TOKENS, NUM_HEADS, 64, dtype=torch.float64)
    stored = rope_fp64(x, angles(pos), spec).float()
    delta = torch.randint(-200, 400, (NUM_TOKENS,)).maximum(-pos.min(dim=1).values)
    want = rope_fp64(x, angles(pos + delta[:, None]), spec)
    for backend in ("torch", "triton"):
        got = relocate(stored, delta, spec, backend=backend)
        bound = 4 * torch.finfo(torch.float32).eps * _row_max(want)
        assert bool(((got.double() - want).abs() <= bound).all())


def test_large_delta_keeps_phase():
    """The angle is formed in fp64, so a shift of a million positions stays exact to fp32."""
    spec, _ = SPECS["neox"]
    x = torch.randn(4, NUM_HEADS, 64, dtype=torch.float64)
    p = torch.tensor([5, 10, 20, 40])
    stored = rope_fp64(x, angles_for(p, spec), spec).float()
    got = relocate(stored, 1_000_003, spec)
    want = rope_fp64(x, angles_for(p + 1_000_003, spec), spec)
    assert bool(((got.double() - want).abs() <= 4e-6 * _row_max(want)).all())


@pytest.mark.parametrize(
    "make_args, error, words",
    [
        (lambda s: (torch.randn(3, 2, 32), 1, s), ValueError, "head_dim"),
        (lambda s: (torch.randn(3, 2, 64), 1.5, s), TypeError, "delta"),
        (lambda s: (torch.randn(3, 2, 64), torch.tensor([1.0, 2.0, 3.0]), s), TypeError, "integer"),
        (lambda s: (torch.randn(3, 2, 64), torch.arange(4), s), ValueError, "[N]"),
        (lambda s: (torch.randn(3, 2, 64), True, s), TypeError, "bool"),
        (lambda s: (torch.randint(0, 5, (3, 2, 64)), 1, s), TypeError, "dtype"),
        (lambda s: (torch.randn(3, 2, 64).to(torch.float8_e4m3fn), 1, s), TypeError, "fp8"),
        (lambda s: (torch.randn(3, 2, 2, 64), 1, s), ValueError, "[N, H, D]"),
        (lambda s: (torch.randn(3, 2, 64), 1, "neox"), TypeError, "RopeSpec"),
    ],
)
def test_bad_input_names_the_problem(make_args, error, words):
    spec, _ = SPECS["neox"]
    k, delta, s = make_args(spec)
    with pytest.raises(error, match=None) as info:
        relocate(k, delta, s)
    assert words in str(info.value)


def test_torch_path_steps_agree(monkeypatch):
    """The torch path works in token steps; step boundaries must not change any value."""
    import orbitkv.kernels.relocate as relocate_module

    spec, _ = SPECS["neox_partial"]
    k = _keys(spec, False, torch.bfloat16, num_tokens=37)
    delta = torch.randint(-900, 900, (37,))
    patch = (torch.randn(37, 5), torch.randn(5, NUM_HEADS * spec.head_dim))
    cos, sin = spec.cos_sin(delta)
    whole = relocate_module.rotate_and_patch(k, cos, sin, spec, patch)
    monkeypatch.setattr(relocate_module, "_STEP_ELEMS", 3 * NUM_HEADS * spec.head_dim)
    stepped = relocate_module.rotate_and_patch(k, cos, sin, spec, patch)
    assert_ulp_close(stepped, whole, ulps=1)
    assert torch.equal(relocate(k, delta, spec), relocate_ref(k, delta, spec))
    assert_ulp_close(relocate(k, delta, spec), relocate(k, delta, spec, backend="triton"), ulps=1)
