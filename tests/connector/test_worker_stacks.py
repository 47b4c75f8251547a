"""The worker's stacked loads (``worker/loading.py``): an entry the store hands out (memory views,
a decoded copy, a file read) gives every layer of a load as one view whose layer ``i`` is the
entry's own ``k.i`` / ``v.i``; anything else falls back to one job per layer and load."""

from __future__ import annotations

import os

import pytest
import torch
from orbitkv.connector.metadata import LoadSpec
from orbitkv.connector.worker.loading import Staged, caches_by_layer, layer_stacks
from orbitkv.store.entry import decode, encode, make_entry
from orbitkv.store.entry_decode import decode_file
from orbitkv.store.entry_stacks import stacks_of
from orbitkv.store.keys import EntryKey, chunk_cid
from orbitkv.store.tiered import TieredStore

# Over ten layers: names sorted as text (k.1, k.10, k.2) would not be in layer order.
L, N, H, D = 12, 11, 2, 8


def _entry(dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(0)
    tensors = {f"{side}.{li}": torch.randn(N, H, D, generator=gen).to(dtype)
               for li in range(L) for side in "kv"}
    return make_entry("canonical", tensors, model_fingerprint="fp", layout="mha")


def _staged(entry, offset=0, n=N):
    spec = LoadSpec("r", "key", "exact", 0, offset, list(range(n)), [0])
    return Staged(spec, entry, None, 0, torch.arange(n))


def _read_back(how, entry, tmp_path):
    if how == "memory":
        key = EntryKey(chunk_cid("fp", "mha", "t", [1, 2]), "canonical")
        with TieredStore(memory_nbytes=1 << 20) as store:
            store.put(key, entry)
            store.get([key], is_zero_copy=True)  # the first read verifies; the second is views
            return store.get([key], is_zero_copy=True)[0]
    if how == "decode":
        return decode(encode(entry))
    path = tmp_path / "entry"
    path.write_bytes(encode(entry))
    fd = os.open(path, os.O_RDONLY)
    try:
        return decode_file(fd, path.stat().st_size)
    finally:
        os.close(fd)


@pytest.mark.parametrize("how", ["memory", "decode", "file"])
@pytest.mark.parametrize(("offset", "n"), [(0, N), (3, 5), (N - 1, 1)])
def test_every_layer_of_a_stored_entry_is_one_view_of_its_own_tensors(tmp_path, how, offset, n):
    entry = _read_back(how, _entry(), tmp_path)
    stacks = layer_stacks(_staged(entry, offset, n), L)
    assert stacks is not None
    for side, stack in zip("kv", stacks, strict=True):
        assert stack.shape == (L, n, H, D)
        for li in range(L):
            want = entry.tensors[f"{side}.{li}"][offset : offset + n]
            assert stack[li].data_ptr() == want.data_ptr()
            assert torch.equal(stack[li], want)


def test_layers_not_laid_out_as_one_run_are_no_stack():
    """Decode finds a side's stack only where its layers are one run in layer order; a load of
    an entry without both stacks goes job by job."""
    separate = _entry()  # each tensor its own allocation, and no decode
    assert separate.stacks == {} and stacks_of(separate.tensors, L) == {}
    assert layer_stacks(_staged(separate), L) is None
    run = decode(encode(_entry()))
    assert set(run.stacks) == {"k", "v"}
    swapped = dict(run.tensors)
    swapped["k.1"], swapped["k.2"] = swapped["k.2"], swapped["k.1"]
    assert set(stacks_of(swapped, L)) == {"v"}
    strided = dict(run.tensors)
    strided["v.3"] = torch.randn(D, H, N).to(torch.bfloat16).transpose(0, 2)
    assert set(stacks_of(strided, L)) == {"k"}
    for tensors in (swapped, strided):
        assert layer_stacks(_staged(type(run)(run.meta, tensors, stacks_of(tensors, L))), L) is None
    partial = decode(encode(_entry()), layers=[0, 1])  # a read of some layers has no stacks
    assert partial.stacks == {}


def test_caches_in_layer_order_only_when_they_are_the_models_layers_once_each():
    caches = {f"model.layers.{li}.attn": torch.zeros(1) + li for li in (2, 0, 1)}
    index = {name: int(name.split(".")[2]) for name in caches}
    ordered = caches_by_layer(caches, index, 3)
    assert [float(c) for c in ordered] == [0.0, 1.0, 2.0]
    assert caches_by_layer(caches, index, 4) is None  # a layer without a cache
    assert caches_by_layer(caches, {**index, "model.layers.2.attn": 1}, 3) is None  # twice
    assert caches_by_layer({**caches, "extra": torch.zeros(1)}, index, 3) is None  # unplaced


def test_a_one_token_layer_with_an_odd_stride_still_stacks_as_its_bytes_lie():
    """torch calls a ``[1, H, D]`` tensor contiguous whatever its first stride: the stack takes
    the shape's strides, so ``load_stacked`` accepts it and reads the same bytes."""
    run = decode(encode(_entry()))
    odd = {name: t[:1].as_strided((1, H, D), (7 * H * D, D, 1)) for name, t in run.tensors.items()}
    assert all(t.is_contiguous() and t.stride(0) != H * D for t in odd.values())
    stacks = layer_stacks(_staged(type(run)(run.meta, odd, stacks_of(odd, L)), 0, 1), L)
    assert stacks is not None
    for side, stack in zip("kv", stacks, strict=True):
        assert stack.stride()[1:] == (H * D, D, 1)
        for li in range(L):
            assert torch.equal(stack[li], odd[f"{side}.{li}"])


@pytest.mark.parametrize(
    ("heads", "dtype", "problem"),
    [(H, torch.bfloat16, None), (H + 1, torch.bfloat16, "shape"), (H, torch.float16, "bfloat16")],
)
def test_a_decoded_entry_is_checked_by_its_stacks_and_still_refused_when_it_does_not_fit(
    heads, dtype, problem
):
    """``check_entry`` takes a decoded entry's stacks for its tensors: one that fits passes; a
    dtype or shape the model does not have is refused, naming a tensor, as without stacks."""
    import dataclasses
    import sys

    from orbitkv.connector.worker.loading import check_entry

    sys.path.insert(0, os.path.dirname(__file__))
    import halves_testlib as hl

    entry = decode(encode(_entry(dtype)))
    assert set(entry.stacks) == {"k", "v"}
    ident = dataclasses.replace(
        hl.identity(), num_layers=L, num_kv_heads=heads, head_dim=D, cache_dtype=torch.bfloat16,
        rope_hash=entry.meta.rope_hash,
    )
    spec = LoadSpec("r", "key", "exact", 0, 0, list(range(N)), [0], position=entry.meta.start_pos)
    got = check_entry(spec, entry, None, ident)
    if problem is None:
        assert got is None
    else:
        assert got is not None and problem in got and "tensor" in got


def test_a_shipped_slot_array_is_the_slot_tensor_without_a_copy():
    from array import array

    from orbitkv.connector.metadata import slots_for
    from orbitkv.connector.worker.loading import slot_tensor

    shipped = slots_for([7, 3, 9], 4, 2, 11)
    slots = slot_tensor(shipped, torch.device("cpu"))
    assert slots.dtype == torch.int64 and slots.tolist() == list(shipped)
    assert slots.data_ptr() == shipped.buffer_info()[0]  # its bytes, not a copy
    # Any other sequence of ints gives the same tensor.
    assert torch.equal(slot_tensor(list(shipped), torch.device("cpu")), slots)
    assert torch.equal(slot_tensor(array("i", shipped), torch.device("cpu")), slots)
    assert slot_tensor(array("q"), torch.device("cpu")).shape == (0,)


def test_a_memory_buffer_is_checked_once_per_model_and_a_new_buffer_again(monkeypatch):
    """Zero-copy reads of one memory-tier buffer share its memo: ``check_entry``'s verdict on the
    tensors is found there at the next load (the tensors are not looked at again), per model
    shape; a buffer put again under the key is checked afresh, and a decoded entry has no memo."""
    import dataclasses
    import sys

    from orbitkv.connector.worker import loading

    sys.path.insert(0, os.path.dirname(__file__))
    import halves_testlib as hl

    key = EntryKey(chunk_cid("fp", "mha", "t", [1, 2]), "canonical")
    with TieredStore(memory_nbytes=1 << 20) as store:
        store.put(key, _entry())
        first, second = (store.get([key], is_zero_copy=True)[0] for _ in range(2))
        assert first.memo is not None and first.memo is second.memo
        ident = dataclasses.replace(
            hl.identity(), num_layers=L, num_kv_heads=H, head_dim=D, cache_dtype=torch.bfloat16,
            rope_hash=first.meta.rope_hash,
        )
        spec = LoadSpec("r", "key", "exact", 0, 0, list(range(N)), [0],
                        position=first.meta.start_pos)
        assert loading.check_entry(spec, first, None, ident) is None
        wider = dataclasses.replace(ident, num_kv_heads=H + 1)
        assert "shape" in loading.check_entry(spec, first, None, wider)
        assert len(first.memo) == 2

        def unexpected(*args):
            raise AssertionError("the memo's verdict was not used")

        with monkeypatch.context() as m:
            m.setattr(loading, "_tensors_problem", unexpected)
            assert loading.check_entry(spec, second, None, ident) is None
            assert "shape" in loading.check_entry(spec, second, None, wider)
        store.put(key, _entry(torch.float16))
        again = store.get([key], is_zero_copy=True)[0]
        assert again.memo is not first.memo
        assert "float16" in loading.check_entry(spec, again, None, ident)
    assert decode(encode(_entry())).memo is None


def test_a_memory_entry_s_rows_are_checked_at_its_first_load_and_kept(monkeypatch):
    """``entry_rows``: a whole memory-tier entry's rows of every layer are checked once and kept
    in its memo, per cache geometry; a part of it, or an entry with no memo, is checked again."""
    from orbitkv.connector.worker import loading
    from orbitkv.kernels.paged_stacked import cache_group

    group = cache_group([torch.zeros(4, H, 16, 2 * D, dtype=torch.bfloat16) for _ in range(L)],
                        "cpu_vec")
    assert group.views is not None
    key = EntryKey(chunk_cid("fp", "mha", "t", [1, 2]), "canonical")
    with TieredStore(memory_nbytes=1 << 20) as store:
        store.put(key, _entry())
        first, second = (store.get([key], is_zero_copy=True)[0] for _ in range(2))
        rows = loading.entry_rows(_staged(first), group, L)
        assert rows is not None and rows.num_tokens == N and len(first.memo) == 1
        assert rows.k_ptr == first.stacks["k"].data_ptr()

        def unexpected(*args):
            raise AssertionError("checked again")

        with monkeypatch.context() as m:
            m.setattr(loading, "stacked_rows", unexpected)
            assert loading.entry_rows(_staged(second), group, L) is rows
            with pytest.raises(AssertionError, match="checked again"):
                loading.entry_rows(_staged(second, 3, 5), group, L)  # a part: not kept
            with pytest.raises(AssertionError, match="checked again"):
                loading.entry_rows(_staged(decode(encode(_entry()))), group, L)  # no memo
        part = loading.entry_rows(_staged(second, 3, 5), group, L)
        assert part.num_tokens == 5 and len(first.memo) == 1
