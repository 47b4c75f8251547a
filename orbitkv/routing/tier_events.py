"""KV events for every OrbitKV tier, in vLLM's own classes (``vllm.distributed.kv_events``).

When a tier of the store takes or drops an entry (a put, a promotion, an LRU eviction, a delete),
this turns it into ``BlockStored`` / ``BlockRemoved`` with ``medium`` naming the tier (``MEDIUMS``).
The connector's scheduler half hands them to vLLM (``take_events``), whose publisher sends them with
its own GPU events (``--kv-events-config``: ZMQ, msgspec ``KVEventBatch``), so llm-d's and Dynamo's
indexers and ``routing.scorer`` read them unchanged.

What an entry is announced as:

- an exact ``conditioned`` entry (the chunk's KV in this very prompt's context) as the blocks vLLM
  hashed for the same tokens: the request's own block hashes of the blocks lying wholly inside the
  chunk, their tokens, and the hash of the block before as the parent. A router that matches
  prefixes finds them exactly as it finds vLLM's own blocks;
- any other entry (a position-free canonical, a patch, approximate KV, or an exact chunk without a
  whole block) as blocks of its own tokens (``block_size`` each, the tail shorter than a block
  left out) under hashes of its store key: no prefix router will ever compute those, so they never
  pose as a prefix; a chunk-set router reads them by ``extra_keys``.

Every block's ``extra_keys`` entry is ``("orbitkv", cid, kind, num_chunk_tokens)``: which chunk it
belongs to, the entry kind and the chunk's length in tokens (its tail included).

The shared Redis tier is announced once: only the replica whose write landed announces it
(``locality="REMOTE"``), and a delete by the replica that deleted (the blocks of a key are the same
on every replica). Redis's own evictions and expiries (``maxmemory``, TTL) reach every replica
through keyspace notifications (``redis_watch.py``) and are announced by the one that announced the
entry stored. Keys the connector
never saw (written by another process) are counted and skipped: their tokens are unknown here.
The queue is bounded: when it is full the oldest event goes, and ``num_dropped`` counts it (a router
then routes on stale state, never to a wrong answer: a miss is recomputed).
"""

from __future__ import annotations

import hashlib
import threading
from collections import Counter, OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from orbitkv.store.base import REMOVED, STORED
from orbitkv.store.keys import EntryKey

# The medium each tier is announced under. vLLM names "GPU", "CPU" and "STORAGE"; llm-d and Dynamo
# document no values for a disk or a remote store, so those two are OrbitKV's own.
MEDIUMS = {"memory": "CPU", "disk": "DISK", "redis": "REDIS"}
SHARED_TIERS = frozenset({"redis"})
EXTRA_KEY_TAG = "orbitkv"


@dataclass(frozen=True, slots=True)
class ChunkBlocks:
    """What one store key is announced as: whole blocks, their tokens, the chunk they belong to."""

    cid: str
    block_hashes: tuple[Any, ...]
    parent_block_hash: Any
    token_ids: tuple[int, ...]
    num_chunk_tokens: int
    lora_name: str | None = None


def prefix_blocks(
    cid: str,
    prompt: Sequence[int],
    block_hashes: Sequence[bytes],
    start: int,
    end: int,
    block_size: int,
    lora_name: str | None = None,
) -> ChunkBlocks | None:
    """vLLM's blocks wholly inside tokens ``[start, end)`` of a prompt (None: not one)."""
    first = -(-start // block_size)
    last = min(end // block_size, len(block_hashes))
    if last <= first:
        return None
    return ChunkBlocks(
        cid=cid,
        block_hashes=tuple(maybe_convert_block_hash(h) for h in block_hashes[first:last]),
        parent_block_hash=maybe_convert_block_hash(block_hashes[first - 1]) if first else None,
        token_ids=tuple(prompt[first * block_size : last * block_size]),
        num_chunk_tokens=end - start,
        lora_name=lora_name,
    )


def own_blocks(key: str, cid: str, tokens: Sequence[int], block_size: int,
               lora_name: str | None = None) -> ChunkBlocks | None:
    """A position-free entry: blocks of its own tokens under hashes of its key."""
    num_blocks = len(tokens) // block_size
    if not num_blocks:
        return None
    hashes = [
        maybe_convert_block_hash(hashlib.sha256(f"{EXTRA_KEY_TAG}:{key}:{i}".encode()).digest())
        for i in range(num_blocks)
    ]
    return ChunkBlocks(cid, tuple(hashes), None, tuple(tokens[: num_blocks * block_size]),
                       len(tokens), lora_name)


class TierEvents:
    """Listens to the tiers of one store and queues vLLM events for ``take``. Thread-safe: tiers
    call ``on_tier_change`` from the writer threads."""

    def __init__(self, block_size: int, max_queue: int = 65536, max_known: int = 1 << 16) -> None:
        self.block_size = int(block_size)
        self._lock = threading.Lock()
        self._queue: deque[KVCacheEvent] = deque()
        self._max_queue = int(max_queue)
        self._max_known = int(max_known)
        # key -> the blocks an exact conditioned entry stands for; cid -> its tokens and LoRA.
        self._prefix: OrderedDict[str, ChunkBlocks] = OrderedDict()
        self._tokens: OrderedDict[str, tuple[tuple[int, ...], str | None]] = OrderedDict()
        # (key, tier) -> the block hashes announced, so a removal names what was stored (one
        # small tuple per entry a tier holds: the tokens are not kept).
        self._announced: dict[tuple[str, str], tuple[Any, ...]] = {}
        self.counters: Counter[str] = Counter()

    # -- what keys stand for ----------------------------------------------------------------------

    def describe_chunk(self, cid: str, tokens: Sequence[int], lora_name: str | None = None) -> None:
        with self._lock:
            self._remember(self._tokens, cid, (tuple(tokens), lora_name))

    def describe_prefix(self, key: str, blocks: ChunkBlocks) -> None:
        with self._lock:
            self._remember(self._prefix, key, blocks)

    def _remember(self, table: OrderedDict, key: str, value: Any) -> None:
        table[key] = value
        table.move_to_end(key)
        while len(table) > self._max_known:
            table.popitem(last=False)

    def _blocks_of(self, key: str) -> tuple[ChunkBlocks | None, str]:
        try:
            parsed = EntryKey.parse(key)
        except ValueError:
            return None, ""  # a survivor-index line or a foreign key: no KV of its own
        if parsed.kind == "encoder":
            return None, parsed.kind
        blocks = self._prefix.get(key)
        if blocks is None and parsed.cid in self._tokens:
            tokens, lora_name = self._tokens[parsed.cid]
            blocks = own_blocks(key, parsed.cid, tokens, self.block_size, lora_name)
        return blocks, parsed.kind

    # -- tier changes -----------------------------------------------------------------------------

    def attach(self, store: Any) -> None:
        """Listen to every tier of ``store``. No ``AllBlocksCleared`` here: vLLM puts connector
        events after its own in a step's batch, so one would also clear the GPU blocks of the
        engine's first step. A router sees a restart as the publisher's sequence starting over
        (``service.EventFeed`` forgets the replica then)."""
        for tier in store.tiers:
            tier.listener = self.on_tier_change

    def detach(self, store: Any) -> None:
        for tier in store.tiers:
            if tier.listener == self.on_tier_change:
                tier.listener = None

    def on_tier_change(self, tier: str, change: str, keys: Sequence[str]) -> None:
        medium = MEDIUMS.get(tier, tier.upper())
        locality = "REMOTE" if tier in SHARED_TIERS else "LOCAL"
        with self._lock:
            for key in keys:
                if change == STORED:
                    self._stored(key, tier, medium, locality)
                elif change == REMOVED:
                    hashes = self._announced.pop((key, tier), None)
                    if hashes is None and tier in SHARED_TIERS:
                        # Another replica announced it; its blocks are the same here.
                        blocks = self._blocks_of(key)[0]
                        hashes = blocks.block_hashes if blocks is not None else None
                    if hashes is not None:
                        self._push_locked(BlockRemoved(block_hashes=list(hashes),
                                                       medium=medium, locality=locality))
                        self.counters[f"removed.{tier}"] += 1

    def on_shared_lost(self, tier: str, keys: Sequence[str]) -> None:
        """A shared tier dropped keys by itself (``redis_watch.py``): announced by the replica
        that announced them stored, and by no other."""
        medium = MEDIUMS.get(tier, tier.upper())
        with self._lock:
            for key in keys:
                hashes = self._announced.pop((key, tier), None)
                if hashes is not None:
                    self._push_locked(BlockRemoved(block_hashes=list(hashes),
                                                   medium=medium, locality="REMOTE"))
                    self.counters[f"lost.{tier}"] += 1

    def _stored(self, key: str, tier: str, medium: str, locality: str) -> None:
        blocks, kind = self._blocks_of(key)
        if blocks is None:
            if kind:
                self.counters[f"unknown.{tier}"] += 1
            return
        self._announced[(key, tier)] = blocks.block_hashes
        extra = (EXTRA_KEY_TAG, blocks.cid, kind, blocks.num_chunk_tokens)
        self._push_locked(BlockStored(
            block_hashes=list(blocks.block_hashes),
            parent_block_hash=blocks.parent_block_hash,
            token_ids=list(blocks.token_ids),
            block_size=self.block_size,
            lora_id=None,
            medium=medium,
            lora_name=blocks.lora_name,
            extra_keys=[extra] * len(blocks.block_hashes),
            locality=locality,
        ))
        self.counters[f"stored.{tier}"] += 1

    def _push_locked(self, event: KVCacheEvent) -> None:
        if len(self._queue) >= self._max_queue:
            self._queue.popleft()
            self.counters["dropped"] += 1
        self._queue.append(event)

    def take(self) -> list[KVCacheEvent]:
        """The events since the last call, oldest first."""
        with self._lock:
            out = list(self._queue)
            self._queue.clear()
        return out

    @property
    def num_dropped(self) -> int:
        return self.counters["dropped"]
