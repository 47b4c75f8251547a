"""What the scheduler half ships to the worker half each step. Plain data, no behaviour."""

from __future__ import annotations

import operator
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

T = TypeVar("T")


def pickled_by_fields(cls: type[T]) -> type[T]:
    """Pickle ``cls`` (a slots dataclass) as a call of its constructor on its fields.

    The metadata crosses to the worker process every step, pickled with the scheduler's output
    (vLLM's multiprocess executor). A slots dataclass otherwise pickles through ``dataclasses``'
    ``__getstate__`` / ``__setstate__``, Python functions that walk ``fields()`` for every object.
    """
    names = cls.__match_args__
    getter: Callable[[Any], Any] = operator.attrgetter(*names)
    if len(names) == 1:
        cls.__reduce__ = lambda self: (cls, (getter(self),))  # type: ignore[method-assign]
    else:
        cls.__reduce__ = lambda self: (cls, getter(self))  # type: ignore[method-assign]
    return cls


@pickled_by_fields
@dataclass(slots=True)
class LoadSpec:
    """Load tokens ``[offset, offset + len(slots))`` of a stored chunk into ``slots``.

    ``chunk_start`` is where the chunk starts in this prompt (token index), ``position`` its first
    token's position in the model's units (``positions.py``); the worker relocates by
    ``position - entry.start_pos``. ``patch_key`` is set for the patched mode. ``slots``: an
    ``array('q')`` (``slots_for``; any sequence of ints is taken).
    """

    req_id: str
    key: str
    mode: str
    chunk_start: int
    offset: int
    slots: array | list[int]
    block_ids: list[int]
    patch_key: str | None = None
    position: int = 0
    # The first token of the block the load starts in: vLLM recomputes the request from there if
    # the load fails, so nothing the request computes from there on this step may be saved.
    first_block_token: int = 0


@pickled_by_fields
@dataclass(slots=True)
class SaveSpec:
    """Gather a chunk this step completed and store it under ``keys`` (kind -> key)."""

    req_id: str
    cid: str
    start: int  # token index; ``start_pos``: its position in the model's units
    slots: array | list[int]
    antecedent: tuple[str, ...]
    antecedent_hash: str
    keys: dict[str, str]
    # Form this ordering's patch (and update the orbit patch) if B's canonical is stored by then.
    is_patch_wanted: bool = False
    start_pos: int = 0
    # "" for exact KV, else the policy tag of the approximate KV it was computed over.
    lineage: str = ""
    # The canonical key patches are formed against (the anchor's context).
    canonical_key: str = ""

    @property
    def end(self) -> int:
        return self.start + len(self.slots)


@pickled_by_fields
@dataclass(slots=True)
class OrbitKVMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    # Requests vLLM recomputed after a failed load, re-admitted or finished: the worker stops
    # holding back their saves.
    recovered: list[str] = field(default_factory=list)


def slots_for(block_ids: list[int], block_size: int, begin: int, end: int) -> array:
    """Slot ids of token positions ``[begin, end)`` of a request with these blocks, as an
    ``array('q')``: it crosses to the worker as one run of bytes (a list pickles and unpickles
    int by int) and becomes the worker's slot tensor without a copy (``loading.slot_tensor``)."""
    # A block's slots are consecutive: one range per block, not one Python step per token.
    out = array("q")
    pos = begin
    while pos < end:
        block, offset = divmod(pos, block_size)
        num = min(block_size - offset, end - pos)
        first = block_ids[block] * block_size + offset
        out.extend(range(first, first + num))
        pos += num
    return out


def blocks_for(block_ids: list[int], block_size: int, begin: int, end: int) -> list[int]:
    """Block ids holding token positions ``[begin, end)``."""
    if end <= begin:
        return []
    return block_ids[begin // block_size : (end - 1) // block_size + 1]


@pickled_by_fields
@dataclass(slots=True)
class StoredKey:
    """An entry the worker has put in its store; ``antecedent`` is set for conditioned entries."""

    key: str
    cid: str
    nbytes: int
    antecedent: tuple[str, ...] | None = None


@pickled_by_fields
@dataclass(slots=True)
class OrbitKVWorkerMeta(KVConnectorWorkerMetadata):
    """What the worker half reports back each step, for a scheduler half in another process.

    ``submitted``/``finished``: saves queued / that reached the store (or were dropped), each under
    its cid and the keys it writes.
    """

    stored: list[StoredKey] = field(default_factory=list)
    submitted: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> OrbitKVWorkerMeta:
        assert isinstance(other, OrbitKVWorkerMeta)
        return OrbitKVWorkerMeta(
            self.stored + other.stored,
            self.submitted + other.submitted,
            self.finished + other.finished,
        )

    def is_empty(self) -> bool:
        return not (self.stored or self.submitted or self.finished)
