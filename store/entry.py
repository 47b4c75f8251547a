"""Entry format: one safetensors buffer per entry, one tensor per layer, metadata in ``__metadata__``.

safetensors is the on-disk and on-wire format, so the disk tier can mmap an entry and a reader can
slice one layer without touching the rest. Bytes are written by this module (the format is a u64
header length, a JSON header, then the raw tensor data) and stay loadable by ``safetensors`` itself.

Integrity, designed so that a partial read is still verified:
- every tensor has its own xxh3-64 digest, kept in the metadata (``digests``);
- ``checksum`` is the xxh3-128 of every other metadata field plus each tensor's dtype, shape and digest.
A reader checks the header checksum, the exact data length (truncation), and the digest of each
tensor it actually reads. Anything wrong raises ``CorruptEntry``; no other exception leaves ``decode``.

Speed (the store should run at the speed of the memory and the I/O under it):
- ``encode_buffer`` writes into one preallocated buffer, copying each tensor block by block and hashing
  each block while it is still in cache (one pass over memory, not a copy plus a hash pass);
- ``decode`` copies the tensors it reads into one allocation, hashing the *copy* block by block: one
  pass, and what is verified is exactly what the caller gets (a buffer that changes underneath, such
  as an mmap of a file being replaced, cannot slip unverified bytes in);
- ``decode_verified`` skips parsing and hashing for bytes verified before that cannot have changed
  since (the memory tier's private, immutable buffers): it is a plain copy;
- ``decode_file`` reads a file's tensors straight into their final storage (one copy, like ``read``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import mmap
import os
import struct
from collections.abc import Iterable, Mapping

import numpy as np
import torch
import xxhash

from .keys import KINDS, antecedent_hash, is_cid

FORMAT_VERSION = 1
MAX_HEADER_NBYTES = 16 << 20
# Copy-and-hash granularity: small enough that a block is still in L2 when it is hashed.
BLOCK_NBYTES = 256 << 10

_U64 = struct.Struct("<Q")
_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}
_TENSOR_PREFIXES = ("k", "v", "kv", "uk", "wk", "uv", "wv")
Buffer = bytes | bytearray | memoryview | mmap.mmap


class CorruptEntry(ValueError):
    """The buffer is not a valid entry of this model and format version: treat it as a miss."""


@dataclasses.dataclass(frozen=True, slots=True)
class EntryMeta:
    version: int
    kind: str
    model_fingerprint: str
    layout: str
    dtype: str
    num_tokens: int
    num_layers: int
    start_pos: int
    rope_hash: str
    antecedent_hash: str
    antecedent: tuple[str, ...]
    rank: int
    checksum: str = ""


@dataclasses.dataclass(slots=True)
class Entry:
    meta: EntryMeta
    tensors: dict[str, torch.Tensor]


def layer_of(name: str) -> int:
    """Layer index of a tensor name such as ``k.12``; raises ``ValueError`` for other names."""
    prefix, _, index = name.partition(".")
    if prefix not in _TENSOR_PREFIXES or not index.isdigit():
        raise ValueError(f"bad tensor name {name!r}")
    return int(index)


def make_entry(
    kind: str,
    tensors: Mapping[str, torch.Tensor],
    *,
    model_fingerprint: str,
    layout: str,
    start_pos: int = 0,
    rope_hash: str = "",
    antecedent: Iterable[str] = (),
    antecedent_key: str | None = None,
    rank: int = 0,
    dtype: str | None = None,
) -> Entry:
    """Build an ``Entry``, deriving counts and the antecedent hash.

    ``antecedent_key`` overrides the stored antecedent hash (a patch keyed by an orbit key).
    ``dtype`` is the cache dtype; by default the dtype of the first tensor.
    """
    if not tensors:
        raise ValueError("an entry needs at least one tensor")
    names = sorted(tensors, key=lambda n: (layer_of(n), n))
    first = tensors[names[0]]
    antecedent = tuple(antecedent)
    meta = EntryMeta(
        version=FORMAT_VERSION,
        kind=kind,
        model_fingerprint=model_fingerprint,
        layout=layout,
        dtype=dtype or str(first.dtype).removeprefix("torch."),
        num_tokens=int(first.shape[0]) if first.dim() else 0,
        num_layers=len({layer_of(n) for n in names}),
        start_pos=int(start_pos),
        rope_hash=rope_hash,
        antecedent_hash=antecedent_key or (antecedent_hash(antecedent) if antecedent else ""),
        antecedent=antecedent,
        rank=int(rank),
    )
    return Entry(meta, {n: tensors[n] for n in names})


def _raw_bytes(t: torch.Tensor) -> np.ndarray:
    """The tensor's bytes as a flat uint8 array (a view when it is a contiguous CPU tensor)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        t = t.detach().to("cpu").contiguous()
    return t.detach().reshape(-1).view(torch.uint8).numpy()


def _meta_fields(meta: EntryMeta) -> dict[str, str]:
    return {
        "version": str(meta.version),
        "kind": meta.kind,
        "model_fingerprint": meta.model_fingerprint,
        "layout": meta.layout,
        "dtype": meta.dtype,
        "num_tokens": str(meta.num_tokens),
        "num_layers": str(meta.num_layers),
        "start_pos": str(meta.start_pos),
        "rope_hash": meta.rope_hash,
        "antecedent_hash": meta.antecedent_hash,
        "antecedent": ",".join(meta.antecedent),
        "rank": str(meta.rank),
    }


def _header_checksum(fields: Mapping[str, str], index: Mapping[str, dict], digests: Mapping) -> str:
    covered = {
        "meta": dict(sorted(fields.items())),
        "tensors": {n: [index[n]["dtype"], index[n]["shape"], digests[n]] for n in sorted(index)},
    }
    return xxhash.xxh3_128_hexdigest(json.dumps(covered, sort_keys=True, separators=(",", ":")).encode())


def copy_hash(dst: np.ndarray, src: Buffer | np.ndarray | None) -> str:
    """xxh3-64 hex digest of ``src`` copied into ``dst`` (uint8, same length); hashes ``dst``.

    Block by block, so each block is hashed while it is still in cache. ``src=None`` hashes ``dst``
    in place (nothing to copy). The digest equals ``xxh3_64_hexdigest`` of the whole buffer.
    """
    n = dst.nbytes
    source = None if src is None else np.frombuffer(src, dtype=np.uint8) if not isinstance(src, np.ndarray) else src
    if n <= BLOCK_NBYTES:
        if source is not None:
            np.copyto(dst, source)
        return xxhash.xxh3_64_hexdigest(dst)
    h = xxhash.xxh3_64()
    for begin in range(0, n, BLOCK_NBYTES):
        block = dst[begin : begin + BLOCK_NBYTES]
        if source is not None:
            np.copyto(block, source[begin : begin + BLOCK_NBYTES])
        h.update(block)
    return h.hexdigest()


def _encode_header(fields: Mapping[str, str], index: Mapping[str, dict], digests: Mapping[str, str]) -> bytes:
    metadata = dict(fields)
    metadata["digests"] = json.dumps(digests, sort_keys=True, separators=(",", ":"))
    metadata["checksum"] = _header_checksum(fields, index, digests)
    header = json.dumps({"__metadata__": metadata, **index}, separators=(",", ":")).encode()
    return header + b" " * (-len(header) % 8)


def _plan(entry: Entry) -> tuple[dict[str, str], dict[str, dict], list[np.ndarray]]:
    fields = _meta_fields(entry.meta)
    # Widest dtypes first keeps every tensor aligned to its element size, as safetensors does.
    names = sorted(entry.tensors, key=lambda n: (-entry.tensors[n].element_size(), n))
    index: dict[str, dict] = {}
    payloads: list[np.ndarray] = []
    offset = 0
    for name in names:
        layer_of(name)
        t = entry.tensors[name]
        if t.dtype not in _DTYPE_NAMES:
            raise TypeError(f"unsupported dtype {t.dtype} for {name}")
        raw = _raw_bytes(t)
        index[name] = {
            "dtype": _DTYPE_NAMES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + raw.nbytes],
        }
        payloads.append(raw)
        offset += raw.nbytes
    return fields, index, payloads


def encode(entry: Entry) -> bytes:
    """Serialize to safetensors bytes with the metadata and checksums filled in."""
    fields, index, payloads = _plan(entry)
    digests = {name: xxhash.xxh3_64_hexdigest(raw) for name, raw in zip(index, payloads, strict=True)}
    header = _encode_header(fields, index, digests)
    return b"".join([_U64.pack(len(header)), header, *payloads])


def encode_buffer(entry: Entry) -> memoryview:
    """``encode`` into a private buffer, returned as a read-only ``memoryview`` (same bytes).

    One pass over the tensors: each is copied into place and hashed block by block. Nothing else
    holds the buffer, so the view is as immutable as ``bytes`` (the memory tier relies on that).
    """
    return encode_verified(entry)[0]


def encode_verified(entry: Entry) -> tuple[memoryview, Header]:
    """``encode_buffer`` plus the buffer's ``Header``, equal to what ``read_header`` would parse."""
    fields, index, payloads = _plan(entry)
    # Digests and checksum are fixed-width hex, so the header's length is known before they are.
    dummy = {"__metadata__": {**fields, "digests": json.dumps(dict.fromkeys(index, "0" * 16), sort_keys=True,
                                                               separators=(",", ":")), "checksum": "0" * 32}, **index}
    header_nbytes = len(json.dumps(dummy, separators=(",", ":")).encode())
    header_nbytes += -header_nbytes % 8
    base = 8 + header_nbytes
    out = np.empty(base + sum(raw.nbytes for raw in payloads), dtype=np.uint8)
    digests = {}
    for (name, info), raw in zip(index.items(), payloads, strict=True):
        begin, stop = info["data_offsets"]
        digests[name] = copy_hash(out[base + begin : base + stop], raw)
    header = _encode_header(fields, index, digests)
    if len(header) != header_nbytes:  # cannot happen with fixed-width digests; never write a bad entry
        raise AssertionError("entry header length changed while encoding")
    out[:8] = np.frombuffer(_U64.pack(header_nbytes), dtype=np.uint8)
    out[8:base] = np.frombuffer(header, dtype=np.uint8)
    # The metadata as a reader parses it back (strings -> fields), without parsing the JSON again.
    meta = _parse_meta({**fields, "checksum": _header_checksum(fields, index, digests)})
    specs = {
        name: TensorSpec(name, _DTYPES[info["dtype"]], tuple(info["shape"]), base + info["data_offsets"][0],
                         base + info["data_offsets"][1])
        for name, info in sorted(index.items(), key=lambda item: item[1]["data_offsets"][0])
    }
    return memoryview(out).toreadonly(), Header(meta, specs, digests, out.nbytes)


def _parse_meta(md: Mapping[str, str]) -> EntryMeta:
    antecedent = tuple(md["antecedent"].split(",")) if md["antecedent"] else ()
    if not all(is_cid(c) for c in antecedent):
        raise CorruptEntry("bad antecedent list")
    meta = EntryMeta(
        version=int(md["version"]),
        kind=md["kind"],
        model_fingerprint=md["model_fingerprint"],
        layout=md["layout"],
        dtype=md["dtype"],
        num_tokens=int(md["num_tokens"]),
        num_layers=int(md["num_layers"]),
        start_pos=int(md["start_pos"]),
        rope_hash=md["rope_hash"],
        antecedent_hash=md["antecedent_hash"],
        antecedent=antecedent,
        rank=int(md["rank"]),
        checksum=md["checksum"],
    )
    if meta.kind not in KINDS:
        raise CorruptEntry(f"unknown kind {meta.kind!r}")
    return meta


@dataclasses.dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute offsets in the entry's bytes
    stop: int


@dataclasses.dataclass(frozen=True, slots=True)
class Header:
    """A parsed and verified header: what a reader needs to slice and check the tensors."""

    meta: EntryMeta
    tensors: dict[str, TensorSpec]  # in data order
    digests: dict[str, str]
    nbytes: int  # the whole entry: 8 + header + data

    @property
    def data_begin(self) -> int:
        return min((t.begin for t in self.tensors.values()), default=self.nbytes)


def _parse_header(raw: bytes | memoryview, total_nbytes: int) -> Header:
    """``raw`` is the JSON header (without the length prefix); ``total_nbytes`` the entry's size."""
    header_nbytes = len(raw)
    header = json.loads(bytes(raw))
    if not isinstance(header, dict) or not isinstance(header.get("__metadata__"), dict):
        raise CorruptEntry("no metadata")
    md = header.pop("__metadata__")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in md.items()):
        raise CorruptEntry("metadata must map str to str")
    version = int(md.get("version", "0"))
    if version > FORMAT_VERSION:
        raise CorruptEntry(f"entry format version {version} is newer than {FORMAT_VERSION}")
    if version < 1:
        raise CorruptEntry(f"bad entry format version {version}")
    meta = _parse_meta(md)
    digests = json.loads(md["digests"])
    if not isinstance(digests, dict) or set(digests) != set(header):
        raise CorruptEntry("digest list does not match the tensors")
    base = 8 + header_nbytes
    data_nbytes = total_nbytes - base
    end = 0
    specs = []
    for name, info in header.items():
        layer_of(name)
        dtype = _DTYPES[info["dtype"]]
        shape = info["shape"]
        begin, stop = info["data_offsets"]
        if not all(isinstance(d, int) and d >= 0 for d in [*shape, begin, stop]):
            raise CorruptEntry(f"bad shape or offsets for {name}")
        if stop - begin != math.prod(shape) * dtype.itemsize or begin > stop:
            raise CorruptEntry(f"size mismatch for {name}")
        end = max(end, stop)
        specs.append(TensorSpec(name, dtype, tuple(shape), base + begin, base + stop))
    if end != data_nbytes:
        raise CorruptEntry(f"data is {data_nbytes} bytes, header says {end}: truncated or padded")
    fields = {k: md[k] for k in _meta_fields(meta)}
    if _header_checksum(fields, header, digests) != meta.checksum:
        raise CorruptEntry("header checksum mismatch")
    specs.sort(key=lambda t: t.begin)
    return Header(meta, {t.name: t for t in specs}, digests, total_nbytes)


def _header_nbytes(prefix: bytes | memoryview, total_nbytes: int) -> int:
    if len(prefix) < 8 or total_nbytes < 8:
        raise CorruptEntry("truncated: no header length")
    (header_nbytes,) = _U64.unpack(prefix[:8])
    if header_nbytes > MAX_HEADER_NBYTES or 8 + header_nbytes > total_nbytes:
        raise CorruptEntry("truncated or bad header length")
    return header_nbytes


def _read_header(buf: memoryview) -> Header:
    # bytes, not views: a view kept alive by a traceback would stop the caller closing its mmap
    header_nbytes = _header_nbytes(bytes(buf[:8]), buf.nbytes)
    return _parse_header(bytes(buf[8 : 8 + header_nbytes]), buf.nbytes)


def _wanted(names: Iterable[str], layers: int | Iterable[int] | None) -> list[str]:
    if layers is None:
        chosen = list(names)
    else:
        wanted = {layers} if isinstance(layers, int) else set(layers)
        chosen = [n for n in names if layer_of(n) in wanted]
    return sorted(chosen, key=lambda n: (layer_of(n), n))


def _wrap_errors(fn):
    """Any parse failure of untrusted bytes is corruption (CorruptEntry), never a crash."""

    def wrapped(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except CorruptEntry:
            raise
        except Exception as exc:
            raise CorruptEntry(f"malformed entry: {type(exc).__name__}: {exc}") from None

    return wrapped


@_wrap_errors
def read_header(buf: Buffer) -> Header:
    """The verified header (checksum, lengths) of an entry; tensor digests are not checked."""
    with memoryview(buf) as raw, raw.cast("B") as view:
        return _read_header(view)



def _allocate(specs: list[TensorSpec]) -> tuple[torch.Tensor, dict[str, int]]:
    """One uint8 storage for these tensors (data order, each aligned to its element size)."""
    offsets: dict[str, int] = {}
    total = 0
    for spec in specs:
        align = spec.dtype.itemsize
        total = -(-total // align) * align
        offsets[spec.name] = total
        total += spec.stop - spec.begin
    # numpy rather than torch.empty: numpy asks for transparent huge pages on large arrays, which
    # makes the first touch of a fresh multi-MiB buffer about twice as fast.
    return torch.from_numpy(np.empty(total, dtype=np.uint8)), offsets


def _as_tensor(storage: torch.Tensor, offset: int, spec: TensorSpec) -> torch.Tensor:
    if spec.stop == spec.begin:
        return torch.empty(spec.shape, dtype=spec.dtype)
    return storage[offset : offset + spec.stop - spec.begin].view(spec.dtype).reshape(spec.shape)


def _build(
    view: memoryview, header: Header, layers: int | Iterable[int] | None, *, is_verify: bool
) -> dict[str, torch.Tensor]:
    """Private copies of the wanted tensors (one allocation), each verified while copied."""
    names = _wanted(header.tensors, layers)
    specs = sorted((header.tensors[n] for n in names), key=lambda t: t.begin)
    storage, offsets = _allocate(specs)
    dst = storage.numpy()
    by_name: dict[str, torch.Tensor] = {}
    bad = _copy_into(dst, view, specs, offsets, header.digests if is_verify else None)
    if bad is not None:
        raise CorruptEntry(f"payload checksum mismatch in {bad}")
    for spec in specs:
        by_name[spec.name] = _as_tensor(storage, offsets[spec.name], spec)
    return {n: by_name[n] for n in names}


def _copy_into(
    dst: np.ndarray,
    view: memoryview,
    specs: list[TensorSpec],
    offsets: Mapping[str, int],
    digests: Mapping[str, str] | None,
) -> str | None:
    """Copy (and check, with ``digests``) each tensor; the name of the first bad one, or None.

    Returns instead of raising: an exception's traceback would keep this frame's views of ``view``
    alive, and the caller could not release it (or close its mmap).
    """
    src = np.frombuffer(view, dtype=np.uint8)
    for spec in specs:
        out = dst[offsets[spec.name] : offsets[spec.name] + spec.stop - spec.begin]
        if digests is None:
            np.copyto(out, src[spec.begin : spec.stop])
        elif copy_hash(out, src[spec.begin : spec.stop]) != digests[spec.name]:
            return spec.name
    return None


def verify_payload(buf: Buffer, header: Header, *, skip: Iterable[str] = ()) -> None:
    """Check the digest of every tensor not in ``skip`` without copying; raises ``CorruptEntry``."""
    bad = _first_bad(buf, header, set(skip))
    if bad is not None:
        raise CorruptEntry(f"payload checksum mismatch in {bad}")


def _first_bad(buf: Buffer, header: Header, skip: set[str]) -> str | None:
    with memoryview(buf) as raw:
        src = np.frombuffer(raw.cast("B"), dtype=np.uint8)
        for name, spec in header.tensors.items():
            if name not in skip and xxhash.xxh3_64_hexdigest(src[spec.begin : spec.stop]) != header.digests[name]:
                return name
        del src
    return None


class EntryReader:
    """A verified header over a buffer (bytes or an mmap); layers are read and verified on demand.

    This is the streaming path: open the disk tier's mmap, check the header once, then read layer
    0 while later layers are still on disk. ``close`` releases the buffer (and closes an mmap).
    """

    @_wrap_errors
    def __init__(self, buf: Buffer, *, expect_fingerprint: str | None = None) -> None:
        self._owner = buf
        self._view = memoryview(buf).cast("B")
        try:
            self.header = _read_header(self._view)
            self.meta = self.header.meta
            _check_fingerprint(self.meta, expect_fingerprint)
        except BaseException:
            self._view.release()  # else the caller could not close its mmap
            raise
        self.layers = sorted({layer_of(n) for n in self.header.tensors})
        self.tier = ""  # set by TieredStore.open: which tier the bytes came from

    @_wrap_errors
    def read(self, layers: int | Iterable[int] | None = None) -> dict[str, torch.Tensor]:
        # Private copies: the caller may keep the tensors after the mmap or buffer is gone.
        return _build(self._view, self.header, layers, is_verify=True)

    def close(self) -> None:
        self._view.release()
        if hasattr(self._owner, "close"):
            self._owner.close()

    def __enter__(self) -> EntryReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_fingerprint(meta: EntryMeta, expect_fingerprint: str | None) -> None:
    if expect_fingerprint is not None and meta.model_fingerprint != expect_fingerprint:
        raise CorruptEntry(f"entry of model {meta.model_fingerprint!r}, expected {expect_fingerprint!r}")


def read_meta(buf: Buffer) -> EntryMeta:
    """Verified metadata only (header checksum and length), without reading any tensor."""
    return decode(buf, layers=()).meta


@_wrap_errors
def decode_checked(
    buf: Buffer,
    *,
    expect_fingerprint: str | None = None,
    layers: int | Iterable[int] | None = None,
    is_verify_all: bool = False,
) -> tuple[Entry, Header]:
    """``decode`` that also returns the verified header. ``is_verify_all`` checks the digests of the
    layers not read too, so that the whole buffer is known good (before it goes to the memory tier)."""
    with memoryview(buf) as raw, raw.cast("B") as view:
        header = _read_header(view)
        _check_fingerprint(header.meta, expect_fingerprint)
        tensors = _build(view, header, layers, is_verify=True)
        if is_verify_all and layers is not None:
            verify_payload(view, header, skip=tensors)
        return Entry(header.meta, tensors), header


def decode(
    buf: Buffer,
    *,
    expect_fingerprint: str | None = None,
    layers: int | Iterable[int] | None = None,
) -> Entry:
    """Parse and verify an entry; ``layers`` reads only those layers (an int, a range, a list).

    Accepts bytes, bytearray, memoryview or an mmap (left open). Raises ``CorruptEntry`` and
    nothing else.
    """
    return decode_checked(buf, expect_fingerprint=expect_fingerprint, layers=layers)[0]


@_wrap_errors
def decode_verified(
    buf: Buffer,
    header: Header,
    *,
    expect_fingerprint: str | None = None,
    layers: int | Iterable[int] | None = None,
) -> Entry:
    """Tensors of an entry already verified as ``header``, without parsing or hashing again.

    Only for bytes that cannot have changed since they were verified: the memory tier's private,
    immutable buffers. A size mismatch (not the bytes verified) is still ``CorruptEntry``.
    """
    with memoryview(buf) as raw, raw.cast("B") as view:
        if view.nbytes != header.nbytes:
            raise CorruptEntry("buffer is not the one verified")
        _check_fingerprint(header.meta, expect_fingerprint)
        return Entry(header.meta, _build(view, header, layers, is_verify=False))


@_wrap_errors
def decode_file(
    fd: int,
    nbytes: int,
    *,
    expect_fingerprint: str | None = None,
    layers: int | Iterable[int] | None = None,
) -> Entry:
    """Decode an entry file of ``nbytes`` from an open descriptor, reading each wanted tensor
    straight into its final storage (one copy, as ``read`` does), then verifying that storage."""
    prefix = os.pread(fd, 8, 0)
    header_nbytes = _header_nbytes(prefix, nbytes)
    header = _parse_header(_pread_exact(fd, header_nbytes, 8), nbytes)
    _check_fingerprint(header.meta, expect_fingerprint)
    names = _wanted(header.tensors, layers)
    specs = sorted((header.tensors[n] for n in names), key=lambda t: t.begin)
    storage, offsets = _allocate(specs)
    dst = storage.numpy()
    # Read runs of tensors that are adjacent both in the file and in the storage with one call.
    i = 0
    while i < len(specs):
        j = i + 1
        while j < len(specs) and specs[j].begin == specs[j - 1].stop and (
            offsets[specs[j].name] - offsets[specs[i].name] == specs[j].begin - specs[i].begin
        ):
            j += 1
        first, last = specs[i], specs[j - 1]
        at = offsets[first.name]
        _readinto_exact(fd, dst[at : at + last.stop - first.begin], first.begin)
        i = j
    tensors = {}
    for spec in specs:
        at = offsets[spec.name]
        if copy_hash(dst[at : at + spec.stop - spec.begin], None) != header.digests[spec.name]:
            raise CorruptEntry(f"payload checksum mismatch in {spec.name}")
        tensors[spec.name] = _as_tensor(storage, at, spec)
    return Entry(header.meta, {n: tensors[n] for n in names})


def _pread_exact(fd: int, n: int, offset: int) -> bytes:
    data = os.pread(fd, n, offset)
    if len(data) != n:
        raise CorruptEntry("truncated: file shorter than its header says")
    return data


def _readinto_exact(fd: int, dst: np.ndarray, offset: int) -> None:
    view = memoryview(dst).cast("B")
    done = 0
    while done < view.nbytes:
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise CorruptEntry("truncated: file shorter than its header says")
        done += n
