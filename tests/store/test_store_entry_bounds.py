"""Decoding entries that a forger built: consistent digests and checksums, hostile layouts.

The fuzz in ``test_store_entry`` mostly mutates a good entry, so nearly every input stops at a
digest or the header checksum. Here every input is *signed* like a real entry (each tensor's
digest over the bytes its offsets name, the header checksum over the whole header), so decoding
reaches the layout checks: overlapping or out-of-range offsets, gaps, wrong shapes, huge lengths,
truncation. Each input is either a clean load or ``CorruptEntry``, and a clean load never holds
more tensor bytes than the entry has.

A read that fails for a reason of this process (memory, I/O) is ``EntryReadFailed``: the store
treats it as a miss and keeps the entry (tests at the end, with a real redis-server).
"""

from __future__ import annotations

import json
import os
import random
import tracemalloc

import pytest
import xxhash
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from orbitkv.store import buffers
from orbitkv.store.entry import EntryReader, decode, decode_file, encode
from orbitkv.store.entry_format import (
    DTYPES,
    U64,
    CorruptEntry,
    EntryReadFailed,
    header_checksum,
    meta_fields,
)
from redis_server import has_redis
from store_testing import FP, canonical, canonical_key, same_tensors

_META = canonical().meta
_NAMES = [f"{p}.{i}" for p in ("k", "v") for i in range(4)] + ["kv.0", "uk.0", "wk.0", "enc.0"]
_ITEMSIZE = {name: DTYPES[name].itemsize for name in DTYPES}
_HUGE = [2**31, 2**32 + 1, 2**40, 2**62, 2**63 - 1, 2**64, 10**30]
_settings = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])


def forge(index: dict[str, dict], payload: bytes, fields: dict[str, str] | None = None) -> bytes:
    """An entry with these tensors over ``payload``, digests and checksum computed as a writer
    computes them: only its layout can be wrong."""
    fields = dict(fields or meta_fields(_META))
    digests = {}
    for name, info in index.items():
        begin, stop = info["data_offsets"]
        digests[name] = xxhash.xxh3_64_hexdigest(payload[max(begin, 0) : max(stop, 0)])
    metadata = {
        **fields,
        "digests": json.dumps(digests, sort_keys=True, separators=(",", ":")),
        "checksum": header_checksum(fields, index, digests),
    }
    header = json.dumps({"__metadata__": metadata, **index}, separators=(",", ":")).encode()
    return U64.pack(len(header)) + header + payload


def _tiled(specs: list[tuple[str, str, list[int]]]) -> tuple[dict[str, dict], int]:
    index, offset = {}, 0
    for name, dtype, shape in specs:
        nbytes = _ITEMSIZE[dtype]
        for dim in shape:
            nbytes *= dim
        index[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    return index, offset


def _decode_all_ways(buf: bytes, tmp_dir: str) -> list[object]:
    """What each reader makes of ``buf``: an Entry's tensors, or the CorruptEntry raised."""
    out: list[object] = []
    for read in (
        lambda: decode(buf).tensors,
        lambda: decode(memoryview(buf)).tensors,
        lambda: _read_with_reader(buf),
        lambda: _decode_via_file(buf, tmp_dir),
    ):
        try:
            out.append(read())
        except CorruptEntry as exc:
            out.append(exc)
    return out


def _read_with_reader(buf: bytes):
    with EntryReader(bytearray(buf)) as reader:
        return reader.read()


def _decode_via_file(buf: bytes, tmp_dir: str):
    path = os.path.join(tmp_dir, "entry")
    with open(path, "wb") as f:
        f.write(buf)
    fd = os.open(path, os.O_RDONLY)
    try:
        return decode_file(fd, len(buf)).tensors
    finally:
        os.close(fd)


def _check_outcomes(buf: bytes, tmp_dir: str) -> bool:
    """Every reader agrees; a clean load holds at most the entry's size, indeed at most its data
    section (what follows the header). True: a clean load."""
    outcomes = _decode_all_ways(buf, tmp_dir)
    loaded = [o for o in outcomes if not isinstance(o, CorruptEntry)]
    # All readers parse the same header: all load, or all refuse.
    assert len(loaded) in (0, len(outcomes)), outcomes
    for tensors in loaded:
        (header_nbytes,) = U64.unpack(buf[:8])
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        assert nbytes <= len(buf) - 8 - header_nbytes <= len(buf)
    return bool(loaded)


@st.composite
def forged_entries(draw) -> bytes:
    """Tensors with fuzzed dtypes, shapes and offsets over a fuzzed payload, then maybe cut or
    extended: every digest and the header checksum match what the header says."""
    names = draw(st.lists(st.sampled_from(_NAMES), min_size=1, max_size=6, unique=True))
    dims = st.one_of(st.integers(0, 6), st.sampled_from(_HUGE))
    specs = [
        (name, draw(st.sampled_from(sorted(DTYPES))), draw(st.lists(dims, max_size=4)))
        for name in names
    ]
    index, nbytes = _tiled(specs)
    mode = draw(st.sampled_from(["tiled", "overlap", "random", "shifted"]))
    if mode == "overlap":  # every tensor over the first one's bytes (valid sizes, shared data)
        first = next(iter(index.values()))["data_offsets"]
        for info in index.values():
            size = info["data_offsets"][1] - info["data_offsets"][0]
            info["data_offsets"] = [first[0], first[0] + size]
    elif mode == "random":
        offsets = st.one_of(st.integers(-4, 600), st.sampled_from(_HUGE))
        for info in index.values():
            info["data_offsets"] = sorted([draw(offsets), draw(offsets)])
    elif mode == "shifted":  # one tensor moved, leaving a gap or an overlap
        info = index[draw(st.sampled_from(names))]
        step = draw(st.integers(-8, 8))
        info["data_offsets"] = [info["data_offsets"][0] + step, info["data_offsets"][1] + step]
    payload_nbytes = nbytes if nbytes <= 4096 else draw(st.integers(0, 4096))
    payload_nbytes = max(0, payload_nbytes + draw(st.sampled_from([0, 0, 0, -1, 1, -7, 64])))
    payload = random.Random(draw(st.integers(0, 2**32))).randbytes(payload_nbytes)
    buf = forge(index, payload)
    tail = draw(st.sampled_from(["keep", "keep", "cut", "extend"]))
    if tail == "cut":
        buf = buf[: draw(st.integers(0, len(buf)))]
    elif tail == "extend":
        buf += bytes(draw(st.integers(1, 16)))
    event(f"mode {mode}, tail {tail}")
    return buf


@settings(_settings, max_examples=600)
@given(forged_entries())
def test_fuzz_forged_layouts_load_cleanly_or_miss(tmp_path_factory, buf):
    is_loaded = _check_outcomes(buf, str(tmp_path_factory.getbasetemp()))
    event("clean load" if is_loaded else "miss (CorruptEntry)")


_json = st.recursive(
    st.one_of(
        st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False),
        st.text(max_size=8), st.sampled_from(sorted(DTYPES)),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)


@settings(_settings, max_examples=200)
@given(
    st.dictionaries(st.sampled_from(_NAMES + ["__metadata__", "x"]), _json, max_size=4),
    st.booleans(),
    st.binary(max_size=64),
)
def test_fuzz_random_header_json(tmp_path_factory, header, has_real_metadata, payload):
    """Any JSON as the header (with or without the real metadata fields around it)."""
    if has_real_metadata:
        header = {**header, "__metadata__": {**meta_fields(_META), "digests": "{}", "checksum": ""}}
    raw = json.dumps(header).encode()
    buf = U64.pack(len(raw)) + raw + payload
    assert not _check_outcomes(buf, str(tmp_path_factory.getbasetemp()))


@settings(_settings, max_examples=100)
@given(st.sampled_from([n for n in _HUGE if n < 2**64] + [0, 7, 2**16]), st.binary(max_size=32))
def test_fuzz_huge_header_lengths(tmp_path_factory, header_nbytes, rest):
    buf = U64.pack(header_nbytes) + rest
    assert not _check_outcomes(buf, str(tmp_path_factory.getbasetemp()))


@pytest.mark.slow
@settings(max_examples=20_000, deadline=None, suppress_health_check=list(HealthCheck))
@given(forged_entries())
def test_fuzz_forged_layouts_long(tmp_path_factory, buf):
    _check_outcomes(buf, str(tmp_path_factory.getbasetemp()))


def test_forged_entries_that_fit_load_exactly(tmp_path):
    """The forger itself is right: a well-formed forged entry loads, so the fuzz can reach a load."""
    import torch

    good = canonical().tensors
    payloads, specs = [], []
    for name, t in good.items():
        specs.append((name, "BF16", list(t.shape)))
        payloads.append(t.view(torch.int16).numpy().tobytes())
    index, _ = _tiled(specs)
    buf = forge(index, b"".join(payloads))
    assert same_tensors(decode(buf).tensors, good)
    assert _check_outcomes(buf, str(tmp_path))


def test_overlapping_tensors_are_corrupt_not_amplified(tmp_path):
    """256 tensors over the same 256 KiB (each digest right): the reader refused to allocate
    256 times the entry's size; before the layout check it decoded into 64 MiB."""
    nbytes = 256 << 10
    payload = random.Random(0).randbytes(nbytes)
    index = {
        f"k.{i}": {"dtype": "U8", "shape": [nbytes], "data_offsets": [0, nbytes]} for i in range(256)
    }
    buf = forge(index, payload)
    tracemalloc.start()
    try:
        with pytest.raises(CorruptEntry, match="overlaps"):
            decode(buf)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 * len(buf)
    assert not _check_outcomes(buf, str(tmp_path))


def test_gaps_and_offsets_past_the_payload_are_corrupt():
    index = {
        "k.0": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]},
        "v.0": {"dtype": "U8", "shape": [8], "data_offsets": [16, 24]},
    }
    with pytest.raises(CorruptEntry, match="gap"):
        decode(forge(index, bytes(24)))
    with pytest.raises(CorruptEntry):
        decode(forge(index, bytes(16)))  # v.0 ends past the payload


# -- transient faults: a miss that keeps the entry ----------------------------------------------


def _out_of_memory(nbytes: int):
    raise MemoryError(f"cannot allocate {nbytes} bytes")


def test_out_of_memory_while_decoding_is_a_read_failure_not_corruption(monkeypatch):
    buf = encode(canonical())
    monkeypatch.setattr(buffers, "take", _out_of_memory)  # what numpy raises when memory is short
    with pytest.raises(EntryReadFailed, match="MemoryError"):
        decode(buf)
    monkeypatch.undo()
    assert same_tensors(decode(buf).tensors, canonical().tensors)


def test_an_io_error_while_reading_a_file_is_a_read_failure(tmp_path):
    fd = os.open(tmp_path, os.O_RDONLY)  # a directory: pread fails with EISDIR, a real OSError
    try:
        with pytest.raises(EntryReadFailed, match="IsADirectoryError"):
            decode_file(fd, 4096)
    finally:
        os.close(fd)


def test_a_transient_fault_in_the_memory_tier_keeps_the_entry(monkeypatch):
    from orbitkv.store.tiered import TieredStore

    store = TieredStore(memory_nbytes=1 << 20)
    key = canonical_key(1)
    store.put(key, canonical())
    monkeypatch.setattr(buffers, "take", _out_of_memory)
    assert store.get([key], expect_fingerprint=FP) == [None]
    monkeypatch.undo()
    stats = store.stats()
    assert stats["read_failed.memory"] == stats["read_failed"] == 1 and stats["corrupt"] == 0
    (got,) = store.get([key], expect_fingerprint=FP)
    assert got is not None and same_tensors(got.tensors, canonical().tensors)
    store.close()


@pytest.mark.redis
@pytest.mark.skipif(not has_redis(), reason="needs redis-server")
def test_a_transient_fault_never_deletes_the_redis_copy(redis_server, monkeypatch):
    """Redis is shared by the fleet: deleting a good entry there on a local out-of-memory would
    take it from every replica."""
    from orbitkv.store.tiered import TieredStore

    writer = TieredStore(is_memory=False, redis_url=redis_server.url)
    key = canonical_key(2)
    writer.put(key, canonical())
    assert writer.flush(10.0)
    writer.close()
    store = TieredStore(memory_nbytes=1 << 20, redis_url=redis_server.url)
    monkeypatch.setattr(buffers, "take", _out_of_memory)
    assert store.get([key], expect_fingerprint=FP) == [None]
    monkeypatch.undo()
    stats = store.stats()
    assert stats["read_failed.redis"] >= 1 and stats["corrupt"] == 0
    assert store.lookup([key]) == ["redis"]
    (got,) = store.get([key], expect_fingerprint=FP)
    assert got is not None and same_tensors(got.tensors, canonical().tensors)
    store.close()
