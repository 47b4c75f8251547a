"""Entry headers: the length prefix and the JSON header, parsed and verified (``entry_decode``).

A header is trusted only once it parses to the current format version, its tensors tile the data
exactly (no overlap, no gap, nothing past the end: a read allocates at most the entry's own size)
and its checksum over the metadata, specs and digests matches. Anything else raises
``CorruptEntry``.
"""

from __future__ import annotations

import functools
import json
import math

from .entry_format import (
    DTYPES,
    FORMAT_VERSION,
    MAX_DIMS,
    MAX_HEADER_NBYTES,
    U64,
    CorruptEntry,
    Header,
    TensorSpec,
    header_checksum,
    layer_of,
    meta_fields,
    parse_meta,
)


def parse_header(raw: bytes | memoryview, total_nbytes: int) -> Header:
    """``raw`` is the JSON header (without the length prefix); ``total_nbytes`` the entry's size.

    The same header bytes of an entry of the same size always parse (and verify) the same way, so
    a header seen before, as a hot entry read again from disk or Redis is, comes from a small
    cache keyed by those bytes: parsing costs more than reading a 1 MiB entry from the page cache.
    A result is shared: read-only. Tensor digests are still checked on every read.
    """
    return _parse_cached(bytes(raw), total_nbytes)


@functools.lru_cache(maxsize=512)
def _parse_cached(raw: bytes, total_nbytes: int) -> Header:
    num_header_bytes = len(raw)
    header = json.loads(bytes(raw))
    if not isinstance(header, dict) or not isinstance(header.get("__metadata__"), dict):
        raise CorruptEntry("no metadata")
    md = header.pop("__metadata__")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in md.items()):
        raise CorruptEntry("metadata must map str to str")
    version = int(md.get("version", "0"))
    if version > FORMAT_VERSION:
        raise CorruptEntry(f"entry format version {version} is newer than {FORMAT_VERSION}")
    if version < FORMAT_VERSION:
        # Older entries carry no lineage: nothing says their KV is exact.
        raise CorruptEntry(f"entry format version {version} is older than {FORMAT_VERSION}")
    meta = parse_meta(md)
    digests = json.loads(md["digests"])
    if not isinstance(digests, dict) or set(digests) != set(header):
        raise CorruptEntry("digest list does not match the tensors")
    base = 8 + num_header_bytes
    data_nbytes = total_nbytes - base
    specs = []
    for name, info in header.items():
        layer_of(name)
        dtype = DTYPES[info["dtype"]]
        shape = info["shape"]
        begin, stop = info["data_offsets"]
        if not all(isinstance(d, int) and d >= 0 for d in [*shape, begin, stop]):
            raise CorruptEntry(f"bad shape or offsets for {name}")
        # torch's strides must fit int64 even for an empty tensor (a 0 beside huge dims).
        if len(shape) > MAX_DIMS or math.prod(max(d, 1) for d in shape) >= 2**63:
            raise CorruptEntry(f"shape of {name} is too large")
        if stop - begin != math.prod(shape) * dtype.itemsize or begin > stop:
            raise CorruptEntry(f"size mismatch for {name}")
        specs.append(TensorSpec(name, dtype, tuple(shape), base + begin, base + stop))
    specs.sort(key=lambda t: (t.begin, t.stop))
    # The tensors must tile the data, as safetensors requires: overlapping tensors would let a
    # small entry decode into many times its size (each read allocates every tensor's bytes).
    end = 0
    for spec in specs:
        if spec.begin - base != end:
            raise CorruptEntry(f"tensor {spec.name} overlaps another or leaves a gap")
        end = spec.stop - base
    if end != data_nbytes:
        raise CorruptEntry(f"data is {data_nbytes} bytes, header says {end}: truncated or padded")
    fields = {k: md[k] for k in meta_fields(meta)}
    if header_checksum(fields, header, digests) != meta.checksum:
        raise CorruptEntry("header checksum mismatch")
    return Header(meta, {t.name: t for t in specs}, digests, total_nbytes)


def header_nbytes(prefix: bytes | memoryview, total_nbytes: int) -> int:
    """The JSON header's length from an entry's 8-byte prefix, checked against its size."""
    if len(prefix) < 8 or total_nbytes < 8:
        raise CorruptEntry("truncated: no header length")
    (num,) = U64.unpack(prefix[:8])
    if num > MAX_HEADER_NBYTES or 8 + num > total_nbytes:
        raise CorruptEntry("truncated or bad header length")
    return num


def header_of(buf: memoryview) -> Header:
    """The parsed header of a whole entry in ``buf``."""
    # bytes, not views: a view kept alive by a traceback would stop the caller closing its mmap
    num = header_nbytes(bytes(buf[:8]), buf.nbytes)
    return parse_header(bytes(buf[8 : 8 + num]), buf.nbytes)
