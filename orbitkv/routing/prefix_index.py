"""Prefix routing on vLLM's own KV events: what llm-d's precise prefix-cache scorer and Dynamo's KV
router do today, as the baseline for chunk-set routing (``scorer.py``).

Only vLLM's own blocks count: ``BlockStored`` without OrbitKV's ``extra_keys`` tag, in GPU memory
(``medium`` ``GPU`` or unset). A request scores, per replica, the tokens of the longest run of its
leading blocks that replica holds. Blocks are matched by content as Dynamo's indexer does: each
block is keyed by a chained hash of its tokens and its parent's key (the parent named by vLLM's
block hash), so the router needs neither vLLM's hash seed nor its hash function. A stored block
whose parent is unknown is skipped (Dynamo drops it too). What a block's vLLM hash also covers and
its tokens do not (a ``cache_salt``, multimodal hashes, a LoRA) is not seen here: a router that
must tell those apart needs vLLM's hashes of the request (``ChunkSetScorer.score_tokens``'s
``block_hashes``).

Same interface as ``ChunkSetScorer`` (``apply_batch``, ``forget``, ``score_tokens``), so the
ranking service (``service.py``) runs either.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import xxhash
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

from .score import Score
from .tier_events import EXTRA_KEY_TAG

ROOT = 0


def chain_key(parent: int, tokens: Sequence[int]) -> int:
    """A block's content key: its tokens and its parent's key."""
    h = xxhash.xxh3_64()
    h.update(parent.to_bytes(8, "little"))
    h.update(b"".join(int(t).to_bytes(4, "little", signed=True) for t in tokens))
    return h.intdigest()


def request_keys(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The content keys of a request's whole blocks, in order."""
    keys, parent = [], ROOT
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = chain_key(parent, token_ids[start : start + block_size])
        keys.append(parent)
    return keys


@dataclass
class _Replica:
    by_hash: dict[Any, int] = field(default_factory=dict)  # vLLM block hash -> content key
    keys: dict[int, int] = field(default_factory=lambda: defaultdict(int))  # content key -> count


def _is_vllm_gpu_block(ev: Any) -> bool:
    if (ev.medium or "GPU") != "GPU":
        return False
    tag = ev.extra_keys[0] if getattr(ev, "extra_keys", None) else None
    return not (isinstance(tag, (tuple, list)) and tag and tag[0] == EXTRA_KEY_TAG)


class PrefixIndex:
    def __init__(self, block_size: int) -> None:
        self.block_size = int(block_size)
        self._lock = threading.Lock()
        self._replicas: dict[str, _Replica] = defaultdict(_Replica)
        self.num_skipped_orphans = 0

    def apply_batch(self, replica: str, batch: Any) -> None:
        for event in batch.events:
            self.apply(replica, event)

    def apply(self, replica: str, event: Any) -> None:
        with self._lock:
            rep = self._replicas[replica]
            if isinstance(event, AllBlocksCleared):
                self._replicas[replica] = _Replica()
            elif isinstance(event, BlockStored) and _is_vllm_gpu_block(event):
                self._stored(rep, event)
            elif isinstance(event, BlockRemoved) and (event.medium or "GPU") == "GPU":
                for h in event.block_hashes:
                    key = rep.by_hash.pop(h, None)
                    if key is not None:
                        rep.keys[key] -= 1
                        if rep.keys[key] <= 0:
                            del rep.keys[key]

    def _stored(self, rep: _Replica, ev: Any) -> None:
        if ev.parent_block_hash is None:
            parent = ROOT
        elif ev.parent_block_hash in rep.by_hash:
            parent = rep.by_hash[ev.parent_block_hash]
        else:
            self.num_skipped_orphans += 1
            return
        bs = int(ev.block_size or self.block_size)
        tokens = list(ev.token_ids)
        for i, h in enumerate(ev.block_hashes):
            block = tokens[i * bs : (i + 1) * bs]
            if len(block) < bs:
                break
            parent = chain_key(parent, block)
            if h not in rep.by_hash:
                rep.by_hash[h] = parent
                rep.keys[parent] += 1

    def forget(self, replica: str) -> None:
        with self._lock:
            self._replicas.pop(replica, None)

    def score_tokens(self, replicas: Iterable[str], token_ids: Sequence[int],
                     block_hashes: Sequence[Any] = ()) -> list[Score]:
        """Rank by the longest held prefix of whole blocks (``block_hashes`` is ignored: the
        blocks are matched by content)."""
        keys = request_keys(token_ids, self.block_size)
        out = []
        with self._lock:
            for name in replicas:
                rep = self._replicas.get(name)
                n = 0
                while rep is not None and n < len(keys) and keys[n] in rep.keys:
                    n += 1
                num_tokens = n * self.block_size
                out.append(Score(name, float(num_tokens), {"GPU": num_tokens} if num_tokens else {}))
        out.sort(key=lambda s: (-s.score, s.replica))
        return out
