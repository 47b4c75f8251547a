"""Entry format: one safetensors buffer per entry, one tensor per layer, metadata in ``__metadata__``.

safetensors is the on-disk and on-wire format, so the disk tier can mmap an entry and a reader can
slice one layer without touching the rest. Bytes are written by this module (the format is a u64
header length, a JSON header, then the raw tensor data) and stay loadable by ``safetensors`` itself.

Integrity, designed so that a partial read is still verified:
- every tensor has its own xxh3-64 digest, kept in the metadata (``digests``);
- ``checksum`` is the xxh3-128 of every other metadata field plus each tensor's dtype, shape and digest.
A reader checks the header checksum, the exact data length (truncation), and the digest of each
tensor it actually reads. Anything wrong raises ``CorruptEntry``; no other exception leaves ``decode``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import mmap
import struct
from collections.abc import Iterable, Mapping

import torch
import xxhash

from .keys import KINDS, antecedent_hash, is_cid

FORMAT_VERSION = 1
MAX_HEADER_NBYTES = 16 << 20

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


def _raw_bytes(t: torch.Tensor) -> memoryview:
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


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


def encode(entry: Entry) -> bytes:
    """Serialize to safetensors bytes with the metadata and checksums filled in."""
    fields = _meta_fields(entry.meta)
    # Widest dtypes first keeps every tensor aligned to its element size, as safetensors does.
    names = sorted(entry.tensors, key=lambda n: (-entry.tensors[n].element_size(), n))
    index: dict[str, dict] = {}
    digests: dict[str, str] = {}
    payloads: list[memoryview] = []
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
        digests[name] = xxhash.xxh3_64_hexdigest(raw)
        payloads.append(raw)
        offset += raw.nbytes
    metadata = dict(fields)
    metadata["digests"] = json.dumps(digests, sort_keys=True, separators=(",", ":"))
    metadata["checksum"] = _header_checksum(fields, index, digests)
    header = json.dumps({"__metadata__": metadata, **index}, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    return b"".join([_U64.pack(len(header)), header, *payloads])


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


def _read_header(buf: memoryview) -> tuple[EntryMeta, dict[str, dict], dict[str, str], int]:
    if buf.nbytes < 8:
        raise CorruptEntry("truncated: no header length")
    (header_nbytes,) = _U64.unpack(buf[:8])
    if header_nbytes > MAX_HEADER_NBYTES or 8 + header_nbytes > buf.nbytes:
        raise CorruptEntry("truncated or bad header length")
    header = json.loads(bytes(buf[8 : 8 + header_nbytes]))
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
    data_nbytes = buf.nbytes - 8 - header_nbytes
    end = 0
    for name, info in header.items():
        layer_of(name)
        dtype = _DTYPES[info["dtype"]]
        shape = info["shape"]
        begin, stop = info["data_offsets"]
        if not all(isinstance(d, int) and d >= 0 for d in [*shape, begin, stop]):
            raise CorruptEntry(f"bad shape or offsets for {name}")
        itemsize = torch.empty((), dtype=dtype).element_size()
        if stop - begin != math.prod(shape) * itemsize or begin > stop:
            raise CorruptEntry(f"size mismatch for {name}")
        end = max(end, stop)
    if end != data_nbytes:
        raise CorruptEntry(f"data is {data_nbytes} bytes, header says {end}: truncated or padded")
    fields = {k: md[k] for k in _meta_fields(meta)}
    if _header_checksum(fields, header, digests) != meta.checksum:
        raise CorruptEntry("header checksum mismatch")
    return meta, header, digests, 8 + header_nbytes


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
            self.meta, self._index, self._digests, self._base = _read_header(self._view)
            if expect_fingerprint is not None and self.meta.model_fingerprint != expect_fingerprint:
                raise CorruptEntry(
                    f"entry of model {self.meta.model_fingerprint!r}, expected {expect_fingerprint!r}"
                )
        except BaseException:
            self._view.release()  # else the caller could not close its mmap
            raise
        self.layers = sorted({layer_of(n) for n in self._index})
        self.tier = ""  # set by TieredStore.open: which tier the bytes came from

    @_wrap_errors
    def read(self, layers: int | Iterable[int] | None = None) -> dict[str, torch.Tensor]:
        tensors: dict[str, torch.Tensor] = {}
        for name in _wanted(self._index, layers):
            info = self._index[name]
            begin, stop = info["data_offsets"]
            raw = self._view[self._base + begin : self._base + stop]
            if xxhash.xxh3_64_hexdigest(raw) != self._digests[name]:
                raise CorruptEntry(f"payload checksum mismatch in {name}")
            # A private copy: the caller may keep the tensor after the mmap or buffer is gone.
            data = bytearray(raw)
            dtype = _DTYPES[info["dtype"]]
            t = torch.frombuffer(data, dtype=dtype) if data else torch.empty(0, dtype=dtype)
            tensors[name] = t.reshape(info["shape"])
        return tensors

    def close(self) -> None:
        self._view.release()
        if hasattr(self._owner, "close"):
            self._owner.close()

    def __enter__(self) -> EntryReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_meta(buf: Buffer) -> EntryMeta:
    """Verified metadata only (header checksum and length), without reading any tensor."""
    return decode(buf, layers=()).meta


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
    with memoryview(buf) as view:
        reader = EntryReader(view, expect_fingerprint=expect_fingerprint)
        try:
            return Entry(reader.meta, reader.read(layers))
        finally:
            reader.close()
