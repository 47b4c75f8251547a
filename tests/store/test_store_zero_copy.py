"""Zero-copy reads from the memory tier (``TieredStore.get(..., is_zero_copy=True)``): the tensors
are views of the tier's immutable buffer, equal to a copied read, and outlive the entry's eviction."""

from __future__ import annotations

import numpy as np
import torch
from orbitkv.store.tiered import TieredStore
from store_testing import FP, canonical, canonical_key, same_tensors


def test_memory_hits_are_views_of_the_stored_buffer_and_outlive_eviction():
    store = TieredStore(memory_nbytes=1 << 20)
    try:
        key, e = canonical_key(1), canonical(seed=1)
        store.put(key, e)
        copied = store.get([key], expect_fingerprint=FP)[0]
        viewed = store.get([key], expect_fingerprint=FP, is_zero_copy=True)[0]
        assert same_tensors(viewed.tensors, e.tensors) and same_tensors(copied.tensors, e.tensors)
        buf = np.frombuffer(store.memory.batch_get_tagged([key.to_str()])[0][0], dtype=np.uint8)
        lo, hi = buf.ctypes.data, buf.ctypes.data + buf.nbytes
        assert all(lo <= t.data_ptr() < hi for t in viewed.tensors.values())
        assert not any(lo <= t.data_ptr() < hi for t in copied.tensors.values())
        expected = {n: t.clone() for n, t in e.tensors.items()}
        store.memory.batch_delete([key.to_str()])
        for _ in range(3):  # new entries of the same size may not reuse the evicted buffer
            store.put(canonical_key(2), canonical(seed=2))
        assert same_tensors(viewed.tensors, expected)
        assert store.get([key], is_zero_copy=True) == [None]
    finally:
        store.close()


def test_a_first_read_of_unverified_bytes_is_verified_and_copied():
    """``put_bytes`` stores bytes nobody verified: the first read checks every digest (a copy);
    a corrupt entry is a miss either way."""
    store = TieredStore(memory_nbytes=1 << 20)
    try:
        from orbitkv.store.entry import encode

        key, e = canonical_key(3), canonical(seed=3)
        raw = bytearray(encode(e))
        raw[-1] ^= 0xFF
        store.put_bytes([(key.to_str(), bytes(raw))])
        assert store.get([key], is_zero_copy=True) == [None]
        store.put_bytes([(key.to_str(), encode(e))])
        first = store.get([key], is_zero_copy=True)[0]
        second = store.get([key], is_zero_copy=True)[0]
        assert same_tensors(first.tensors, e.tensors) and same_tensors(second.tensors, e.tensors)
        assert isinstance(next(iter(second.tensors.values())), torch.Tensor)
    finally:
        store.close()


def test_repeated_zero_copy_reads_share_views_built_once_and_still_check_the_model():
    """The views are built once (when the entry is put) and kept with the buffer: reads hand out
    the same tensors in a dict of their own, and an entry of another model is still refused."""
    store = TieredStore(memory_nbytes=1 << 20)
    try:
        key, e = canonical_key(4), canonical(seed=4)
        store.put(key, e)
        first = store.get([key], expect_fingerprint=FP, is_zero_copy=True)[0]
        second = store.get([key], expect_fingerprint=FP, is_zero_copy=True)[0]
        assert same_tensors(second.tensors, e.tensors)
        assert first.tensors is not second.tensors
        assert all(first.tensors[n] is second.tensors[n] for n in first.tensors)
        first.tensors.clear()  # the caller's own dict
        assert same_tensors(store.get([key], is_zero_copy=True)[0].tensors, e.tensors)
        # A copied read is a read of its own, never the shared views.
        copied = store.get([key], expect_fingerprint=FP)[0]
        assert all(copied.tensors[n] is not second.tensors[n] for n in copied.tensors)
        assert same_tensors(copied.tensors, e.tensors)
        # Under another model's fingerprint the kept views are refused like any read (a key
        # names its model: the entry is dropped as forged).
        assert store.get([key], expect_fingerprint="another-model", is_zero_copy=True) == [None]
    finally:
        store.close()


def test_an_entry_put_is_read_zero_copy_without_making_views(monkeypatch):
    """A saved chunk's first load (the step after its save) finds its views made by the put, on
    the save's thread: the read builds none (``tiered_read._Viewed``)."""
    from orbitkv.store import tiered_read

    store = TieredStore(memory_nbytes=1 << 20)
    try:
        key, e = canonical_key(5), canonical(seed=5)
        store.put(key, e)
        monkeypatch.setattr(tiered_read, "zero_copy_views",
                            lambda *a: (_ for _ in ()).throw(AssertionError("views at read")))
        got = store.get([key], expect_fingerprint=FP, is_zero_copy=True)[0]
        assert same_tensors(got.tensors, e.tensors)
        assert set(got.stacks) == {"k", "v"} and got.stacks["k"].shape[0] == e.meta.num_layers
    finally:
        store.close()
