"""Entry format: round trip, partial reads, and every corruption is CorruptEntry (fuzzed)."""

from __future__ import annotations

import json
import struct

import pytest
import safetensors.torch
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from orbitkv.store.entry import FORMAT_VERSION, CorruptEntry, decode, encode, make_entry, read_meta
from store_testing import FP, LAYOUT, canonical, cid_of, conditioned, same_tensors, tensors


def _rewrite_meta(buf: bytes, **changes: str) -> bytes:
    """Re-serialize with edited metadata (the checksum left as it was)."""
    (n,) = struct.unpack("<Q", buf[:8])
    header = json.loads(buf[8 : 8 + n])
    header["__metadata__"].update(changes)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + buf[8 + n :]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_round_trip_and_metadata(dtype):
    ante = [cid_of([1]), cid_of([2])]
    e = conditioned(ante, dtype=dtype, num_layers=3)
    got = decode(encode(e), expect_fingerprint=FP)
    assert same_tensors(got.tensors, e.tensors)
    m = got.meta
    assert (m.version, m.kind, m.model_fingerprint, m.layout) == (FORMAT_VERSION, "conditioned", FP, LAYOUT)
    assert (m.num_tokens, m.num_layers, m.start_pos, m.antecedent) == (4, 3, 16, tuple(ante))
    assert m.dtype == str(dtype).removeprefix("torch.") and len(m.checksum) == 32


def test_loadable_by_safetensors():
    e = canonical()
    loaded = safetensors.torch.load(encode(e))
    assert same_tensors(loaded, e.tensors)


def test_mla_and_patch_entries():
    mla = make_entry("canonical", {f"kv.{i}": torch.randn(5, 96) for i in range(2)},
                     model_fingerprint=FP, layout="mla")
    assert same_tensors(decode(encode(mla)).tensors, mla.tensors)
    factors = {}
    for i in range(2):
        factors |= {f"uk.{i}": torch.randn(5, 4), f"wk.{i}": torch.randn(4, 16),
                    f"uv.{i}": torch.randn(5, 4), f"wv.{i}": torch.randn(4, 16)}
    patch = make_entry("patch", factors, model_fingerprint=FP, layout=LAYOUT, rank=4,
                       antecedent_key=cid_of([9]), dtype="bfloat16")
    got = decode(encode(patch))
    assert got.meta.rank == 4 and got.meta.antecedent_hash == cid_of([9])
    assert same_tensors(got.tensors, patch.tensors)


def test_partial_read_returns_only_those_layers_verified():
    e = canonical(num_layers=4)
    buf = encode(e)
    assert set(decode(buf, layers=2).tensors) == {"k.2", "v.2"}
    assert set(decode(memoryview(buf), layers=range(1, 3)).tensors) == {"k.1", "v.1", "k.2", "v.2"}
    assert read_meta(buf).num_layers == 4
    # Corrupt one byte of layer 3's data: reading layer 0 alone still verifies, layer 3 does not.
    (n,) = struct.unpack("<Q", buf[:8])
    begin, _ = json.loads(buf[8 : 8 + n])["k.3"]["data_offsets"]
    bad = bytearray(buf)
    bad[8 + n + begin] ^= 0xFF
    assert set(decode(bytes(bad), layers=[0]).tensors) == {"k.0", "v.0"}
    with pytest.raises(CorruptEntry, match="checksum"):
        decode(bytes(bad), layers=[3])


def test_corruptions_raise_corrupt_entry():
    buf = encode(canonical())
    flipped = bytearray(buf)
    flipped[-1] ^= 1
    cases = {
        "payload": bytes(flipped),
        "truncated": buf[:-3],
        "padded": buf + b"\0" * 8,
        "empty": b"",
        "garbage": b"\x00\x01garbage" * 10,
        "header length": b"\xff" * 8 + buf[8:],
        "meta edited": _rewrite_meta(buf, start_pos="7"),
        "newer version": _rewrite_meta(buf, version=str(FORMAT_VERSION + 1)),
        # Version 1 entries carried no lineage: nothing says they are exact.
        "older version": _rewrite_meta(buf, version=str(FORMAT_VERSION - 1)),
        "lineage edited": _rewrite_meta(buf, lineage="a" * 32),
        "bad kind": _rewrite_meta(buf, kind="weird"),
        "no metadata": safetensors.torch.save({"k.0": torch.zeros(2)}),
    }
    for what, data in cases.items():
        with pytest.raises(CorruptEntry):
            decode(data)
            pytest.fail(what)
    with pytest.raises(CorruptEntry, match="newer"):
        decode(cases["newer version"])
    with pytest.raises(CorruptEntry, match="older"):
        decode(cases["older version"])
    with pytest.raises(CorruptEntry, match="model"):
        decode(buf, expect_fingerprint="another-model")
    assert issubclass(CorruptEntry, ValueError)


def test_a_cached_header_never_hides_corruption(tmp_path):
    """Headers are parsed once per distinct header bytes: a good read first must not let a later
    copy with a bad payload, a cut tail or an edited header through (file or buffer reads)."""
    from orbitkv.store.entry import decode_file

    buf = encode(canonical())
    assert same_tensors(decode(buf).tensors, canonical().tensors)
    flipped = bytearray(buf)
    flipped[-1] ^= 1
    for data in (bytes(flipped), buf[:-2], _rewrite_meta(buf, start_pos="7")):
        with pytest.raises(CorruptEntry):
            decode(data)
        path = tmp_path / "entry"
        path.write_bytes(data)
        with open(path, "rb") as f, pytest.raises(CorruptEntry):
            decode_file(f.fileno(), len(data))
    assert same_tensors(decode(buf).tensors, canonical().tensors)


def test_bad_tensor_names_rejected_on_encode():
    with pytest.raises(ValueError):
        make_entry("canonical", {"weights": torch.zeros(1)}, model_fingerprint=FP, layout=LAYOUT)


_GOOD = encode(canonical(num_layers=2, num_tokens=3))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_fuzz_payload_bytes(data):
    buf = bytearray(_GOOD)
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(buf) - 1))
        buf[pos] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(buf)))
    try:
        e = decode(bytes(buf[:cut]) if data.draw(st.booleans()) else bytes(buf))
    except CorruptEntry:
        return
    # Whatever decodes must be exactly the original (header spaces and JSON whitespace may differ).
    ref = decode(_GOOD)
    assert e.meta == ref.meta and same_tensors(e.tensors, ref.tensors)


_meta_values = st.one_of(st.text(max_size=20), st.integers().map(str), st.sampled_from(
    ["", "-1", "1e9", "NaN", "[]", "{}", '{"k.0": "0"}', "canonical", "patch", "99999999999999999999"]))


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(
    ["version", "kind", "num_tokens", "num_layers", "start_pos", "antecedent", "rank", "digests",
     "checksum", "model_fingerprint", "dtype"]), _meta_values, min_size=1))
def test_fuzz_metadata(changes):
    try:
        decode(_rewrite_meta(_GOOD, **changes))
    except CorruptEntry:
        pass


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=256), st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=3))
def test_fuzz_arbitrary_bytes_and_headers(blob, meta):
    for data in (blob, struct.pack("<Q", len(blob)) + blob,
                 _rewrite_meta(safetensors.torch.save(tensors(1, 1), metadata=meta or None), **meta)
                 if meta else blob):
        try:
            decode(data, layers=[0])
        except CorruptEntry:
            pass


_json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.text(max_size=6)),
    lambda inner: st.lists(inner, max_size=4), max_leaves=8)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(["dtype", "shape", "data_offsets"]), _json_values)
def test_fuzz_tensor_index(field, value):
    (n,) = struct.unpack("<Q", _GOOD[:8])
    header = json.loads(_GOOD[8 : 8 + n])
    header["k.0"][field] = value
    raw = json.dumps(header).encode()
    try:
        decode(struct.pack("<Q", len(raw)) + raw + _GOOD[8 + n :])
    except CorruptEntry:
        pass


def test_encode_buffer_is_encode_and_hashing_is_blockwise():
    import numpy as np
    import xxhash
    from orbitkv.store import entry as entry_mod

    big = canonical(num_layers=2, num_tokens=300, heads=8, dim=128)  # 600 KiB tensors: several blocks
    view, header = entry_mod.encode_verified(big)
    assert bytes(view) == encode(big) and view.readonly
    assert entry_mod.read_header(view) == header  # what the memory tier trusts is what a reader parses
    src = np.random.default_rng(0).integers(0, 255, 3 * entry_mod.BLOCK_NBYTES + 17, dtype=np.uint8)
    dst = np.empty_like(src)
    assert entry_mod.copy_hash(dst, src) == xxhash.xxh3_64_hexdigest(src.tobytes())
    assert np.array_equal(dst, src) and entry_mod.copy_hash(dst, None) == xxhash.xxh3_64_hexdigest(src.tobytes())


def test_decoded_tensors_are_private_writable_copies():
    e = canonical(num_layers=3, dtype=torch.float32)
    buf = encode(e)
    got = decode(buf)
    assert same_tensors(got.tensors, e.tensors)
    for t in got.tensors.values():
        t.zero_()  # no warning, no effect on the buffer
    assert same_tensors(decode(buf).tensors, e.tensors)


def test_decode_verified_skips_hashing_but_not_the_size_check():
    from orbitkv.store.entry import decode_verified, read_header

    e = canonical(num_layers=2)
    buf = encode(e)
    header = read_header(buf)
    assert same_tensors(decode_verified(buf, header, layers=[1]).tensors, {n: e.tensors[n] for n in ("k.1", "v.1")})
    with pytest.raises(CorruptEntry):
        decode_verified(buf[:-2], header)
    with pytest.raises(CorruptEntry):
        decode_verified(buf, header, expect_fingerprint="another-model")


def test_decode_file_reads_only_wanted_layers_and_verifies(tmp_path):
    import os

    from orbitkv.store.entry import decode_file

    e = conditioned([cid_of([1])], num_layers=4)
    path = tmp_path / "e"
    path.write_bytes(encode(e))

    def read(**kw):
        fd = os.open(path, os.O_RDONLY)
        try:
            return decode_file(fd, os.path.getsize(path), **kw)
        finally:
            os.close(fd)

    assert same_tensors(read().tensors, e.tensors)
    assert same_tensors(read(layers=[1, 3]).tensors, {n: e.tensors[n] for n in ("k.1", "v.1", "k.3", "v.3")})
    assert read(expect_fingerprint=FP).meta.antecedent == (cid_of([1]),)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # the last tensor in data order
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptEntry, match="checksum"):
        read()
    path.write_bytes(bytes(data[: len(data) // 2]))
    with pytest.raises(CorruptEntry):
        read()
