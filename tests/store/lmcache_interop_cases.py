"""LMCache 0.5.6 as the peer: OrbitKV's store/lmcache.py against LMCache's own code, byte for byte.

The peer is the installed ``lmcache`` package, not a copy of its formats:
- ``lmcache.utils.CacheEngineKey`` (key strings), ``lmcache.v1.protocol.RemoteMetadata`` (metadata
  bytes), ``lmcache.v1.token_database.ChunkedTokenDatabase`` (prefix chunk hashes);
- ``lmcache.v1.storage_backend.connector.redis_connector.RedisConnector``, LMCache's real Redis
  connector, over a real ``LocalCPUBackend`` (its CPU allocator), against the same redis-server.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import redis
import torch
from orbitkv.store import lmcache as okv
from orbitkv.store.redis_backend import RedisBackend

lmc_utils = pytest.importorskip(
    "lmcache.utils", reason="lmcache==0.5.6 is installed by `make venv`"
)
from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402
from lmcache.v1.memory_management import MemoryFormat  # noqa: E402
from lmcache.v1.metadata import LMCacheMetadata  # noqa: E402
from lmcache.v1.protocol import RemoteMetadata, init_remote_metadata_info  # noqa: E402
from lmcache.v1.token_database import ChunkedTokenDatabase  # noqa: E402

CacheEngineKey = lmc_utils.CacheEngineKey
MODEL = "orbitkv/tiny-test"
CHUNK = 16
NUM_LAYERS, NUM_HEADS, HEAD_DIM = 3, 2, 8
TOKENS = list(range(1000, 1000 + 2 * CHUNK + 5))  # two full chunks and a partial one


def lm_metadata(dtype: torch.dtype, *, use_mla: bool = False) -> LMCacheMetadata:
    kv_shape = (NUM_LAYERS, 1 if use_mla else 2, CHUNK, 1 if use_mla else NUM_HEADS, HEAD_DIM)
    return LMCacheMetadata(
        model_name=MODEL,
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=dtype,
        kv_shape=kv_shape,
        use_mla=use_mla,
        chunk_size=CHUNK,
    )


def lm_config(
    url: str | None = None, hash_algorithm: str = "builtin", save_unfull_chunk: bool = True
) -> LMCacheEngineConfig:
    # save_unfull_chunk (LMCache's default is False) so that a partial last chunk is covered too.
    return LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK,
        local_cpu=True,
        max_local_cpu_size=0.05,
        remote_url=url,
        remote_serde="naive",
        pre_caching_hash_algorithm=hash_algorithm,
        save_unfull_chunk=save_unfull_chunk,
    )


def layer_kv(num_tokens: int, dtype: torch.dtype, seed: int) -> tuple[list, list]:
    g = torch.Generator().manual_seed(seed)

    def one() -> torch.Tensor:
        return torch.randn(num_tokens, NUM_HEADS, HEAD_DIM, generator=g).to(dtype)

    return [one() for _ in range(NUM_LAYERS)], [one() for _ in range(NUM_LAYERS)]


class LMCachePeer:
    """LMCache's RedisConnector on its own event loop thread, as LMCache runs it."""

    def __init__(self, url: str, dtype: torch.dtype, *, use_mla: bool = False) -> None:
        from lmcache.v1.storage_backend.connector.redis_connector import RedisConnector
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

        self.meta = lm_metadata(dtype, use_mla=use_mla)
        self.cpu = LocalCPUBackend(lm_config(url), self.meta)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.conn = RedisConnector(url, self.loop, self.cpu)

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=30)

    def allocate(self, kv: torch.Tensor, fmt: MemoryFormat):
        obj = self.cpu.allocate([kv.shape], [kv.dtype], fmt)
        obj.tensor.copy_(kv)
        return obj

    def close(self) -> None:
        # RedisConnector.close() awaits a blocking shutdown and hangs; release its parts directly.
        self.run(self.conn.pq_executor.shutdown_async(wait=False))
        self.run(self.conn.connection.aclose())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn]
)
def test_key_strings_match_cache_engine_key(dtype: torch.dtype) -> None:
    for tags in [(), (("user", "alice"), ("lora", "7"))]:
        ours = okv.LMCacheKey(MODEL, 4, 3, 0x1F2E3D4C5B6A7988, dtype, tags)
        configs = {f"lmcache.tag.{k}": v for k, v in tags}
        theirs = CacheEngineKey(MODEL, 4, 3, 0x1F2E3D4C5B6A7988, dtype, configs)
        assert ours.to_string() == theirs.to_string()
        assert CacheEngineKey.from_string(ours.to_string()) == theirs
        assert okv.LMCacheKey.from_string(theirs.to_string()) == ours
    with pytest.raises(ValueError):
        okv.LMCacheKey("a@b", 1, 0, 1, torch.float16)


@pytest.mark.parametrize(
    ("shape", "dtype", "fmt"),
    [
        ((2, NUM_LAYERS, CHUNK, NUM_HEADS * HEAD_DIM), torch.bfloat16, MemoryFormat.KV_2LTD),
        ((2, NUM_LAYERS, 5, NUM_HEADS * HEAD_DIM), torch.float16, MemoryFormat.KV_2LTD),
        ((1, NUM_LAYERS, CHUNK, 576), torch.float32, MemoryFormat.KV_MLA_FMT),
    ],
)
def test_metadata_bytes_match_remote_metadata(shape, dtype, fmt) -> None:
    init_remote_metadata_info(1)
    length = torch.Size(shape).numel() * dtype.itemsize
    theirs = RemoteMetadata(length, [torch.Size(shape)], [dtype], fmt).serialize()
    ours = okv.RemoteMetadata(length, fmt.value, (shape,), (dtype,)).serialize()
    assert ours == theirs
    parsed = okv.RemoteMetadata.deserialize(theirs)
    assert (parsed.length, parsed.fmt, parsed.shapes, parsed.dtypes) == (
        length,
        fmt.value,
        (shape,),
        (dtype,),
    )
    back = RemoteMetadata.deserialize(ours)
    assert (back.length, back.fmt, list(back.shapes[0]), back.dtypes) == (
        length,
        fmt,
        list(shape),
        [dtype],
    )


@pytest.mark.parametrize("algorithm", ["builtin", "sha256_cbor"])
@pytest.mark.parametrize("save_unfull_chunk", [True, False])
def test_chunk_keys_match_token_database(algorithm: str, save_unfull_chunk: bool) -> None:
    config = lm_config(hash_algorithm=algorithm, save_unfull_chunk=save_unfull_chunk)
    db = ChunkedTokenDatabase(config, lm_metadata(torch.bfloat16))
    theirs = [(s, e, k.to_string()) for s, e, k in db.process_tokens(tokens=torch.tensor(TOKENS))]
    ours = okv.prefix_keys(
        TOKENS,
        model_name=MODEL,
        dtype=torch.bfloat16,
        chunk_size=CHUNK,
        hash_algorithm=algorithm,
        save_unfull_chunk=save_unfull_chunk,
    )
    assert [(s, e, k.to_string()) for s, e, k in ours] == theirs
    assert len(theirs) == (3 if save_unfull_chunk else 2)


@pytest.mark.redis
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_orbitkv_writes_lmcache_reads(redis_server, dtype: torch.dtype) -> None:
    """OrbitKV writes a prompt's prefix chunks; LMCache's connector finds and loads them."""
    store = okv.LMCacheRedis(RedisBackend(redis_server.url))
    peer = LMCachePeer(redis_server.url, dtype)
    try:
        written = []
        for i, (start, end, key) in enumerate(
            okv.prefix_keys(
                TOKENS, model_name=MODEL, dtype=dtype, chunk_size=CHUNK, save_unfull_chunk=True
            )
        ):
            kv = okv.pack_kv(*layer_kv(end - start, dtype, seed=i))
            written.append((key, kv, okv.FMT_KV_2LTD))
        store.batch_put(written)
        # LMCache derives its own keys from the tokens, then asks its connector.
        db = ChunkedTokenDatabase(lm_config(redis_server.url), peer.meta)
        lm_keys = [k for _, _, k in db.process_tokens(tokens=torch.tensor(TOKENS))]
        assert [k.to_string() for k in lm_keys] == [k.to_string() for k, _, _ in written]
        assert peer.run(peer.conn.batched_async_contains("lookup", lm_keys)) == len(lm_keys)
        for lm_key, (_, kv, _) in zip(lm_keys, written, strict=True):
            obj = peer.run(peer.conn.get(lm_key))
            assert obj is not None and obj.get_memory_format() == MemoryFormat.KV_2LTD
            assert list(obj.get_shapes()[0]) == list(kv.shape) and obj.get_dtypes() == [dtype]
            assert torch.equal(obj.tensor.view(torch.uint8), kv.view(torch.uint8))
    finally:
        peer.close()
        store.close()


@pytest.mark.redis
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_lmcache_writes_orbitkv_reads(redis_server, dtype: torch.dtype) -> None:
    """LMCache's connector stores chunks; OrbitKV reads them back identically, bytes included."""
    peer = LMCachePeer(redis_server.url, dtype)
    store = okv.LMCacheRedis(RedisBackend(redis_server.url))
    raw = redis.Redis.from_url(redis_server.url)
    try:
        db = ChunkedTokenDatabase(lm_config(redis_server.url), peer.meta)
        chunks = []
        for i, (start, end, lm_key) in enumerate(db.process_tokens(tokens=torch.tensor(TOKENS))):
            ks, vs = layer_kv(end - start, dtype, seed=10 + i)
            kv = torch.stack(
                [torch.stack([k.flatten(1) for k in ks]), torch.stack([v.flatten(1) for v in vs])]
            )
            peer.run(peer.conn.put(lm_key, peer.allocate(kv, MemoryFormat.KV_2LTD)))
            chunks.append((lm_key, ks, vs))
        keys = [okv.LMCacheKey.from_string(k.to_string()) for k, _, _ in chunks]
        assert keys == [
            k
            for _, _, k in okv.prefix_keys(
                TOKENS, model_name=MODEL, dtype=dtype, chunk_size=CHUNK, save_unfull_chunk=True
            )
        ]
        assert store.num_prefix_hits(keys) == len(keys)
        for key, got, (_, ks, vs) in zip(keys, store.batch_get(keys), chunks, strict=True):
            assert got is not None
            kv, fmt = got
            assert fmt == okv.FMT_KV_2LTD
            got_ks, got_vs = okv.unpack_kv(kv, NUM_HEADS)
            assert all(
                torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                for a, b in zip(got_ks, ks, strict=True)
            )
            assert all(
                torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                for a, b in zip(got_vs, vs, strict=True)
            )
            # What OrbitKV would write for this chunk is exactly what LMCache wrote.
            kv_bytes, meta = okv.encode_chunk(okv.pack_kv(ks, vs))
            assert raw.get(key.kv_bytes_key) == kv_bytes and raw.get(key.metadata_key) == meta
        tensors = okv.to_layer_tensors(*store.get(keys[0]), num_kv_heads=NUM_HEADS)
        assert sorted(tensors) == sorted(f"{p}.{i}" for p in "kv" for i in range(NUM_LAYERS))
        assert torch.equal(okv.from_layer_tensors(tensors)[0], store.get(keys[0])[0])
    finally:
        raw.close()
        peer.close()
        store.close()


@pytest.mark.redis
def test_mla_chunks_both_ways(redis_server) -> None:
    peer = LMCachePeer(redis_server.url, torch.bfloat16, use_mla=True)
    store = okv.LMCacheRedis(RedisBackend(redis_server.url))
    try:
        latent = torch.randn(1, NUM_LAYERS, CHUNK, HEAD_DIM).to(torch.bfloat16)
        theirs = CacheEngineKey(MODEL, 1, 0, 0xABC, torch.bfloat16)
        peer.run(peer.conn.put(theirs, peer.allocate(latent, MemoryFormat.KV_MLA_FMT)))
        kv, fmt = store.get(okv.LMCacheKey.from_string(theirs.to_string()))
        assert fmt == okv.FMT_KV_MLA and torch.equal(kv, latent)
        assert sorted(okv.to_layer_tensors(kv, fmt)) == [f"kv.{i}" for i in range(NUM_LAYERS)]
        ours = okv.LMCacheKey(MODEL, 1, 0, 0xDEF, torch.bfloat16)
        store.put(ours, latent + 1, okv.FMT_KV_MLA)
        obj = peer.run(peer.conn.get(CacheEngineKey.from_string(ours.to_string())))
        assert obj.get_memory_format() == MemoryFormat.KV_MLA_FMT and torch.equal(
            obj.tensor, latent + 1
        )
    finally:
        peer.close()
        store.close()


@pytest.mark.redis
def test_missing_and_damaged_chunks_are_misses(redis_server) -> None:
    store = okv.LMCacheRedis(RedisBackend(redis_server.url))
    raw = redis.Redis.from_url(redis_server.url)
    try:
        keys = [okv.LMCacheKey(MODEL, 1, 0, h, torch.float16) for h in range(1, 5)]
        kv = okv.pack_kv(*layer_kv(4, torch.float16, seed=0))
        store.batch_put([(k, kv, okv.FMT_KV_2LTD) for k in keys[:3]])
        raw.delete(keys[0].kv_bytes_key)  # metadata without payload (Redis evicted it)
        raw.set(keys[1].kv_bytes_key, raw.get(keys[1].kv_bytes_key)[:-2])  # truncated payload
        raw.set(keys[2].metadata_key, b"\x00" * 9)  # garbage metadata
        assert store.batch_get(keys) == [None] * 4
        stats = store.stats()
        assert stats["lmcache.corrupt"] == 2 and stats["lmcache.misses"] == 2
        assert store.num_prefix_hits(keys) == 3  # existence is LMCache's: the metadata key
    finally:
        raw.close()
        store.close()


def test_redis_down_is_a_miss_not_an_error() -> None:
    store = okv.LMCacheRedis(RedisBackend("redis://127.0.0.1:9", connect_timeout_s=0.2))
    key = okv.LMCacheKey(MODEL, 1, 0, 1, torch.float16)
    store.put(key, okv.pack_kv(*layer_kv(2, torch.float16, seed=0)))
    assert store.get(key) is None and store.batch_exists([key]) == [False]
    store.close()
