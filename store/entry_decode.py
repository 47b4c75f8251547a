"""Entry decode side: an entry's header (parsed and verified in ``entry_header``), then its tensors.

A reader checks the header checksum, the exact data length (truncation), that the tensors tile
the data exactly (no overlap, no gap: what a read allocates is at most the entry's own size), and
the digest of each tensor it actually reads. Anything wrong with the bytes raises ``CorruptEntry``
(the caller may delete the entry); a failure of this process while reading (memory, I/O) raises
``EntryReadFailed`` (a miss that keeps the entry). No other exception leaves ``decode``.
Readers: ``decode`` / ``decode_checked`` (bytes, memoryview or mmap), ``decode_verified`` (buffers
verified before), ``decode_file`` (an open descriptor) and ``EntryReader`` (layer streaming). The
format itself is described in ``entry``.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Iterable, Mapping

import numpy as np
import torch
import xxhash

from . import buffers
from .entry_format import (
    Buffer,
    CorruptEntry,
    Entry,
    EntryMeta,
    EntryReadFailed,
    Header,
    TensorSpec,
    copy_hash,
    layer_of,
)
from .entry_header import header_nbytes, header_of, parse_header
from .entry_stacks import contiguous_strides, stacks_of


def _wanted(names: Iterable[str], layers: int | Iterable[int] | None) -> list[str]:
    if layers is None:
        return list(_in_layer_order(tuple(names)))
    wanted = {layers} if isinstance(layers, int) else set(layers)
    return sorted((n for n in names if layer_of(n) in wanted), key=lambda n: (layer_of(n), n))


@functools.lru_cache(maxsize=64)
def _in_layer_order(names: tuple[str, ...]) -> tuple[str, ...]:
    """A whole entry's tensor names by layer: the same for every entry of a model, so sorted
    once (parsing 32 names cost about 30 us an entry read)."""
    return tuple(sorted(names, key=lambda n: (layer_of(n), n)))


# Failures of this process, not of the entry's bytes: the same read may succeed later.
_TRANSIENT = (MemoryError, OSError, torch.OutOfMemoryError)


def _wrap_errors(fn):
    """Any parse failure of untrusted bytes is corruption (CorruptEntry), never a crash; running
    out of memory or an I/O error while reading is ``EntryReadFailed``, never corruption."""

    def wrapped(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (CorruptEntry, EntryReadFailed):
            raise
        except _TRANSIENT as exc:
            raise EntryReadFailed(f"reading the entry failed: {type(exc).__name__}: {exc}") from None
        except Exception as exc:
            raise CorruptEntry(f"malformed entry: {type(exc).__name__}: {exc}") from None

    return wrapped


@_wrap_errors
def read_header(buf: Buffer) -> Header:
    """The verified header (checksum, lengths) of an entry; tensor digests are not checked."""
    with memoryview(buf) as raw, raw.cast("B") as view:
        return header_of(view)



def _allocate(specs: list[TensorSpec]) -> tuple[torch.Tensor, dict[str, int]]:
    """One uint8 storage for these tensors (data order, each aligned to its element size)."""
    offsets: dict[str, int] = {}
    total = 0
    for spec in specs:
        align = spec.dtype.itemsize
        total = -(-total // align) * align
        offsets[spec.name] = total
        total += spec.stop - spec.begin
    # A recycled buffer (``buffers``): a fresh multi-MiB one faults in every page on first touch.
    return torch.from_numpy(buffers.take(total)), offsets


def _as_tensors(
    storage: torch.Tensor, offsets: Mapping[str, int], specs: list[TensorSpec]
) -> dict[str, torch.Tensor]:
    """The tensors laid out in ``storage``, as views of a per-dtype view of it. A run of tensors
    of one shape and dtype at a constant step (an entry's K of every layer, then its V) is one
    ``as_strided`` view unbound into its tensors: one torch call for the run, where one call a
    tensor cost about 90 us for the 32 of a bench-model entry (about 20 us this way), on the
    first load of every new entry."""
    typed: dict[torch.dtype, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    placed = []
    for spec in specs:
        if spec.stop == spec.begin:
            out[spec.name] = torch.empty(spec.shape, dtype=spec.dtype)
        else:
            placed.append((offsets[spec.name], spec))
    placed.sort(key=lambda item: item[0])
    i = 0
    while i < len(placed):
        offset, spec = placed[i]
        size = spec.dtype.itemsize
        base = typed.get(spec.dtype)
        if base is None:
            base = typed[spec.dtype] = storage[: storage.numel() // size * size].view(spec.dtype)
        step = placed[i + 1][0] - offset if i + 1 < len(placed) else 0
        j = i + 1
        if step > 0 and step % size == 0:
            while (j < len(placed) and placed[j][0] - placed[j - 1][0] == step
                   and placed[j][1].shape == spec.shape and placed[j][1].dtype == spec.dtype):
                j += 1
        strides = contiguous_strides(spec.shape)
        if j - i == 1:
            out[spec.name] = base.as_strided(spec.shape, strides, offset // size)
        else:
            run = base.as_strided((j - i, *spec.shape), (step // size, *strides), offset // size)
            out.update(zip([s.name for _, s in placed[i:j]], run.unbind(0), strict=True))
        i = j
    return out


def _build(
    view: memoryview, header: Header, layers: int | Iterable[int] | None, *, is_verify: bool
) -> dict[str, torch.Tensor]:
    """Private copies of the wanted tensors (one allocation), each verified while copied."""
    names = _wanted(header.tensors, layers)
    specs = sorted((header.tensors[n] for n in names), key=lambda t: t.begin)
    storage, offsets = _allocate(specs)
    dst = storage.numpy()
    bad = _copy_into(dst, view, specs, offsets, header.digests if is_verify else None)
    if bad is not None:
        raise CorruptEntry(f"payload checksum mismatch in {bad}")
    by_name = _as_tensors(storage, offsets, specs)
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
            self.header = header_of(self._view)
            self.meta = self.header.meta
            check_fingerprint(self.meta, expect_fingerprint)
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


def check_fingerprint(meta: EntryMeta, expect_fingerprint: str | None) -> None:
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
        header = header_of(view)
        check_fingerprint(header.meta, expect_fingerprint)
        tensors = _build(view, header, layers, is_verify=True)
        if is_verify_all and layers is not None:
            verify_payload(view, header, skip=tensors)
        return _entry(header, tensors, layers), header


def decode(
    buf: Buffer,
    *,
    expect_fingerprint: str | None = None,
    layers: int | Iterable[int] | None = None,
) -> Entry:
    """Parse and verify an entry; ``layers`` reads only those layers (an int, a range, a list).

    Accepts bytes, bytearray, memoryview or an mmap (left open). Raises ``CorruptEntry`` (bad
    bytes) or ``EntryReadFailed`` (memory or I/O failed) and nothing else.
    """
    return decode_checked(buf, expect_fingerprint=expect_fingerprint, layers=layers)[0]


@_wrap_errors
def decode_verified(
    buf: Buffer,
    header: Header,
    *,
    expect_fingerprint: str | None = None,
    layers: int | Iterable[int] | None = None,
    is_zero_copy: bool = False,
) -> Entry:
    """Tensors of an entry already verified as ``header``, without parsing or hashing again.

    Only for bytes that cannot have changed since they were verified: the memory tier's private,
    immutable buffers. A size mismatch (not the bytes verified) is still ``CorruptEntry``.
    ``is_zero_copy``: the tensors are views of ``buf`` itself (they keep it alive), for a caller
    that only reads them; writing to one would change the stored entry.
    """
    if is_zero_copy:
        check_fingerprint(header.meta, expect_fingerprint)
        tensors = _views(buf, header, layers)
        if tensors is not None:
            return _entry(header, tensors, layers)
    with memoryview(buf) as raw, raw.cast("B") as view:
        if view.nbytes != header.nbytes:
            raise CorruptEntry("buffer is not the one verified")
        check_fingerprint(header.meta, expect_fingerprint)
        return _entry(header, _build(view, header, layers, is_verify=False), layers)


def zero_copy_views(buf: Buffer, header: Header) -> dict[str, torch.Tensor] | None:
    """Every tensor of an entry already verified as ``header`` as a read-only view of ``buf``
    (None when one is not aligned to its element size). The fingerprint is not checked here
    (``check_fingerprint``)."""
    return _views(buf, header, None)


def _views(buf: Buffer, header: Header, layers: int | Iterable[int] | None) -> dict[str, torch.Tensor] | None:
    """The wanted tensors as views of ``buf`` (None when one is not aligned to its element size:
    the caller copies instead). numpy's array keeps ``buf`` referenced, and so every tensor does."""
    src = np.frombuffer(buf, dtype=np.uint8)
    if src.nbytes != header.nbytes:
        raise CorruptEntry("buffer is not the one verified")
    names = _wanted(header.tensors, layers)
    specs = [header.tensors[n] for n in names]
    if any(spec.begin % spec.dtype.itemsize for spec in specs):
        return None
    with warnings.catch_warnings():
        # The buffer is read-only (immutable bytes): torch warns that its tensors are not writable.
        warnings.simplefilter("ignore", UserWarning)
        storage = torch.from_numpy(src)
    by_name = _as_tensors(storage, {s.name: s.begin for s in specs}, specs)
    return {n: by_name[n] for n in names}


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
    num_header_bytes = header_nbytes(prefix, nbytes)
    header = parse_header(_pread_exact(fd, num_header_bytes, 8), nbytes)
    check_fingerprint(header.meta, expect_fingerprint)
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
    for spec in specs:
        at = offsets[spec.name]
        if copy_hash(dst[at : at + spec.stop - spec.begin], None) != header.digests[spec.name]:
            raise CorruptEntry(f"payload checksum mismatch in {spec.name}")
    tensors = _as_tensors(storage, offsets, specs)
    return _entry(header, {n: tensors[n] for n in names}, layers)


def _entry(
    header: Header, tensors: dict[str, torch.Tensor], layers: int | Iterable[int] | None
) -> Entry:
    """The decoded entry, with its layers' stacks where it was read whole (``entry_stacks``)."""
    stacks = stacks_of(tensors, header.meta.num_layers) if layers is None else {}
    return Entry(header.meta, tensors, stacks)


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
