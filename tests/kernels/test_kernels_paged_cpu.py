"""The fast CPU_VEC path (``backend='auto'`` on CPU) against the torch reference, byte for byte."""

from __future__ import annotations

import pytest
import torch
from kernels_testlib import DTYPES, make_spec
from orbitkv.kernels import paged_cpu
from orbitkv.kernels.paged import gather_chunk, load_chunk

NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS, HEAD_DIM = 12, 16, 2, 32
NUM_SLOTS = NUM_BLOCKS * BLOCK_SIZE

SPECS = {
    "neox_full": make_spec("neox", HEAD_DIM, HEAD_DIM),
    "neox_partial": make_spec("neox", HEAD_DIM, HEAD_DIM // 2),
    "gptj_offset": make_spec("gptj", HEAD_DIM, 16, rope_offset=8),
}


def _slots(mode: str, num_tokens: int, gen: torch.Generator) -> torch.Tensor:
    if mode == "shuffled_blocks":
        num_blocks = -(-num_tokens // BLOCK_SIZE)
        blocks = torch.randperm(NUM_BLOCKS, generator=gen)[:num_blocks]
        return (blocks[:, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE)).flatten()[:num_tokens]
    if mode == "consecutive":
        return torch.arange(num_tokens) + 2 * BLOCK_SIZE
    if mode == "mid_block_start":  # partial first block, whole blocks, partial last block
        return torch.arange(num_tokens) + BLOCK_SIZE + 5
    if mode == "reversed_in_block":
        return (torch.arange(num_tokens) + BLOCK_SIZE).view(-1, BLOCK_SIZE).flip(1).flatten()
    slots = torch.randperm(NUM_SLOTS, generator=gen)[:num_tokens]
    if mode == "random_padded":
        slots[::5] = -1
    return slots


def _case(dtype, mode, num_tokens, delta_kind, patch_kind, seed=0):
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(NUM_BLOCKS, NUM_HEADS, BLOCK_SIZE, 2 * HEAD_DIM, generator=gen).to(dtype)
    shape = (num_tokens, NUM_HEADS, HEAD_DIM)
    k = torch.randn(shape, generator=gen).to(dtype)
    v = torch.randn(shape, generator=gen).to(dtype)
    slots = _slots(mode, num_tokens, gen)
    delta = {"int": 517, "zero": 0,
             "per_token": torch.randint(-3000, 3000, (num_tokens,), generator=gen)}[delta_kind]
    features = NUM_HEADS * HEAD_DIM

    def patch(rank):
        return (torch.randn(num_tokens, rank, generator=gen),
                torch.randn(rank, features, generator=gen) / 8)

    patch_k = patch(6) if patch_kind in ("k", "kv") else None
    patch_v = patch(3) if patch_kind == "kv" else None
    return cache, slots, k, v, delta, patch_k, patch_v


def _load_both(cache, slots, k, v, spec, delta, patch_k, patch_v):
    want, got = cache.clone(), cache.clone()
    kw = dict(spec=spec, delta=delta, patch_k=patch_k, patch_v=patch_v)
    load_chunk(want, slots, "cpu_vec", k, v, backend="torch", **kw)
    load_chunk(got, slots, "cpu_vec", k, v, **kw)
    return got, want


MODES = ["shuffled_blocks", "consecutive", "mid_block_start", "reversed_in_block", "random",
         "random_padded"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("delta_kind", ["int", "zero", "per_token"])
@pytest.mark.parametrize("patch_kind", ["none", "k", "kv"])
def test_fast_load_equals_reference(dtype, mode, delta_kind, patch_kind):
    num_tokens = 64 if mode == "reversed_in_block" else 70 if mode == "mid_block_start" else 48
    cache, slots, k, v, delta, patch_k, patch_v = _case(dtype, mode, num_tokens, delta_kind,
                                                        patch_kind)
    got, want = _load_both(cache, slots, k, v, SPECS["neox_full"], delta, patch_k, patch_v)
    assert torch.equal(got, want)


@pytest.mark.parametrize("spec_name", list(SPECS))
@pytest.mark.parametrize("mode", ["shuffled_blocks", "consecutive", "mid_block_start"])
@pytest.mark.parametrize("patch_kind", ["none", "kv"])
def test_fast_load_partial_rotary_and_offset_bands(spec_name, mode, patch_kind):
    """Features outside the band are copied bit for bit (no patch) or patched in fp32."""
    cache, slots, k, v, delta, patch_k, patch_v = _case(torch.bfloat16, mode, 70, "per_token",
                                                        patch_kind, seed=1)
    got, want = _load_both(cache, slots, k, v, SPECS[spec_name], delta, patch_k, patch_v)
    assert torch.equal(got, want)


@pytest.mark.parametrize("delta_kind", ["int", "per_token"])
@pytest.mark.parametrize("patch_kind", ["none", "kv"])
def test_page_steps_cover_the_slab(monkeypatch, delta_kind, patch_kind):
    """Several rotation steps (one page each) give the same bytes as one step."""
    monkeypatch.setattr(paged_cpu, "_STEP_ELEMS", 1)
    cache, slots, k, v, delta, patch_k, patch_v = _case(torch.bfloat16, "shuffled_blocks", 80,
                                                        delta_kind, patch_kind, seed=2)
    got, want = _load_both(cache, slots, k, v, SPECS["neox_full"], delta, patch_k, patch_v)
    assert torch.equal(got, want)


@pytest.mark.parametrize("use_vllm", [True, False])
@pytest.mark.parametrize("mode", ["random", "random_padded", "mid_block_start"])
def test_generic_writer_vllm_op_and_torch_fallback(monkeypatch, use_vllm, mode):
    """Tokens outside whole blocks go through vLLM's cpu_attn_reshape_and_cache, or, without vLLM,
    advanced indexing; both store the reference bytes."""
    if use_vllm:
        pytest.importorskip("vllm")
        assert paged_cpu._vllm_writer() is not None
    else:
        monkeypatch.setattr(paged_cpu._local, "vllm_op", False, raising=False)
        assert paged_cpu._vllm_writer() is None
    cache, slots, k, v, delta, patch_k, patch_v = _case(torch.bfloat16, mode, 45, "per_token", "kv",
                                                        seed=3)
    got, want = _load_both(cache, slots, k, v, SPECS["gptj_offset"], delta, patch_k, patch_v)
    assert torch.equal(got, want)


def test_only_target_slots_change_on_fast_path():
    cache = torch.zeros(NUM_BLOCKS, NUM_HEADS, BLOCK_SIZE, 2 * HEAD_DIM, dtype=torch.bfloat16)
    cache.fill_(7.0)
    slots = torch.arange(3 * BLOCK_SIZE) + BLOCK_SIZE + 3  # partial, 2 whole, partial
    k = torch.randn(slots.numel(), NUM_HEADS, HEAD_DIM).bfloat16()
    v = torch.randn_like(k)
    load_chunk(cache, slots, "cpu_vec", k, v, spec=SPECS["neox_full"], delta=11)
    got_k, got_v = gather_chunk(cache, slots, "cpu_vec", backend="torch")
    assert bool((got_v == v).all())
    untouched = torch.ones(NUM_SLOTS, dtype=torch.bool)
    untouched[slots] = False
    rest_k, rest_v = gather_chunk(cache, torch.nonzero(untouched).flatten(), "cpu_vec",
                                  backend="torch")
    assert bool((rest_k == 7.0).all()) and bool((rest_v == 7.0).all())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", MODES)
def test_fast_gather_equals_reference(dtype, mode):
    num_tokens = 64 if mode == "reversed_in_block" else 48
    cache, slots, *_ = _case(dtype, mode, num_tokens, "zero", "none", seed=4)
    got = gather_chunk(cache, slots, "cpu_vec")
    want = gather_chunk(cache, slots, "cpu_vec", backend="torch")
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[0].is_contiguous() and got[1].is_contiguous()


def test_split_blocks():
    bs = BLOCK_SIZE
    whole = (torch.tensor([5, 2, 3])[:, None] * bs + torch.arange(bs)).flatten()
    head, pages, blocks = paged_cpu.split_blocks(whole, bs)
    assert (head, pages, blocks.tolist()) == (0, 3, [5, 2, 3])
    mid = torch.arange(3, 3 + 2 * bs + 7)  # 13 head tokens, 1 whole block, 10 tail tokens
    head, pages, blocks = paged_cpu.split_blocks(mid, bs)
    assert (head, pages, blocks.tolist()) == (bs - 3, 1, [1])
    assert paged_cpu.split_blocks(whole.flip(0), bs)[2] is None
    assert paged_cpu.split_blocks(torch.arange(5), bs)[2] is None
    assert paged_cpu.split_blocks(torch.empty(0, dtype=torch.int64), bs) == (0, 0, None)
    assert paged_cpu._consecutive(torch.tensor([4, 5, 6])) == 4
    assert paged_cpu._consecutive(torch.tensor([4, 6, 5])) is None


def test_buffers_are_reused_and_grow():
    a = paged_cpu._buffer("test_buf", (4, 8), torch.float32)
    b = paged_cpu._buffer("test_buf", (2, 8), torch.float32)
    assert a.data_ptr() == b.data_ptr()
    c = paged_cpu._buffer("test_buf", (64, 64), torch.float32)
    assert c.shape == (64, 64)
    assert paged_cpu._buffer("other_buf", (4, 8), torch.float32).data_ptr() != c.data_ptr()


def test_buffers_made_in_inference_mode_serve_callers_outside_it():
    """vLLM loads inside inference mode; a pooled buffer must still take in-place writes later."""
    with torch.inference_mode():
        paged_cpu._buffer("mode_buf", (4, 8), torch.float32)
    buf = paged_cpu._buffer("mode_buf", (4, 8), torch.float32)
    assert not buf.is_inference()
    buf.fill_(1.0)
