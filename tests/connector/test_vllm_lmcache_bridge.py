"""Mixed fleet with LMCache while serving: ``lmcache_interop`` on a real vLLM engine and Redis.

The LMCache node is the real ``lmcache`` 0.5.6 package in its own interpreter (``lmcache_peer.py``):
its ``ChunkedTokenDatabase`` computes the keys and its ``RedisConnector`` writes and reads the bytes.

- LMCache -> OrbitKV: a prompt's KV (read out of vLLM's paged cache after a run with the connector
  off) is written by LMCache under LMCache's keys; the same prompt on the OrbitKV engine is then
  served those chunks as exact hits, although OrbitKV's own chunks start one token later (the
  prompt starts with the anchor token), and its greedy output equals the reference run's;
- OrbitKV -> LMCache: a prompt OrbitKV computed is found by LMCache's reader, chunk for chunk, with
  the KV the engine computed, byte for byte.

Hash settings: ``sha256_cbor`` here, so no ``PYTHONHASHSEED`` has to match between the two
processes (with LMCache's default ``builtin`` every process of every node needs the same one).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from connector_vllm_testlib import CHUNK, OFF, engine, summary
from redis_server import RedisServer, has_redis
from safetensors.torch import load_file, save_file

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.redis,
    pytest.mark.skipif(not has_redis(), reason="needs redis-server"),
    pytest.mark.skipif(importlib.util.find_spec("lmcache") is None,
                       reason="lmcache==0.5.6 is installed by `make venv`"),
]
PEER = Path(__file__).with_name("lmcache_peer.py")
HASH = "sha256_cbor"
MAX_TOKENS = 6


def _segment(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 1000, (n,), generator=g).tolist()


def peer(spec: dict, tmp_path: Path) -> dict:
    path = tmp_path / f"spec-{spec['op']}.json"
    path.write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, str(PEER), str(path)], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def prompt_kv(eng, blocks: list[int], num_tokens: int) -> torch.Tensor:
    """The prompt's KV as vLLM cached it, in LMCache's KV_2LTD: ``[2, layers, tokens, H*D]``."""
    ks, vs = [], []
    for layer in range(eng.worker._identity.num_layers):
        k, v = eng.kv(blocks, 0, num_tokens, layer)
        ks.append(k.reshape(num_tokens, -1))
        vs.append(v.reshape(num_tokens, -1))
    return torch.stack([torch.stack(ks), torch.stack(vs)]).contiguous()


@pytest.fixture(scope="module")
def redis():
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from orbitkv.models.make_model import make_model

    return make_model(tmp_path_factory.mktemp("model") / "qwen2", "qwen2")


@pytest.fixture(scope="module")
def eng(model_dir, redis):
    extra = {"remote_url": redis.url, "orbitkv_lmcache_interop": True,
             "pre_caching_hash_algorithm": HASH, "orbitkv_remote_timeout_s": 2.0}
    # Real (seeded) weights: outputs compared token for token must come from a real model.
    with engine(model_dir, extra_config=extra, load_format="auto", max_model_len=512) as e:
        yield e


def spec_for(eng, model_dir, redis, op: str, tokens: list[int], **files: str) -> dict:
    ident = eng.worker._identity
    return {"op": op, "url": redis.url, "model_name": str(model_dir), "dtype": "bfloat16",
            "chunk_size": CHUNK, "hash_algorithm": HASH, "num_layers": ident.num_layers,
            "num_kv_heads": ident.num_kv_heads, "head_dim": ident.head_dim, "tokens": tokens, **files}


def bridge(eng):
    return eng.sched_connector._bridge


def test_lmcache_chunks_are_served_as_exact_hits(eng, model_dir, redis, tmp_path):
    bos = eng.worker._identity.anchor_ids
    assert bos, "the tiny qwen2 has a BOS anchor: OrbitKV's chunks are offset from LMCache's"
    tokens = list(bos) + _segment(1, 4 * CHUNK + 7)  # 4 full LMCache chunks + a partial one
    request = {"prompt_token_ids": tokens}
    ref, blocks = eng.run(request, OFF, max_tokens=MAX_TOKENS)  # connector off: nothing stored
    kv = prompt_kv(eng, blocks, len(tokens))
    save_file({"kv": kv}, str(tmp_path / "kv.safetensors"))
    wrote = peer(spec_for(eng, model_dir, redis, "write", tokens, kv_file=str(tmp_path / "kv.safetensors")), tmp_path)
    assert len(wrote["keys"]) == 4
    imported = bridge(eng).counters["imported_chunks"]
    out, _ = eng.run(request, max_tokens=MAX_TOKENS)
    s = summary(out)
    # OrbitKV's chunks: the anchor [0, 1), then [1, 33), [33, 65), [65, 97), [97, 129), [129, 136).
    # LMCache covers [0, 128): every OrbitKV chunk ending there, 97 tokens, is served exactly.
    assert s["reused_tokens_by_mode"] == {"exact": 1 + 3 * CHUNK}, s
    assert bridge(eng).counters["imported_chunks"] - imported == 4
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids


def test_orbitkv_chunks_are_found_by_lmcache(eng, model_dir, redis, tmp_path):
    tokens = _segment(2, 4 * CHUNK + 5)
    out, blocks = eng.run({"prompt_token_ids": tokens}, max_tokens=MAX_TOKENS)
    assert summary(out)["num_saved_chunks"] >= 4
    kv = prompt_kv(eng, blocks, len(tokens))
    b = bridge(eng)
    deadline = time.monotonic() + 30
    while b.counters["exported_chunks"] < 4 and time.monotonic() < deadline:
        b.flush()
        time.sleep(0.1)
    got = peer(spec_for(eng, model_dir, redis, "read", tokens, out_file=str(tmp_path / "read.safetensors")), tmp_path)
    assert got["num_prefix_hits"] == 4 and got["num_loaded"] == 4
    chunks = load_file(str(tmp_path / "read.safetensors"))
    for i in range(4):
        want = kv[:, :, i * CHUNK : (i + 1) * CHUNK]
        assert torch.equal(chunks[f"chunk.{i}"].view(torch.uint8), want.contiguous().view(torch.uint8)), i


def test_tenants_and_salts_stay_out_of_lmcache(eng, model_dir, redis):
    """LMCache keys have no tenant: a tenant's or a salted prompt is neither read nor written."""
    from orbitkv.store import lmcache as lmc

    tokens = _segment(3, 2 * CHUNK + 3)
    before = dict(bridge(eng).counters)
    eng.run({"prompt_token_ids": tokens, "cache_salt": "user-1"}, max_tokens=2)
    eng.run({"prompt_token_ids": tokens}, {"orbitkv": {"tenant": "team-1"}}, max_tokens=2)
    bridge(eng).flush()
    # The keys LMCache would ask for (the same strings as its own: tests/store/test_lmcache_interop.py).
    keys = [k for _, _, k in lmc.prefix_keys(tokens, model_name=str(model_dir), dtype=torch.bfloat16,
                                             chunk_size=CHUNK, hash_algorithm=HASH)]
    reader = lmc.LMCacheRedis.from_url(redis.url)
    try:
        assert len(keys) == 2 and reader.batch_exists(keys) == [False, False]
    finally:
        reader.close()
    assert bridge(eng).counters["exported_chunks"] == before["exported_chunks"]
    assert bridge(eng).counters["imported_chunks"] == before["imported_chunks"]
