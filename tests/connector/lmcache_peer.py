"""An LMCache 0.5.6 node's side of a mixed fleet, run in its own interpreter.

    python lmcache_peer.py SPEC.json      # prints one JSON line

LMCache's Redis connector imports numba, which breaks a vLLM engine started later in the same
process (see tests/store/test_lmcache_interop.py), so the real ``lmcache`` package runs here, apart,
as a real LMCache node would. ``SPEC``:

- ``op: "write"``: LMCache's ``ChunkedTokenDatabase`` keys ``tokens``; each full chunk of the KV in
  ``kv_file`` (safetensors ``kv``: ``[2, layers, tokens, heads * head_dim]``, KV_2LTD) is stored by
  LMCache's ``RedisConnector``;
- ``op: "read"``: the same keys, asked with LMCache's ``batched_async_contains``, then loaded with
  ``RedisConnector.get``; the chunks go to ``out_file`` (``chunk.<i>``).
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading

import torch
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.connector.redis_connector import RedisConnector
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
from lmcache.v1.token_database import ChunkedTokenDatabase
from safetensors.torch import load_file, save_file


def main(spec: dict) -> dict:
    dtype = getattr(torch, spec["dtype"])
    chunk = spec["chunk_size"]
    config = LMCacheEngineConfig.from_defaults(
        chunk_size=chunk, local_cpu=True, max_local_cpu_size=0.1, remote_url=spec["url"],
        remote_serde="naive", pre_caching_hash_algorithm=spec["hash_algorithm"],
        save_unfull_chunk=False,
    )
    meta = LMCacheMetadata(
        model_name=spec["model_name"], world_size=1, local_world_size=1, worker_id=0,
        local_worker_id=0, kv_dtype=dtype,
        kv_shape=(spec["num_layers"], 2, chunk, spec["num_kv_heads"], spec["head_dim"]),
        use_mla=False, chunk_size=chunk,
    )
    cpu = LocalCPUBackend(config, meta)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    conn = RedisConnector(spec["url"], loop, cpu)

    def run(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout=60)

    try:
        db = ChunkedTokenDatabase(config, meta)
        keys = [(s, e, k) for s, e, k in db.process_tokens(tokens=torch.tensor(spec["tokens"]))
                if e - s == chunk]
        out = {"keys": [k.to_string() for _, _, k in keys]}
        if spec["op"] == "write":
            kv = load_file(spec["kv_file"])["kv"]
            for start, end, key in keys:
                part = kv[:, :, start:end].contiguous()
                obj = cpu.allocate([part.shape], [part.dtype], MemoryFormat.KV_2LTD)
                obj.tensor.copy_(part)
                run(conn.put(key, obj))
        else:
            out["num_prefix_hits"] = run(conn.batched_async_contains("lookup", [k for _, _, k in keys]))
            chunks = {}
            for i, (_, _, key) in enumerate(keys):
                obj = run(conn.get(key))
                if obj is not None:
                    assert obj.get_memory_format() == MemoryFormat.KV_2LTD
                    chunks[f"chunk.{i}"] = obj.tensor.clone()
            save_file(chunks, spec["out_file"])
            out["num_loaded"] = len(chunks)
        return out
    finally:
        # RedisConnector.close() awaits a blocking shutdown and hangs; release its parts directly.
        run(conn.pq_executor.shutdown_async(wait=False))
        run(conn.connection.aclose())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        result = main(json.load(f))
    print(json.dumps(result))
