"""Entry format, shared by the encode side (``entry``) and the decode side (``entry_decode``).

The types (``EntryMeta``, ``Entry``, ``Header``, ``TensorSpec``, ``CorruptEntry``, ``EntryReadFailed``),
the constants and dtype table of the safetensors layout, the metadata fields and their header
checksum, and ``copy_hash`` (copy a block and hash it while it is still in cache). See ``entry`` for
the format.
"""

from __future__ import annotations

import dataclasses
import json
import mmap
import struct
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import xxhash

from .keys import KINDS, is_cid

# 2: entries carry their lineage (exact, or the tag of the policy whose approximate KV they were
# computed over) and a patch names the canonical it was formed against. Version 1 entries did
# neither, so they are refused (a miss).
FORMAT_VERSION = 2
MAX_HEADER_NBYTES = 16 << 20
# More dimensions than any KV, patch or encoder tensor has.
MAX_DIMS = 8
# Copy-and-hash granularity: small enough that a block is still in L2 when it is hashed.
BLOCK_NBYTES = 256 << 10

U64 = struct.Struct("<Q")
DTYPES: dict[str, torch.dtype] = {
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
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
# "enc": an encoder output (entry kind "encoder"), one tensor "enc.0".
_TENSOR_PREFIXES = ("k", "v", "kv", "uk", "wk", "uv", "wv", "enc")
Buffer = bytes | bytearray | memoryview | mmap.mmap


class CorruptEntry(ValueError):
    """The buffer is not a valid entry of this model and format version: treat it as a miss."""


class EntryReadFailed(RuntimeError):
    """Reading an entry failed for a reason outside its bytes (memory, I/O): a miss that keeps the
    entry, which may well be good. Only ``CorruptEntry`` proves an entry bad enough to delete."""


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
    # "" for exact KV; else the policy tag of the approximate KV it was computed over (keys.py).
    lineage: str = ""
    # A patch: the ``checksum`` of the canonical it was formed against ("" for other kinds).
    canonical_checksum: str = ""


@dataclasses.dataclass(slots=True)
class Entry:
    meta: EntryMeta
    tensors: dict[str, torch.Tensor]
    # Set by decode: each side whose layers are one run, as one view (``entry_stacks``); layer
    # ``i`` of ``stacks["k"]`` is ``tensors["k.i"]`` as decoded. Empty for an entry made in memory
    # (``make_entry``) or read in part; a caller that swaps a tensor must drop it.
    stacks: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    # Facts a reader derived from these tensors (its own keys), shared by every zero-copy read of
    # one memory-tier buffer (``tiered_read``): the buffer is immutable, so a fact about its
    # tensors holds for the next read. None where the tensors are this entry's own; a caller
    # that swaps a tensor must drop it, as ``stacks``.
    memo: dict[Any, Any] | None = None


def layer_of(name: str) -> int:
    """Layer index of a tensor name such as ``k.12``; raises ``ValueError`` for other names."""
    prefix, _, index = name.partition(".")
    if prefix not in _TENSOR_PREFIXES or not index.isdigit():
        raise ValueError(f"bad tensor name {name!r}")
    return int(index)


def meta_fields(meta: EntryMeta) -> dict[str, str]:
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
        "lineage": meta.lineage,
        "canonical_checksum": meta.canonical_checksum,
    }


def header_checksum(fields: Mapping[str, str], index: Mapping[str, dict], digests: Mapping) -> str:
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


def parse_meta(md: Mapping[str, str]) -> EntryMeta:
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
        lineage=md["lineage"],
        canonical_checksum=md["canonical_checksum"],
    )
    if meta.kind not in KINDS:
        raise CorruptEntry(f"unknown kind {meta.kind!r}")
    if meta.lineage and (meta.kind != "conditioned" or not is_cid(meta.lineage)):
        raise CorruptEntry(f"bad lineage {meta.lineage!r} for a {meta.kind} entry")
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
