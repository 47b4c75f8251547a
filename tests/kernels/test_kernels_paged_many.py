"""``load_many`` / ``gather_many``: a step's loads and save gathers for every layer in one native call
(``paged.py``, ``csrc/cpu_vec.cpp``, ``csrc/cpu_amx.cpp``), against ``load_chunk`` / ``gather_chunk`` one job at a time."""

from __future__ import annotations

import os

import pytest
import torch
from kernels_testlib import DTYPES, make_spec
from orbitkv.kernels import native
from orbitkv.kernels.paged import gather_chunk, gather_many, load_chunk, load_many

NUM_BLOCKS, BS, H, D, L = 24, 16, 2, 32, 3
SPEC = make_spec("neox", D, D)

pytestmark = pytest.mark.skipif(native.library() is None,
                                reason="native CPU kernels unavailable (no C++ compiler)")


def _jobs(dtype, gen, *, num_chunks=3, padded=False):
    """Three chunks (a whole-block one, one mid-block, one short) on every layer."""
    lengths = (2 * BS, 21, 5)[:num_chunks]
    b = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    slots = [
        (torch.tensor(b[:2])[:, None] * BS + torch.arange(BS)).flatten(),  # two whole blocks
        torch.cat([b[2] * BS + torch.arange(3, BS), b[3] * BS + torch.arange(8)]),  # mid-block
        b[4] * BS + torch.randperm(BS, generator=gen)[:5],  # scattered in one block
    ][:num_chunks]
    if padded:
        slots[-1] = slots[-1].clone()
        slots[-1][1] = -1
    deltas = (517, 0, -1200)[:num_chunks]
    layers = [[(torch.randn(n, H, D, generator=gen).to(dtype), torch.randn(n, H, D, generator=gen).to(dtype))
               for n in lengths] for _ in range(L)]
    return slots, deltas, layers


def _caches(dtype, gen):
    return [torch.randn(NUM_BLOCKS, H, BS, 2 * D, generator=gen).to(dtype) for _ in range(L)]


def _flat(caches, slots, deltas, layers):
    jobs = [(caches[li], slots[c], k, v, deltas[c]) for li, kvs in enumerate(layers)
            for c, (k, v) in enumerate(kvs)]
    return [list(x) for x in zip(*jobs, strict=True)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("padded", [False, True])
def test_load_many_equals_load_chunk_per_job(dtype, padded):
    gen = torch.Generator().manual_seed(1)
    slots, deltas, layers = _jobs(dtype, gen, padded=padded)
    want = _caches(dtype, gen)
    got = [c.clone() for c in want]
    for li, kvs in enumerate(layers):
        for c, (k, v) in enumerate(kvs):
            load_chunk(want[li], slots[c], "cpu_vec", k, v, spec=SPEC, delta=deltas[c])
    caches, s, ks, vs, ds = _flat(got, slots, deltas, layers)
    assert load_many(caches, "cpu_vec", s, ks, vs, spec=SPEC, deltas=ds)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def test_load_many_is_the_same_at_every_thread_count(real_set_num_threads):
    """Over 2^19 elements the jobs run in parallel: one thread and every core store the same."""
    gen = torch.Generator().manual_seed(2)
    n = 64 * BS
    slots = (torch.randperm(NUM_BLOCKS * 4, generator=gen)[:64, None] * BS + torch.arange(BS)).flatten()
    kvs = [(torch.randn(n, 4, 64, generator=gen).bfloat16(), torch.randn(n, 4, 64, generator=gen).bfloat16())
           for _ in range(8)]
    spec = make_spec("neox", 64, 64)
    outs = []
    for threads in (1, max(2, len(os.sched_getaffinity(0)))):
        real_set_num_threads(threads)
        caches = [torch.zeros(NUM_BLOCKS * 4, 4, BS, 128, dtype=torch.bfloat16) for _ in kvs]
        assert load_many(caches, "cpu_vec", [slots] * len(kvs), [k for k, _ in kvs],
                         [v for _, v in kvs], spec=spec, deltas=[517] * len(kvs))
        outs.append(torch.stack(caches))
    assert torch.equal(outs[0], outs[1])


def test_load_many_checks_every_slot_before_writing():
    gen = torch.Generator().manual_seed(3)
    slots, deltas, layers = _jobs(torch.bfloat16, gen)
    caches = [torch.zeros(NUM_BLOCKS, H, BS, 2 * D, dtype=torch.bfloat16) for _ in range(L)]
    c, s, ks, vs, ds = _flat(caches, slots, deltas, layers)
    s[-1] = s[-1].clone()
    s[-1][0] = NUM_BLOCKS * BS  # the last job's first slot is past the end
    with pytest.raises(ValueError, match="past the cache end"):
        load_many(c, "cpu_vec", s, ks, vs, spec=SPEC, deltas=ds)
    assert not any(bool(x.any()) for x in caches)


def test_load_many_refuses_bad_arguments_and_other_layouts():
    gen = torch.Generator().manual_seed(4)
    slots, deltas, layers = _jobs(torch.float32, gen, num_chunks=1)
    caches = _caches(torch.float32, gen)
    c, s, ks, vs, ds = _flat(caches, slots, deltas, layers)
    with pytest.raises(ValueError, match="contiguous"):
        load_many(c, "cpu_vec", s, [k.transpose(1, 2).contiguous().transpose(1, 2) for k in ks], vs,
                  spec=SPEC, deltas=ds)
    with pytest.raises(ValueError, match="caches differ"):
        load_many([c[0], torch.zeros(NUM_BLOCKS + 1, H, BS, 2 * D), c[2]], "cpu_vec", s, ks, vs,
                  spec=SPEC, deltas=ds)
    with pytest.raises(ValueError, match="RopeSpec"):
        load_many(c, "cpu_vec", s, ks, vs, spec=None, deltas=ds)
    with pytest.raises(ValueError, match="one cache"):
        load_many(c, "cpu_vec", s[:1], ks, vs, spec=SPEC, deltas=ds)
    flash = [torch.zeros(NUM_BLOCKS, 2, BS, H, D) for _ in range(L)]
    assert load_many(flash, "flash", s, ks, vs, spec=SPEC, deltas=ds) is False
    assert not any(bool(x.any()) for x in flash)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_many_equals_gather_chunk_per_cache(dtype):
    gen = torch.Generator().manual_seed(5)
    caches = _caches(dtype, gen)
    slots = torch.cat([torch.arange(BS) + 3 * BS, torch.randperm(NUM_BLOCKS * BS, generator=gen)[:9]])
    slots = torch.unique(slots)
    got = gather_many(caches, slots, "cpu_vec")
    assert got.shape == (L, 2, slots.numel(), H, D)
    for li, cache in enumerate(caches):
        k, v = gather_chunk(cache, slots, "cpu_vec", backend="torch")
        assert torch.equal(got[li, 0], k) and torch.equal(got[li, 1], v)
    with pytest.raises(ValueError, match="padding"):
        gather_many(caches, torch.tensor([0, -1]), "cpu_vec")
    assert gather_many([torch.zeros(NUM_BLOCKS, 2, BS, H, D)], slots, "flash") is None


@pytest.mark.parametrize(("bs", "heads", "dim"), [(32, 2, 64), (64, 3, 128), (32, 1, 32)])
@pytest.mark.parametrize("num_threads", [1, 2])
def test_gather_many_reads_amx_caches_as_gather_chunk_does(bs, heads, dim, num_threads):
    """CPU_AMX caches (tile-packed bf16, ``csrc/cpu_amx.cpp``): the bits of the torch gather for
    runs across tile groups and blocks, single tokens of either parity, every head and layer."""
    gen = torch.Generator().manual_seed(bs + heads + dim)
    num_blocks = 40
    caches = [torch.randn(num_blocks, heads, bs, 2 * dim, generator=gen).to(torch.bfloat16)
              for _ in range(4)]
    slots = torch.cat([
        torch.arange(bs - 7, 3 * bs + 9),  # a run over two tile groups and three blocks
        torch.tensor([5 * bs + 1, 9 * bs, 9 * bs + 17, num_blocks * bs - 1]),  # odd, even, last
        torch.randperm(num_blocks * bs, generator=gen)[:600],  # enough for two threads
    ])
    got = gather_many(caches, slots, "cpu_amx", num_threads=num_threads)
    assert got.shape == (len(caches), 2, slots.numel(), heads, dim)
    for li, cache in enumerate(caches):
        k, v = gather_chunk(cache, slots, "cpu_amx")
        assert torch.equal(got[li, 0].view(torch.int16), k.view(torch.int16)), f"K, layer {li}"
        assert torch.equal(got[li, 1].view(torch.int16), v.view(torch.int16)), f"V, layer {li}"


def test_gather_many_refuses_amx_slots_past_the_end_and_bad_thread_counts():
    cache = torch.zeros(2, 1, 32, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="past the cache end"):
        gather_many([cache], torch.tensor([64]), "cpu_amx")
    with pytest.raises(ValueError, match="num_threads"):
        gather_many([cache], torch.tensor([3]), "cpu_amx", num_threads=0)


AMX_SPECS = {"neox_whole_row": ("neox", 64, 0), "gptj_band": ("gptj", 32, 16), "neox_band": ("neox", 48, 8)}


@pytest.mark.parametrize("spec_case", sorted(AMX_SPECS))
@pytest.mark.parametrize("num_threads", [1, 2])
def test_load_many_into_amx_caches_equals_load_chunk_per_job(real_set_num_threads, spec_case,
                                                             num_threads):
    """CPU_AMX caches (``csrc/cpu_amx.cpp``): every job's K re-rotated and packed as the torch
    reference packs it (``load_chunk(..., backend='torch')``), V bits as they are, padding skipped,
    the other token of a shared V word untouched; the same bytes at one thread and two."""
    style, rot_dim, lo = AMX_SPECS[spec_case]
    bs, heads, dim, num_blocks = 32, 2, 64, 40
    spec = make_spec(style, dim, rot_dim, rope_offset=lo)
    gen = torch.Generator().manual_seed(11)
    b = torch.randperm(num_blocks, generator=gen).tolist()
    slots = [
        (torch.tensor(b[:2])[:, None] * bs + torch.arange(bs)).flatten(),  # two whole blocks
        torch.cat([b[2] * bs + torch.arange(7, bs), b[3] * bs + torch.arange(9)]),  # odd start
        torch.tensor([b[4] * bs + 3, -1, b[4] * bs + 20, b[5] * bs + bs - 1]),  # padded, scattered
        # 30 whole blocks: the step's elements reach the op's floor for a second thread
        (torch.tensor(b[6:36])[:, None] * bs + torch.arange(bs)).flatten(),
    ]
    deltas = (517, 0, -1200, 3)
    num_layers = 4
    layers = [[(torch.randn(len(s), heads, dim, generator=gen).to(torch.bfloat16),
                torch.randn(len(s), heads, dim, generator=gen).to(torch.bfloat16)) for s in slots]
              for _ in range(num_layers)]
    want = [torch.randn(num_blocks, heads, bs, 2 * dim, generator=gen).to(torch.bfloat16)
            for _ in range(num_layers)]
    got = [c.clone() for c in want]
    for li, kvs in enumerate(layers):
        for c, (k, v) in enumerate(kvs):
            load_chunk(want[li], slots[c], "cpu_amx", k, v, spec=spec, delta=deltas[c],
                       backend="torch")
    caches, s, ks, vs, ds = _flat(got, slots, deltas, layers)
    real_set_num_threads(num_threads)
    assert load_many(caches, "cpu_amx", s, ks, vs, spec=spec, deltas=ds)
    for li, (g, w) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(g.view(torch.int16), w.view(torch.int16)), f"layer {li}"


def test_load_many_into_amx_caches_checks_every_slot_before_writing():
    cache = torch.zeros(2, 1, 32, 128, dtype=torch.bfloat16)
    k = torch.ones(2, 1, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="past the cache end"):
        load_many([cache, cache], "cpu_amx", [torch.tensor([0, 1]), torch.tensor([2, 64])],
                  [k, k], [k, k], spec=None, deltas=[0, 0])
    assert not cache.any()
