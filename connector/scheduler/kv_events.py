"""The connector's side of the tier events (``orbitkv.routing.tier_events``), on when ``kv_events``.

Before a request can save anything, the scheduler half tells the events what its chunks' keys
stand for: each chunk's tokens (for position-free entries) and, for its exact conditioned key, the
blocks vLLM hashed for the same tokens in this prompt (``request.block_hashes``, as vLLM shows them,
so a tenant's or a lineage's namespace is the one vLLM's own events carry). vLLM then takes the
queued events each step through ``take_events`` and publishes them with its own.

The store is the one the halves share in this process (``runtime.py``): with the worker in another
process, only what this process's tiers see is announced.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from orbitkv.routing import redis_watch
from orbitkv.routing.tier_events import TierEvents, prefix_blocks

if TYPE_CHECKING:
    from orbitkv.store.tiered import TieredStore
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)
MAX_DESCRIBED_REQUESTS = 4096


class ConnectorEvents:
    def __init__(self, store: TieredStore, block_size: int, max_queue: int) -> None:
        self.events = TierEvents(block_size, max_queue=max_queue)
        self._store = store
        self._described: OrderedDict[str, None] = OrderedDict()
        self.events.attach(store)
        self._watcher = redis_watch.start(store, self.events)

    def describe(self, request: Request, chunks: list[Any] | Callable[[], list[Any]]) -> None:
        """Once per request: what each chunk's keys stand for (``chunks``: or a function giving
        them, called only the first time). Never raises: events are best effort, the request is
        served whatever happens here."""
        req_id = request.request_id
        if req_id in self._described:
            return
        self._described[req_id] = None
        while len(self._described) > MAX_DESCRIBED_REQUESTS:
            self._described.popitem(last=False)
        try:
            self._describe(request, chunks() if callable(chunks) else chunks)
        except Exception:
            self.events.counters["describe_errors"] += 1
            logger.exception("OrbitKV: cannot describe request %s for KV events", req_id)

    def _describe(self, request: Request, chunks: list[Any]) -> None:
        prompt = list(request.prompt_token_ids or ())
        hashes = list(getattr(request, "block_hashes", None) or ())
        lora = getattr(request, "lora_request", None)
        lora_name = getattr(lora, "lora_name", None)
        bs = self.events.block_size
        for c in chunks:
            self.events.describe_chunk(c.cid, prompt[c.start : c.end], lora_name)
            blocks = prefix_blocks(c.cid, prompt, hashes, c.start, c.end, bs, lora_name)
            if blocks is not None:
                key = c.exact_key
                self.events.describe_prefix(key, blocks)

    def take(self) -> list[Any]:
        return self.events.take()

    def close(self) -> None:
        self.events.detach(self._store)
        if self._watcher is not None:
            self._watcher.close()
