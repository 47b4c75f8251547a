"""Recycled entry buffers: a buffer comes back only once nothing references it."""

from __future__ import annotations

import numpy as np
import torch
from orbitkv.store import buffers
from orbitkv.store.buffers import MIN_POOLED_NBYTES, BufferPool, size_class
from orbitkv.store.entry import decode, encode_verified, make_entry
from orbitkv.store.memory import MemoryBackend
from orbitkv.store.tiered import TieredStore
from store_testing import FP, canonical_key

NBYTES = 3 * MIN_POOLED_NBYTES + 12345


def _root(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def test_size_classes_bound_the_slack():
    for n in (1, 70_000, 1 << 20, (1 << 20) + 1, 9_999_999, 64 << 20):
        c = size_class(n)
        assert n <= c < n + max(n / 16, 64 << 10)


def test_pooled_buffers_and_entry_data_start_on_a_cache_line():
    pool = BufferPool()
    for n in (NBYTES, 8 << 20):
        assert pool.take(n).ctypes.data % 64 == 0
    buf, header = encode_verified(_entry(3))
    assert header.data_begin % 64 == 0
    assert np.frombuffer(buf, dtype=np.uint8).ctypes.data % 64 == 0 or len(buf) < MIN_POOLED_NBYTES


def test_small_buffers_are_not_pooled():
    pool = BufferPool()
    a = pool.take(100)
    assert a.nbytes == 100 and pool.stats()["buffers_lent"] == 0


def test_a_dropped_buffer_is_reused_and_a_held_one_is_not():
    pool = BufferPool()
    a = pool.take(NBYTES)
    assert a.nbytes == NBYTES and a.flags.writeable
    first = _root(a)
    held = [a[10:20], memoryview(a).toreadonly()[5:], torch.from_numpy(a)[3:].view(torch.uint8)]
    del a
    for keep in held:
        b = pool.take(NBYTES)
        assert _root(b) != first, f"reused while {type(keep).__name__} still references it"
        del b
        held = held[1:]
    del keep
    c = pool.take(NBYTES)
    assert pool.num_reused >= 1
    assert _root(c) == first  # the oldest free buffer comes back first


def test_idle_memory_is_capped():
    pool = BufferPool(max_idle_nbytes=2 * size_class(NBYTES))
    taken = [pool.take(NBYTES) for _ in range(6)]
    del taken
    pool.take(10 * NBYTES)  # a class none of them fits: reclaims all six, keeps two
    assert pool.stats()["buffers_idle_nbytes"] <= 2 * size_class(NBYTES)


def _entry(seed: int, num_tokens: int = 300):
    g = torch.Generator().manual_seed(seed)
    tensors = {f"{p}.{i}": torch.randn(num_tokens, 4, 64, generator=g).bfloat16()
               for p in "kv" for i in range(2)}
    return make_entry("canonical", tensors, model_fingerprint=FP, layout="flash")


def test_store_results_stay_intact_while_buffers_recycle():
    """Entries and tensors handed out earlier keep their bytes through many later puts and gets
    that recycle buffers of the same size."""
    store = TieredStore(backends=[MemoryBackend(4 * NBYTES)])
    key = canonical_key(1)
    kept = []
    reused_before = buffers.POOL.num_reused
    for seed in range(12):
        entry = _entry(seed)
        store.put(key, entry)
        got = store.get([key])[0]
        kept.append((entry, got, encode_verified(entry)[0]))
    assert buffers.POOL.num_reused > reused_before
    for entry, got, encoded in kept:
        for name, t in entry.tensors.items():
            assert torch.equal(got.tensors[name], t)
        assert all(torch.equal(decode(encoded).tensors[n], t) for n, t in entry.tensors.items())
    store.close()
