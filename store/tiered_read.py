"""Verified reads for ``TieredStore.get``: decode and check what one tier returned, key by key.

Each function returns, per name, ``(value, promote)``. ``value`` is an ``Entry``, a ``CorruptEntry``
(the copy is bad: the caller deletes and counts it), an ``EntryReadFailed`` (memory or I/O failed
while reading: a miss that keeps the copy) or None (a miss). ``promote`` is None or
``(buffer, header)`` for a copy into the tiers above, ``header`` being the verified ``Header`` when
the whole buffer was verified (memory can then trust it) and None otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .base import Backend
from .disk import DiskBackend
from .entry_decode import (
    check_fingerprint,
    decode_checked,
    decode_file,
    decode_verified,
    zero_copy_views,
)
from .entry_format import CorruptEntry, Entry, EntryReadFailed, Header
from .entry_stacks import stacks_of
from .memory import MemoryBackend

Read = tuple[Entry | CorruptEntry | EntryReadFailed | None, tuple[Any, Header | None] | None]


@dataclass(slots=True)
class _Viewed:
    """A memory tier tag: the buffer's verified header and its tensors as views of it, built when
    the entry is put (``viewed_tag``) or at its first zero-copy read. A load reads the same entry
    again and again (a recurring chunk); building 2 x layers views each time cost about 90 us an
    entry (bench model, 16 layers) on every step that loaded it, and about 250 us at the first
    load of a chunk saved the step before (the demo's window: views made after the engine sat
    idle). The buffer is immutable, so the views stay valid."""

    header: Header
    views: dict[str, Any]
    # Its layers as one view a side (``entry_stacks``), found with the views.
    stacks: dict[str, Any]
    # ``Entry.memo`` of every zero-copy read of this buffer.
    memo: dict[Any, Any] = field(default_factory=dict)


def viewed_tag(value: Any, header: Header) -> _Viewed | None:
    """The memory tier's tag for a buffer verified as ``header``: its views (None when a tensor
    is not aligned to its element size: reads then copy)."""
    views = zero_copy_views(value, header)
    if views is None:
        return None
    return _Viewed(header, views, stacks_of(views, header.meta.num_layers))


def read_memory(
    memory: MemoryBackend, names: list[str], expect_fingerprint: str | None, layers: int | list[int] | None,
    is_zero_copy: bool = False,
) -> list[Read]:
    """The memory tier's private, immutable buffers: a hit verified before is a plain copy (with
    ``is_zero_copy``, views of the buffer itself). A hit carries its buffer and header along (for
    the lower tiers' refresh, not for a promotion)."""
    out: list[Read] = []
    for name, item in zip(names, memory.batch_get_tagged(names), strict=True):
        if item is None:
            out.append((None, None))
            continue
        value, tag = item
        header = tag.header if isinstance(tag, _Viewed) else tag
        try:
            viewed = tag if isinstance(tag, _Viewed) else None
            if viewed is None and is_zero_copy and layers is None and isinstance(header, Header):
                viewed = viewed_tag(value, header)
            if is_zero_copy and layers is None and viewed is not None:
                check_fingerprint(header.meta, expect_fingerprint)
                if tag is not viewed:
                    memory.set_tag(name, value, viewed)
                # Dicts of its own: the caller may rearrange them, never the shared views.
                entry = Entry(header.meta, dict(viewed.views), dict(viewed.stacks), viewed.memo)
            elif isinstance(header, Header):
                entry = decode_verified(value, header, expect_fingerprint=expect_fingerprint, layers=layers,
                                        is_zero_copy=is_zero_copy)
            else:  # put_bytes: verify the whole buffer once, then trust it
                entry, header = decode_checked(
                    value, expect_fingerprint=expect_fingerprint, layers=layers, is_verify_all=True
                )
                memory.set_tag(name, value, header)
        except (CorruptEntry, EntryReadFailed) as exc:
            out.append((exc, None))
            continue
        out.append((entry, (value, header)))
    return out


def read_files(
    disk: DiskBackend, names: list[str], expect_fingerprint: str | None, layers: int | list[int] | None
) -> list[Read]:
    """A disk tier with nothing above to promote into: each file is read straight into its tensors."""

    def decoder(fd: int, size: int) -> Entry | CorruptEntry | EntryReadFailed:
        try:
            return decode_file(fd, size, expect_fingerprint=expect_fingerprint, layers=layers)
        except (CorruptEntry, EntryReadFailed) as exc:
            return exc

    return [(v, None) for v in disk.read_entries(names, decoder)]


def read_buffers(
    tier: Backend,
    names: list[str],
    expect_fingerprint: str | None,
    layers: int | list[int] | None,
    *,
    is_verify_all: bool,
) -> list[Read]:
    """Any other tier: decode its buffers. ``is_verify_all`` (a buffer bound for the memory tier)
    verifies every layer, not only those read, so memory can trust the buffer afterwards."""
    out: list[Read] = []
    read = getattr(tier, "batch_get_buffers", tier.batch_get)  # disk: buffers memory can keep
    for value in read(names):
        if value is None:
            out.append((None, None))
            continue
        try:
            entry, header = decode_checked(
                value, expect_fingerprint=expect_fingerprint, layers=layers, is_verify_all=is_verify_all
            )
        except (CorruptEntry, EntryReadFailed) as exc:
            out.append((exc, None))
            continue
        out.append((entry, (value, header if is_verify_all or layers is None else None)))
    return out
