"""Chunk-set routing: rank replicas by the tokens of a request's chunks each one holds.

Fed by vLLM KV events (``apply(replica, event)``, or ``apply_batch`` with a decoded
``KVEventBatch``): OrbitKV's tier events (``tier_events.py``: ``extra_keys`` name the chunk) and
vLLM's own GPU events (a prefix of blocks). A request is scored per replica as the sum, over its
chunks, of the chunk's tokens times the weight of the cheapest tier that replica can serve it from
(``TIER_WEIGHTS``: the share of a prefill it saves; memory > disk > Redis > compute, 0). Chunks
count wherever they sit in the request and in any order: OrbitKV re-places them.

A request is given either by its chunks (``score_chunks``: cids and lengths, for a caller that runs
OrbitKV's chunker) or by its tokens (``score_tokens``: the chunks are found by their tokens, block by
block, at any offset; vLLM's prefix blocks by the request's block hashes, when given).

The shared tier (events with ``locality == "REMOTE"``: Redis) is announced by one replica only and
served to every replica, so it is kept once and counts for all. ``AllBlocksCleared`` (vLLM's
``reset_prefix_cache``) drops a replica's vLLM blocks only.

vLLM's own blocks (untagged ``BlockStored`` in GPU memory) are kept twice: by vLLM's block hash,
for a caller that passes the request's hashes (``/rank``), and by content (``PrefixIndex``: the
routing front has the prompt's tokens, not vLLM's hashes, which depend on its hash seed). So a
replica's longest held prefix counts, as GPU, wherever the request's chunks come after it: chunk-set
routing knows everything prefix routing knows. ``forget(replica)`` drops all that is
known of a replica whose events were lost or that restarted (``service.EventFeed`` calls it on a
sequence gap); with nothing known anywhere, ``rank`` returns all zeros and the caller's default
policy (affinity, consistent hash) decides.
"""

from __future__ import annotations

import threading
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

from .prefix_index import PrefixIndex
from .score import Score
from .tier_events import EXTRA_KEY_TAG

__all__ = ["SHARED", "TIER_WEIGHTS", "ChunkSetScorer", "Score"]

TIER_WEIGHTS = {"GPU": 1.0, "CPU": 0.9, "DISK": 0.6, "REDIS": 0.4}
# Tokens of a chunk's start the content index is keyed by; a match is then checked in full.
HEAD_TOKENS = 8
SHARED = "<shared>"


@dataclass
class _Entry:
    cid: str
    medium: str
    block_hashes: tuple[Any, ...]


@dataclass
class _Replica:
    # cid -> how many entries of it each medium holds (a canonical and a conditioned: two).
    chunks: dict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    # first block hash of an entry -> the entry (a BlockRemoved names the entry's blocks).
    entries: dict[Any, _Entry] = field(default_factory=dict)
    # vLLM's own blocks, untagged: block hash -> media holding it.
    prefix: dict[Any, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))


class ChunkSetScorer:
    def __init__(self, block_size: int, weights: dict[str, float] | None = None) -> None:
        self.block_size = int(block_size)
        self.weights = dict(TIER_WEIGHTS if weights is None else weights)
        self._lock = threading.Lock()
        self._replicas: dict[str, _Replica] = defaultdict(_Replica)
        # Content index: a chunk's first ``_head`` tokens -> cids (a short key: a prompt is scanned
        # at every offset); cid -> its whole blocks' tokens.
        self._head = min(HEAD_TOKENS, self.block_size)
        self._by_head: dict[tuple[int, ...], set[str]] = defaultdict(set)
        self._chunk_tokens: dict[str, tuple[int, ...]] = {}
        self._prefix = PrefixIndex(block_size)

    # -- events -----------------------------------------------------------------------------------

    def apply_batch(self, replica: str, batch: Any) -> None:
        for event in batch.events:
            self.apply(replica, event)

    def apply(self, replica: str, event: Any) -> None:
        self._prefix.apply(replica, event)
        with self._lock:
            if isinstance(event, AllBlocksCleared):
                # vLLM's reset_prefix_cache: its own blocks go, OrbitKV's tiers stay.
                rep = self._replicas.get(replica)
                if rep is not None:
                    rep.prefix.clear()
            elif isinstance(event, BlockStored):
                self._stored(self._owner(replica, event), event)
            elif isinstance(event, BlockRemoved):
                self._removed(self._owner(replica, event), event)

    @staticmethod
    def _owner(replica: str, event: Any) -> str:
        return SHARED if getattr(event, "locality", None) == "REMOTE" else replica

    def _stored(self, owner: str, ev: Any) -> None:
        rep = self._replicas[owner]
        medium = ev.medium or "GPU"
        tag = ev.extra_keys[0] if ev.extra_keys else None
        if not (isinstance(tag, (tuple, list)) and len(tag) == 4 and tag[0] == EXTRA_KEY_TAG):
            for h in ev.block_hashes:
                rep.prefix[h][medium] += 1
            return
        cid = str(tag[1])
        first = ev.block_hashes[0]
        if first in rep.entries:
            return  # the same entry announced again (a re-put): already counted
        rep.entries[first] = _Entry(cid, medium, tuple(ev.block_hashes))
        rep.chunks[cid][medium] += 1
        tokens = tuple(ev.token_ids)
        if cid not in self._chunk_tokens and len(tokens) >= self.block_size:
            self._chunk_tokens[cid] = tokens
            self._by_head[tokens[: self._head]].add(cid)

    def _removed(self, owner: str, ev: Any) -> None:
        rep = self._replicas.get(owner)
        if rep is None or not ev.block_hashes:
            return
        entry = rep.entries.get(ev.block_hashes[0])
        if entry is not None and entry.medium == (ev.medium or "GPU"):
            del rep.entries[ev.block_hashes[0]]
            held = rep.chunks[entry.cid]
            held[entry.medium] -= 1
            if held[entry.medium] <= 0:
                del held[entry.medium]
            if not held:
                del rep.chunks[entry.cid]
                self._drop_content_if_unheld(entry.cid)
            return
        for h in ev.block_hashes:
            media = rep.prefix.get(h)
            if media is not None:
                media[ev.medium or "GPU"] -= 1
                if media[ev.medium or "GPU"] <= 0:
                    del media[ev.medium or "GPU"]
                if not media:
                    del rep.prefix[h]

    def _drop_content_if_unheld(self, cid: str) -> None:
        if any(cid in rep.chunks for rep in self._replicas.values()):
            return
        tokens = self._chunk_tokens.pop(cid, None)
        if tokens is not None:
            head = self._by_head.get(tokens[: self._head])
            if head is not None:
                head.discard(cid)
                if not head:
                    del self._by_head[tokens[: self._head]]

    def forget(self, replica: str) -> None:
        """Lost events from ``replica``: know nothing of it until it announces again."""
        self._prefix.forget(replica)
        with self._lock:
            self._drop_replica(replica)

    def _drop_replica(self, replica: str) -> None:
        rep = self._replicas.pop(replica, None)
        for cid in rep.chunks if rep is not None else ():
            self._drop_content_if_unheld(cid)

    # -- scoring ----------------------------------------------------------------------------------

    def find_chunks(self, token_ids: Sequence[int]) -> list[tuple[int, str]]:
        """``(offset, cid)`` of every announced chunk whose whole blocks appear in ``token_ids``,
        at any offset, left to right, not overlapping."""
        bs, tokens, found, i = self.block_size, tuple(token_ids), [], 0
        with self._lock:
            while i + bs <= len(tokens):
                best = None
                for cid in self._by_head.get(tokens[i : i + self._head], ()):
                    blocks = self._chunk_tokens[cid]
                    if tokens[i : i + len(blocks)] == blocks and (
                        best is None or len(blocks) > len(self._chunk_tokens[best])
                    ):
                        best = cid
                if best is None:
                    i += 1
                    continue
                found.append((i, best))
                i += len(self._chunk_tokens[best])
        return found

    def score_tokens(
        self, replicas: Iterable[str], token_ids: Sequence[int],
        block_hashes: Sequence[Any] = (),
    ) -> list[Score]:
        """Rank by the chunks found in ``token_ids`` (their whole blocks' tokens; a chunk's tail
        shorter than a block is not seen in the tokens and is not counted), and by vLLM's prefix
        blocks: by ``block_hashes`` (the request's, as vLLM hashes them) when given, else by the
        tokens' content."""
        replicas = list(replicas)
        found = self.find_chunks(token_ids)
        with self._lock:
            chunks = [(i, cid, len(self._chunk_tokens[cid])) for i, cid in found
                      if cid in self._chunk_tokens]
        held = None
        if not block_hashes:
            held = {s.replica: int(s.score) for s in self._prefix.score_tokens(replicas, token_ids)}
        return self._rank(replicas, chunks, block_hashes, held)

    def score_chunks(self, replicas: Iterable[str], chunks: Sequence[tuple[str, int]]) -> list[Score]:
        """Rank by ``(cid, num_tokens)`` chunks."""
        return self._rank(replicas, [(0, cid, n) for cid, n in chunks], ())

    def _rank(self, replicas: Iterable[str], chunks: Sequence[tuple[int, str, int]],
              block_hashes: Sequence[Any], held_prefix: dict[str, int] | None = None) -> list[Score]:
        """``chunks``: ``(offset, cid, num_tokens)``; tokens a replica's vLLM prefix blocks cover
        (by ``block_hashes``, or ``held_prefix``: tokens per replica) count once, as GPU."""
        out = []
        with self._lock:
            shared = self._replicas.get(SHARED)
            for name in replicas:
                rep = self._replicas.get(name)
                by_medium: Counter[str] = Counter()
                num_prefix = 0
                for h in block_hashes:
                    if rep is None or h not in rep.prefix:
                        break
                    num_prefix += 1
                prefix_end = num_prefix * self.block_size
                if held_prefix is not None:
                    prefix_end = max(prefix_end, held_prefix.get(name, 0))
                if prefix_end:
                    by_medium["GPU"] += prefix_end
                for offset, cid, num_tokens in chunks:
                    num_beyond = min(num_tokens, offset + num_tokens - prefix_end)
                    media = set(rep.chunks.get(cid, ())) if rep is not None else set()
                    if shared is not None:
                        media |= set(shared.chunks.get(cid, ()))
                    if media and num_beyond > 0:
                        best = max(media, key=lambda m: self.weights.get(m, 0.0))
                        by_medium[best] += num_beyond
                score = sum(n * self.weights.get(m, 0.0) for m, n in by_medium.items())
                out.append(Score(name, score, dict(by_medium)))
        out.sort(key=lambda s: (-s.score, s.replica))
        return out
