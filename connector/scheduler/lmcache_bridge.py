"""Mixed fleets with LMCache: serve LMCache's prefix chunks as exact hits, write ours in its layout.

Switched on by ``lmcache_interop: true`` (``orbitkv:`` section); it reads and writes LMCache 0.5.6's
Redis layout on ``remote_url`` through ``store/lmcache.py`` (the ``CacheEngineKey`` strings, the
``...kv_bytes`` / ``...metadata`` pairs, ``KV_2LTD``; ``KV_MLA_FMT`` for MLA models). A fleet can then
move from LMCache to OrbitKV one node at a time: both kinds of node serve each other's prefixes.

An LMCache prefix chunk ``i`` holds the KV of tokens ``[i*chunk_size, (i+1)*chunk_size)`` computed
after everything before it: a stretch of OrbitKV conditioned entries at their stored positions. The
two chunkings need not line up (OrbitKV splits the anchor token off, and multimodal items), so the
bridge converts by token range, never chunk by chunk:

- **read** (scheduler half, once per request, before planning): the prompt's leading OrbitKV chunks
  that the store lacks are cut out of the leading LMCache chunks that exist, stored as conditioned
  entries (memory tier, and written through to Redis so a worker in another process finds them), and
  the planner then serves them as ``exact`` hits. The scheduler never waits for that write: until
  it has reached the lower tiers (``TieredStore.has_pending_writes``, a look at the write-behind
  queues) ``before_plan`` says so and the request is asked about again next step, as for a save
  in flight, for at most ``IMPORT_WAIT_S``; other requests are scheduled meanwhile.
- **write** (when a request finishes, on a background thread): each full LMCache chunk of the prompt
  that LMCache lacks is assembled from the OrbitKV conditioned entries covering it, once the worker's
  saves have reached the store.

Only requests without a tenant or ``cache_salt`` take part (LMCache keys have no tenant), and only
text prompts (LMCache hashes multimodal prompts differently). Keys must agree with the LMCache nodes:
the same ``chunk_size``, ``pre_caching_hash_algorithm`` and model name (``lmcache_model_name``,
default vLLM's ``model``, which LMCache's vLLM adapter uses), and with the ``builtin`` hash the same
``PYTHONHASHSEED`` in every process of every node (``sha256_cbor`` needs none).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from orbitkv.store import lmcache as lmc
from orbitkv.store.remote_check import check_interop_config

if TYPE_CHECKING:
    from orbitkv.store.tiered import TieredStore
    from vllm.config import VllmConfig
    from vllm.v1.request import Request

    from orbitkv.config import OrbitKVConfig

    from ..chunking import Chunk
    from ..identity import ModelIdentity
    from .options import RequestOptions

logger = logging.getLogger(__name__)

CONDITIONED = "conditioned"
EXPORT_WAIT_S = 10.0  # how long a finished request's saves may take to reach the store
# How long a request waits for the chunks imported for it to reach the lower tiers; past it, it is
# planned anyway (a worker that misses them then recomputes those tokens).
IMPORT_WAIT_S = 10.0
MAX_SEEN = 65536


def create(
    vllm_config: VllmConfig, config: OrbitKVConfig, identity: ModelIdentity, store: TieredStore
) -> LMCacheBridge | None:
    """The bridge when ``lmcache_interop`` is on, else None."""
    if not getattr(config, "lmcache_interop", False):
        return None
    if identity.positions.kind != "index":
        # LMCache's entries carry no position: OrbitKV stores a chunk's start in the model's
        # position units, which for M-RoPE is not the token index the bridge knows.
        logger.warning("OrbitKV: lmcache_interop is off for this model (M-RoPE positions)")
        return None
    return LMCacheBridge(vllm_config, config, identity, store)


class LMCacheBridge:
    def __init__(
        self, vllm_config: VllmConfig, config: OrbitKVConfig, identity: ModelIdentity,
        store: TieredStore,
    ) -> None:
        check_interop_config(config)
        self._store = store
        self._identity = identity
        self._chunk_size = int(config.chunk_size)
        self._hash = {"chunk_size": self._chunk_size,
                      "hash_algorithm": config.pre_caching_hash_algorithm,
                      "save_unfull_chunk": bool(config.save_unfull_chunk)}
        parallel = vllm_config.parallel_config
        self._key_fields = {
            "model_name": config.lmcache_model_name or str(vllm_config.model_config.model),
            "dtype": identity.cache_dtype,
            "world_size": int(parallel.tensor_parallel_size),
            "worker_id": 0,
        }
        self._fmt = lmc.FMT_KV_MLA if identity.is_mla else lmc.FMT_KV_2LTD
        self._lm = lmc.LMCacheRedis.from_config(config)
        self._seen: dict[str, None] = {}
        # Requests whose imported chunks are still being written: their keys and a deadline.
        self._waiting: dict[str, tuple[list[str], float]] = {}
        self.counters = {"imported_chunks": 0, "imported_tokens": 0, "exported_chunks": 0,
                         "export_timeouts": 0, "import_timeouts": 0, "bad_chunks": 0}
        self._jobs: queue.Queue[tuple[list[int], list[Any]] | None] = queue.Queue(1024)
        self._thread = threading.Thread(target=self._export_loop, name="orbitkv-lmcache", daemon=True)
        self._thread.start()

    # -- which requests take part -------------------------------------------------------------------

    def _is_eligible(self, request: Request, opts: RequestOptions, chunks: Sequence[Any]) -> bool:
        # LMCache's keys carry neither a tenant, a salt, a LoRA adapter nor a lineage: only exact
        # requests of the shared namespace take part (an approximate chunk is never exported).
        return bool(chunks) and not opts.tenant and not getattr(request, "cache_salt", None) \
            and not getattr(request, "mm_features", None) and not opts.role \
            and opts.policy.is_exact and getattr(request, "lora_request", None) is None

    def _keys(self, chunks: Sequence[Any]) -> list[str]:
        return [c.exact_key for c in chunks]

    # -- read: LMCache -> OrbitKV ------------------------------------------------------------------

    def before_plan(self, request: Request, opts: RequestOptions, chunks: Sequence[Any]) -> bool:
        """Import the LMCache prefix chunks this request can use; never raises, never waits.
        True while the chunks imported for it are still on their way to the lower tiers: the
        caller asks again next step rather than plan a load a worker in another process could
        not find yet."""
        rid = request.request_id
        waiting = self._waiting.get(rid)
        if waiting is not None:
            return self._is_still_waiting(rid, *waiting)
        if rid in self._seen:
            return False
        self._seen[rid] = None
        if len(self._seen) > MAX_SEEN:
            self._seen.pop(next(iter(self._seen)))
        if not opts.is_load_enabled or not self._is_eligible(request, opts, chunks):
            return False
        try:
            keys = self._import(list(request.prompt_token_ids or ()), list(chunks))
        except Exception:
            logger.exception("OrbitKV: importing LMCache chunks failed; planning without them")
            return False
        if not keys:
            return False
        deadline = time.monotonic() + IMPORT_WAIT_S
        self._waiting[rid] = (keys, deadline)
        return self._is_still_waiting(rid, keys, deadline)

    def _is_still_waiting(self, rid: str, keys: list[str], deadline: float) -> bool:
        if self._store.has_pending_writes(keys):
            if time.monotonic() < deadline:
                return True
            self.counters["import_timeouts"] += 1
        self._waiting.pop(rid, None)
        return False

    def _import(self, tokens: list[int], chunks: list[Any]) -> list[str]:
        """Store the chunks LMCache holds and this store lacks; their keys."""
        keys = self._keys(chunks)
        found = self._store.lookup(keys)
        first = next((i for i, tier in enumerate(found) if tier is None), None)
        if first is None:
            return []
        lm_chunks = lmc.prefix_keys(tokens, **self._key_fields, **self._hash)
        num_present = self._lm.num_prefix_hits([k for _, _, k in lm_chunks])
        covered_end = lm_chunks[num_present - 1][1] if num_present else 0
        targets = []
        for chunk, key in zip(chunks[first:], keys[first:], strict=True):
            if chunk.end > covered_end:
                break
            targets.append((chunk, key))
        if not targets:
            return []
        lo = targets[0][0].start // self._chunk_size
        span = lm_chunks[lo:num_present]
        got = self._lm.batch_get([k for _, _, k in span])
        usable = next((i for i, g in enumerate(got) if g is None or g[1] != self._fmt), len(got))
        if usable == 0:
            return []
        kv = torch.cat([g[0] for g in got[:usable]], dim=2)  # [2|1, layers, tokens, features]
        if not self._fits(kv):
            self.counters["bad_chunks"] += usable
            return []
        base, end = span[0][0], span[usable - 1][1]
        items = []
        for chunk, key in targets:
            if chunk.end > end:
                break
            part = kv[:, :, chunk.start - base : chunk.end - base]
            items.append((key, self._entry(chunk, part)))
        if not items:
            return []
        # Written through in the background; before_plan holds the request until it has landed.
        self._store.put_many(items)
        self.counters["imported_chunks"] += len(items)
        self.counters["imported_tokens"] += sum(e.meta.num_tokens for _, e in items)
        return [key for key, _ in items]

    def _fits(self, kv: torch.Tensor) -> bool:
        ident = self._identity
        features = (ident.head_dim if ident.is_mla else ident.num_kv_heads * ident.head_dim)
        return (kv.dim() == 4 and kv.shape[1] == ident.num_layers and kv.dtype == ident.cache_dtype
                and (ident.is_mla or kv.shape[3] == features))

    def _entry(self, chunk: Chunk, part: torch.Tensor) -> Any:
        from orbitkv.store.entry import make_entry

        ident = self._identity
        tensors = lmc.to_layer_tensors(part.contiguous(), self._fmt, ident.num_kv_heads)
        return make_entry(
            CONDITIONED, tensors, model_fingerprint=ident.model_fingerprint, layout=ident.layout,
            start_pos=chunk.start, rope_hash=ident.rope_hash, antecedent=chunk.antecedent,
            antecedent_key=chunk.antecedent_hash,
            dtype=str(ident.cache_dtype).removeprefix("torch."),
        )

    # -- write: OrbitKV -> LMCache -----------------------------------------------------------------

    def after_finish(self, request: Request, opts: RequestOptions, chunks: Sequence[Any]) -> None:
        """Queue the finished prompt's LMCache chunks for writing; never blocks."""
        self._seen.pop(request.request_id, None)
        self._waiting.pop(request.request_id, None)
        if not opts.is_save_enabled or not self._is_eligible(request, opts, chunks):
            return
        try:
            self._jobs.put_nowait((list(request.prompt_token_ids or ()), list(chunks)))
        except queue.Full:
            logger.warning("OrbitKV: LMCache export queue full; a prompt's chunks stay OrbitKV-only")

    def _export_loop(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                self._export(*job)
            except Exception:
                logger.exception("OrbitKV: writing LMCache chunks failed")
            finally:
                self._jobs.task_done()

    def _export(self, tokens: list[int], chunks: list[Any]) -> None:
        hash_options = dict(self._hash, save_unfull_chunk=False)  # never a chunk still growing
        lm_chunks = lmc.prefix_keys(tokens, **self._key_fields, **hash_options)
        if not lm_chunks:
            return
        have = self._lm.batch_exists([k for _, _, k in lm_chunks])
        todo = [c for c, is_there in zip(lm_chunks, have, strict=True) if not is_there]
        if not todo:
            return
        need = [c for c in chunks if c.end > todo[0][0] and c.start < todo[-1][1]]
        keys = self._keys(need)
        deadline = time.monotonic() + EXPORT_WAIT_S
        while not all(self._store.lookup(keys)):
            if time.monotonic() > deadline:
                self.counters["export_timeouts"] += 1
                return
            time.sleep(0.2)
        entries = self._store.get(keys, expect_fingerprint=self._identity.model_fingerprint)
        if any(e is None for e in entries):
            return
        parts = [lmc.from_layer_tensors(e.tensors)[0] for e in entries]
        kv = torch.cat(parts, dim=2)
        base = need[0].start
        items = [(key, kv[:, :, start - base : end - base].contiguous(), self._fmt)
                 for start, end, key in todo]
        self._lm.batch_put(items)
        self.counters["exported_chunks"] += len(items)

    def flush(self) -> None:
        """Wait until every queued export is done (tests, shutdown)."""
        self._jobs.join()

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=EXPORT_WAIT_S + 5)
        self._lm.close()
