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

Modules: ``entry_format`` (types, constants, checksums), this one (``make_entry`` and encoding) and
``entry_decode`` (parsing, verification, ``decode*``, ``EntryReader``); every public name of the
three is importable from here.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping

import numpy as np
import torch
import xxhash

from . import buffers
from .entry_decode import (
    EntryReader,
    decode,
    decode_checked,
    decode_file,
    decode_verified,
    read_header,
    read_meta,
    verify_payload,
)
from .entry_format import (
    BLOCK_NBYTES,
    DTYPE_NAMES,
    DTYPES,
    FORMAT_VERSION,
    MAX_HEADER_NBYTES,
    U64,
    Buffer,
    CorruptEntry,
    Entry,
    EntryMeta,
    Header,
    TensorSpec,
    copy_hash,
    header_checksum,
    layer_of,
    meta_fields,
    parse_meta,
)
from .keys import antecedent_hash

__all__ = [
    "BLOCK_NBYTES",
    "FORMAT_VERSION",
    "MAX_HEADER_NBYTES",
    "Buffer",
    "CorruptEntry",
    "Entry",
    "EntryMeta",
    "EntryReader",
    "Header",
    "TensorSpec",
    "copy_hash",
    "decode",
    "decode_checked",
    "decode_file",
    "decode_verified",
    "encode",
    "encode_buffer",
    "encode_verified",
    "checksum_of",
    "layer_of",
    "make_entry",
    "read_header",
    "read_meta",
    "verify_payload",
]


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
    lineage: str = "",
    canonical_checksum: str = "",
) -> Entry:
    """Build an ``Entry``, deriving counts and the antecedent hash.

    ``antecedent_key`` overrides the stored antecedent hash (a patch keyed by an orbit key).
    ``dtype`` is the cache dtype; by default the dtype of the first tensor. ``lineage``: "" for
    exact KV, else the policy tag of approximate KV; ``canonical_checksum``: a patch's canonical.
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
        antecedent_hash=antecedent_key or antecedent_hash(antecedent),
        antecedent=antecedent,
        rank=int(rank),
        lineage=lineage,
        canonical_checksum=canonical_checksum,
    )
    return Entry(meta, {n: tensors[n] for n in names})


# Integer dtypes of each element size: numpy has no bfloat16, so tensors are viewed as these.
_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _raw_bytes(t: torch.Tensor) -> np.ndarray:
    """The tensor's bytes as a flat uint8 array (a view when it is a contiguous CPU tensor)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        t = t.detach().to("cpu").contiguous()
    # Two torch calls; the flattening is numpy's (far cheaper per call than torch's).
    return t.detach().view(_WORDS[t.element_size()]).numpy().view(np.uint8).reshape(-1)


def _encode_header(fields: Mapping[str, str], index: Mapping[str, dict], digests: Mapping[str, str],
                   checksum: str) -> bytes:
    metadata = dict(fields)
    metadata["digests"] = json.dumps(digests, sort_keys=True, separators=(",", ":"))
    metadata["checksum"] = checksum
    header = json.dumps({"__metadata__": metadata, **index}, separators=(",", ":")).encode()
    return header + b" " * _padding(len(header))


def _padding(header_nbytes: int) -> int:
    """Spaces after the JSON header so the tensor data starts on a 64-byte boundary of the entry
    (8-byte length + header): copies in and out of an aligned buffer then run at full speed. The
    safetensors format allows the padding (it pads to 8 itself)."""
    return -(8 + header_nbytes) % 64


def _plan(entry: Entry) -> tuple[dict[str, str], dict[str, dict], list[np.ndarray]]:
    fields = meta_fields(entry.meta)
    # Widest dtypes first keeps every tensor aligned to its element size, as safetensors does;
    # then by kind and layer (k.0, k.1, ..., k.15, not k.1, k.10), so a read's K of every layer is
    # one run at a constant step that a load takes as one view (``worker/loading.layer_stacks``).
    names = sorted(entry.tensors, key=lambda n: (-entry.tensors[n].element_size(), *_kind_layer(n)))
    index: dict[str, dict] = {}
    payloads: list[np.ndarray] = []
    offset = 0
    for name in names:
        t = entry.tensors[name]
        if t.dtype not in DTYPE_NAMES:
            raise TypeError(f"unsupported dtype {t.dtype} for {name}")
        raw = _raw_bytes(t)
        index[name] = {
            "dtype": DTYPE_NAMES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + raw.nbytes],
        }
        payloads.append(raw)
        offset += raw.nbytes
    return fields, index, payloads


def _kind_layer(name: str) -> tuple[str, int]:
    """``("k", 12)`` for ``k.12``; raises ``ValueError`` for a name that is no entry tensor's."""
    return name.partition(".")[0], layer_of(name)


def encode(entry: Entry) -> bytes:
    """Serialize to safetensors bytes with the metadata and checksums filled in."""
    fields, index, payloads = _plan(entry)
    digests = {name: xxhash.xxh3_64_hexdigest(raw) for name, raw in zip(index, payloads, strict=True)}
    header = _encode_header(fields, index, digests, header_checksum(fields, index, digests))
    return b"".join([U64.pack(len(header)), header, *payloads])


def checksum_of(entry: Entry) -> str:
    """The ``checksum`` this entry carries once encoded (a decoded entry has it already): the hash
    of its metadata and every tensor's bytes, so a patch can name the canonical it was formed on."""
    if entry.meta.checksum:
        return entry.meta.checksum
    fields, index, payloads = _plan(entry)
    digests = {name: xxhash.xxh3_64_hexdigest(raw) for name, raw in zip(index, payloads, strict=True)}
    return header_checksum(fields, index, digests)


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
    header_nbytes += _padding(header_nbytes)
    base = 8 + header_nbytes
    out = buffers.take(base + sum(raw.nbytes for raw in payloads))
    digests = {}
    for (name, info), raw in zip(index.items(), payloads, strict=True):
        begin, stop = info["data_offsets"]
        digests[name] = copy_hash(out[base + begin : base + stop], raw)
    checksum = header_checksum(fields, index, digests)
    header = _encode_header(fields, index, digests, checksum)
    if len(header) != header_nbytes:  # cannot happen with fixed-width digests; never write a bad entry
        raise AssertionError("entry header length changed while encoding")
    out[:8] = np.frombuffer(U64.pack(header_nbytes), dtype=np.uint8)
    out[8:base] = np.frombuffer(header, dtype=np.uint8)
    # The metadata as a reader parses it back (strings -> fields), without parsing the JSON again.
    meta = parse_meta({**fields, "checksum": checksum})
    specs = {
        name: TensorSpec(name, DTYPES[info["dtype"]], tuple(info["shape"]), base + info["data_offsets"][0],
                         base + info["data_offsets"][1])
        for name, info in sorted(index.items(), key=lambda item: item[1]["data_offsets"][0])
    }
    return memoryview(out).toreadonly(), Header(meta, specs, digests, out.nbytes)
