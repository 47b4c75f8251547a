"""The fast CPU_VEC paths (``backend='auto'`` on CPU) against the torch reference, byte for byte:
the native op (``paged_native``) and the eager-torch path it stands in for without a compiler."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from kernels_testlib import DTYPES, make_spec
from orbitkv.kernels import native, paged_cpu, paged_native
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
PATHS = ["native", "torch_fast"]


@pytest.fixture(params=PATHS)
def fast_path(request, monkeypatch):
    """Run the test on the native op, then with it switched off (the eager-torch fast path)."""
    if request.param == "native":
        if native.library() is None:
            pytest.skip("native CPU kernels unavailable (no C++ compiler)")
    else:
        monkeypatch.setattr(paged_native, "is_enabled", False)
    return request.param


def test_native_op_is_built_where_a_compiler_exists():
    """Without this, every 'native' case below could silently be the torch path."""
    if not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        pytest.skip("no C++ compiler on PATH")
    lib = native.library()
    assert lib is not None and lib.orbitkv_native_version() == native.VERSION


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("delta_kind", ["int", "zero", "per_token"])
@pytest.mark.parametrize("patch_kind", ["none", "k", "kv"])
def test_fast_load_equals_reference(fast_path, dtype, mode, delta_kind, patch_kind):
    num_tokens = 64 if mode == "reversed_in_block" else 70 if mode == "mid_block_start" else 48
    cache, slots, k, v, delta, patch_k, patch_v = _case(dtype, mode, num_tokens, delta_kind,
                                                        patch_kind)
    got, want = _load_both(cache, slots, k, v, SPECS["neox_full"], delta, patch_k, patch_v)
    assert torch.equal(got, want)


@pytest.mark.parametrize("spec_name", list(SPECS))
@pytest.mark.parametrize("mode", ["shuffled_blocks", "consecutive", "mid_block_start"])
@pytest.mark.parametrize("patch_kind", ["none", "kv"])
def test_fast_load_partial_rotary_and_offset_bands(fast_path, spec_name, mode, patch_kind):
    """Features outside the band are copied bit for bit (no patch) or patched in fp32."""
    cache, slots, k, v, delta, patch_k, patch_v = _case(torch.bfloat16, mode, 70, "per_token",
                                                        patch_kind, seed=1)
    got, want = _load_both(cache, slots, k, v, SPECS[spec_name], delta, patch_k, patch_v)
    assert torch.equal(got, want)


@pytest.mark.parametrize("delta_kind", ["int", "per_token"])
@pytest.mark.parametrize("patch_kind", ["none", "kv"])
def test_page_steps_cover_the_slab(monkeypatch, delta_kind, patch_kind):
    """Several rotation steps (one page each) give the same bytes as one step."""
    monkeypatch.setattr(paged_native, "is_enabled", False)
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
    monkeypatch.setattr(paged_native, "is_enabled", False)
    if use_vllm:
        pytest.importorskip("vllm")
        assert paged_cpu.vllm_cpu_writer() is not None
    else:
        monkeypatch.setattr(paged_cpu, "vllm_cpu_writer", lambda: None)
        assert paged_cpu.vllm_cpu_writer() is None
    cache, slots, k, v, delta, patch_k, patch_v = _case(torch.bfloat16, mode, 45, "per_token", "kv",
                                                        seed=3)
    got, want = _load_both(cache, slots, k, v, SPECS["gptj_offset"], delta, patch_k, patch_v)
    assert torch.equal(got, want)


def test_only_target_slots_change_on_fast_path(fast_path):
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
def test_fast_gather_equals_reference(fast_path, dtype, mode):
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


# Head dims that are and are not multiples of the op's 32-wide tiles, odd head counts, other blocks.
SHAPES = [(3, 80, 16), (2, 128, 32), (1, 64, 8), (4, 40, 16)]


@pytest.mark.parametrize("num_heads,head_dim,block_size", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_native_load_and_gather_shapes(num_heads, head_dim, block_size, dtype, style):
    if native.library() is None:
        pytest.skip("native CPU kernels unavailable (no C++ compiler)")
    gen = torch.Generator().manual_seed(5)
    num_blocks, n = 10, 3 * block_size + 5
    cache = torch.randn(num_blocks, num_heads, block_size, 2 * head_dim, generator=gen).to(dtype)
    k = torch.randn(n, num_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(n, num_heads, head_dim, generator=gen).to(dtype)
    blocks = torch.randperm(num_blocks, generator=gen)[:4]
    slots = (blocks[:, None] * block_size + torch.arange(block_size)).flatten()[3 : 3 + n]
    spec = make_spec(style, head_dim, head_dim // 2 if style == "neox" else head_dim)
    patch_k = (torch.randn(n, 4, generator=gen), torch.randn(4, num_heads * head_dim, generator=gen))
    for delta, pk in ((517, None), (torch.randint(-900, 900, (n,), generator=gen), patch_k)):
        want, got = cache.clone(), cache.clone()
        load_chunk(want, slots, "cpu_vec", k, v, spec=spec, delta=delta, patch_k=pk, backend="torch")
        load_chunk(got, slots, "cpu_vec", k, v, spec=spec, delta=delta, patch_k=pk)
        assert torch.equal(got, want)
    gather_slots = torch.cat([slots[:7], torch.tensor([-1]), slots[20:]])
    got_kv = gather_chunk(got, gather_slots, "cpu_vec")
    want_kv = gather_chunk(got, gather_slots, "cpu_vec", backend="torch")
    assert torch.equal(got_kv[0], want_kv[0]) and torch.equal(got_kv[1], want_kv[1])


def test_native_load_is_the_same_at_every_thread_count(real_set_num_threads):
    """Big enough that the op runs in parallel: one thread and every core store the same bytes."""
    if native.library() is None:
        pytest.skip("native CPU kernels unavailable (no C++ compiler)")
    gen = torch.Generator().manual_seed(6)
    # Over 2^19 elements (csrc's num_threads_for): below that the op runs on one thread.
    num_blocks, bs, nh, hd = 200, 16, 4, 64
    n = 160 * bs
    k = torch.randn(n, nh, hd, generator=gen).bfloat16()
    v = torch.randn(n, nh, hd, generator=gen).bfloat16()
    slots = (torch.randperm(num_blocks, generator=gen)[:160, None] * bs + torch.arange(bs)).flatten()
    delta = torch.randint(-3000, 3000, (n,), generator=gen)
    patch = (torch.randn(n, 8, generator=gen), torch.randn(8, nh * hd, generator=gen) / 8)
    outs = []
    for threads in (1, max(2, len(os.sched_getaffinity(0)))):
        real_set_num_threads(threads)
        cache = torch.zeros(num_blocks, nh, bs, 2 * hd, dtype=torch.bfloat16)
        load_chunk(cache, slots, "cpu_vec", k, v, spec=make_spec("neox", hd, hd), delta=delta,
                   patch_k=patch, patch_v=patch)
        outs.append(cache)
    assert torch.equal(outs[0], outs[1])


def test_native_load_refuses_a_slot_past_the_end_without_writing():
    if native.library() is None:
        pytest.skip("native CPU kernels unavailable (no C++ compiler)")
    cache = torch.zeros(NUM_BLOCKS, NUM_HEADS, BLOCK_SIZE, 2 * HEAD_DIM, dtype=torch.bfloat16)
    slots = torch.tensor([0, 1, NUM_SLOTS + 3])
    k = torch.ones(3, NUM_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="past the cache end"):
        load_chunk(cache, slots, "cpu_vec", k, k, check_slots=False)
    assert not bool(cache.any())


def test_native_load_rounds_denormals_and_infinities_like_torch():
    """The vector rounding flushes denormals and differs on NaN: such groups take the exact path."""
    if native.library() is None:
        pytest.skip("native CPU kernels unavailable (no C++ compiler)")
    nh, hd, bs = 2, 64, 16
    n = 4 * bs
    gen = torch.Generator().manual_seed(7)
    k = torch.randn(n, nh, hd, generator=gen)
    # Both features of a pair tiny: the rotated outputs are denormal too.
    for (t, h, d), value in {(3, 0, 5): 1e-39, (3, 0, 37): 2e-39, (9, 1, 8): -3e-40,
                             (9, 1, 40): 5e-40, (17, 0, 0): float("inf"), (30, 0, 7): 1.2e-38,
                             (30, 0, 39): 1.1e-38, (41, 1, 63): float("nan")}.items():
        k[t, h, d] = value
    k = k.bfloat16()
    v = torch.randn(n, nh, hd, generator=gen).bfloat16()
    slots = torch.arange(n) + bs
    for delta in (517, torch.randint(-999, 999, (n,), generator=gen)):
        want = torch.zeros(8, nh, bs, 2 * hd, dtype=torch.bfloat16)
        got = want.clone()
        kw = dict(spec=make_spec("neox", hd, hd), delta=delta)
        load_chunk(want, slots, "cpu_vec", k, v, backend="torch", **kw)
        load_chunk(got, slots, "cpu_vec", k, v, **kw)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
        assert int(got.isnan().sum()) == int(want.isnan().sum()) > 0
