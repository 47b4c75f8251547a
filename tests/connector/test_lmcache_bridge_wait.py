"""The LMCache bridge never blocks the scheduler on a write to Redis: the chunks it imports for a
request are written in the background, and the request is held (``before_plan`` answers True, the
connector returns None: ask again next step) until they reached Redis, where a worker in another
process reads them. Real redis-server, behind a loopback link that delays every transfer."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import redis
import torch
from orbitkv.connector.scheduler.lmcache_bridge import LMCacheBridge
from orbitkv.store import lmcache as lmc
from orbitkv.store.keys import antecedent_hash, chunk_cid, conditioned_key
from orbitkv.store.tiered import TieredStore
from redis_server import RedisServer, has_redis
from slow_proxy import SlowProxy

from orbitkv.config import OrbitKVConfig

pytestmark = pytest.mark.skipif(not has_redis(), reason="needs redis-server")

CHUNK = 16
LAYERS, HEADS, DIM = 2, 2, 8
FP, LAYOUT = "fp-bridge-test", "mha:float32"


def _identity():
    return SimpleNamespace(model_fingerprint=FP, layout=LAYOUT, cache_dtype=torch.float32,
                           num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM, is_mla=False,
                           rope_hash="", positions=SimpleNamespace(kind="index"))


def _chunks(tokens):
    out, before = [], []
    for start in range(0, len(tokens), CHUNK):
        cid = chunk_cid(FP, LAYOUT, "", tokens[start : start + CHUNK])
        ante = antecedent_hash(before)
        out.append(SimpleNamespace(cid=cid, start=start, end=start + CHUNK,
                                   antecedent=tuple(before), antecedent_hash=ante,
                                   exact_key=conditioned_key(cid, ante)))
        before.append(cid)
    return out


def test_import_does_not_wait_for_redis_and_holds_the_request_until_written():
    tokens = list(range(100, 100 + 2 * CHUNK))
    with RedisServer() as server, SlowProxy(server.port, delay_s=0.5) as proxy:
        config = OrbitKVConfig(lmcache_interop=True, remote_url=server.url, chunk_size=CHUNK,
                               pre_caching_hash_algorithm="sha256_cbor", lmcache_model_name="m")
        lm = lmc.LMCacheRedis.from_url(server.url)
        g = torch.Generator().manual_seed(0)
        lm.batch_put([
            (key, torch.randn(2, LAYERS, CHUNK, HEADS * DIM, generator=g), lmc.FMT_KV_2LTD)
            for _, _, key in lmc.prefix_keys(tokens, model_name="m", dtype=torch.float32,
                                              chunk_size=CHUNK, hash_algorithm="sha256_cbor")
        ])
        # The store's Redis tier is the same server behind a link that holds each transfer 0.5 s.
        store = TieredStore(memory_nbytes=1 << 24, redis_url=f"redis://127.0.0.1:{proxy.port}",
                            redis_socket_timeout_s=5.0)
        vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=1),
                                      model_config=SimpleNamespace(model="m"))
        bridge = LMCacheBridge(vllm_config, config, _identity(), store)
        request = SimpleNamespace(request_id="r1", prompt_token_ids=tokens, cache_salt=None,
                                  mm_features=None, lora_request=None)
        opts = SimpleNamespace(is_load_enabled=True, is_save_enabled=False, tenant="", role="",
                               policy=SimpleNamespace(is_exact=True))
        chunks = _chunks(tokens)
        started = time.monotonic()
        is_waiting = bridge.before_plan(request, opts, chunks)
        assert time.monotonic() - started < 0.3  # the scheduler's step is not held by Redis
        assert is_waiting is True and bridge.counters["imported_chunks"] == 2
        num_steps = 0
        while bridge.before_plan(request, opts, chunks):
            num_steps += 1
            assert num_steps < 400, "the import never reached Redis"
            time.sleep(0.025)
        assert num_steps > 0  # held for some steps, not planned before the write landed
        direct = redis.Redis.from_url(server.url)
        names = bridge._keys(chunks)
        assert all(direct.exists(name) for name in names)  # a worker elsewhere finds them now
        assert bridge.before_plan(request, opts, chunks) is False  # once released, never again
        bridge.close()
        store.close()
