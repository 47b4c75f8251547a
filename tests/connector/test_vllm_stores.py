"""OrbitKVConnector against real stores and real faults: disk, a real redis-server, fresh processes.

One live engine for the module (memory -> disk -> Redis, loaded by name through the plugin entry
point, Prometheus stat logging on, a KV cache of a few blocks so that concurrent requests preempt).
One child process (``vllm_child.py``) starts two fresh engines after it: one on the live engine's
disk directory only, one on its Redis only. Every reference output comes from the same engine with
the connector off for the request (``OFF``): greedy, so outputs must match token for token.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from connector_vllm_testlib import CHUNK, OFF, assert_informative, flush, summary
from connector_vllm_testlib import engine as start_engine
from redis_server import RedisServer, has_redis

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.redis,
    pytest.mark.skipif(not has_redis(), reason="needs redis-server"),
]

NUM_BLOCKS = 12  # 384 token slots: four requests of 160 tokens cannot run at once
MAX_TOKENS = 4
LLM_KWARGS = {"max_model_len": 256, "max_num_seqs": 4, "num_gpu_blocks_override": NUM_BLOCKS}
CHILD = Path(__file__).with_name("vllm_child.py")
ENTRY_KINDS = ("canonical", "conditioned", "patch")


@pytest.fixture(scope="module")
def redis():
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from orbitkv.models.make_model import make_model

    return make_model(tmp_path_factory.mktemp("model") / "qwen2", "qwen2")


@pytest.fixture(scope="module")
def disk_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("disk")


def _tier_config(disk_dir=None, redis_url=None) -> dict:
    out: dict = {"orbitkv_disk_fsync": False, "orbitkv_remote_timeout_s": 0.5}
    if disk_dir is not None:
        out.update(local_disk=f"file://{disk_dir}", max_local_disk_size=0.25)
    if redis_url is not None:
        out["remote_url"] = redis_url
    return out


@pytest.fixture(scope="module")
def live(model_dir, disk_dir, redis):
    # module_path=None: "OrbitKVConnector" resolves through orbitkv.connector.plugin:register.
    with start_engine(
        model_dir,
        # Tenants these tests pick per request (the deployment allows them).
        extra_config={**_tier_config(disk_dir, redis.url), "orbitkv_request_tenants": ["t1", "t2", "x"]},
        module_path=None,
        disable_log_stats=False,
        **LLM_KWARGS,
    ) as eng:
        yield eng


def _segment(seed: int, n: int = CHUNK) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 1000, (n,), generator=g).tolist()


def _prompt(seed: int, num_chunks: int = 3) -> list[int]:
    return [t for i in range(num_chunks) for t in _segment(seed + i)] + _segment(seed + 99, 8)


def _tokens(ids: list[int], **extra) -> dict:
    return {"prompt_token_ids": ids, **extra}


def _memory_keys(eng) -> set[str]:
    return set(eng.sched_connector.store.memory.iter_keys())


def _tier(eng, name: str):
    store = eng.sched_connector.store
    return store.tiers[store.tier_names.index(name)]


def test_plugin_registers_once_and_again():
    from orbitkv.connector.connector import OrbitKVConnector
    from orbitkv.connector.plugin import register
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    register()
    register()  # vLLM calls general plugins in every process, sometimes twice: no error
    assert KVConnectorFactory.get_connector_class_by_name("OrbitKVConnector") is OrbitKVConnector


def test_fresh_processes_hit_the_disk_and_redis(live, model_dir, disk_dir, redis, tmp_path):
    prompt = _prompt(1000)
    ref, _ = live.run(_tokens(prompt), OFF, max_tokens=MAX_TOKENS)
    assert_informative(ref)
    assert_informative(ref)
    first, _ = live.run(_tokens(prompt), max_tokens=MAX_TOKENS)
    assert summary(first)["num_saved_chunks"] == 4
    flush(live)  # the write-behind queues reach the disk and Redis
    spec = {
        "model_dir": str(model_dir),
        "out": str(tmp_path / "out.json"),
        "max_tokens": MAX_TOKENS,
        "llm_kwargs": LLM_KWARGS,
        "engines": [
            # A new process on the same disk directory; no Redis.
            {"extra_config": _tier_config(disk_dir=disk_dir), "prompts": [prompt]},
            # A second process on the same Redis, with no disk at all.
            {"extra_config": _tier_config(redis_url=redis.url), "prompts": [prompt]},
        ],
    }
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    proc = subprocess.run(
        [sys.executable, str(CHILD), str(tmp_path / "spec.json")],
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    on_disk, on_redis = json.loads((tmp_path / "out.json").read_text())
    assert on_disk["tiers"] == ["memory", "disk"]
    assert on_redis["tiers"] == ["memory", "redis"]
    for run, tier in ((on_disk, "disk"), (on_redis, "redis")):
        (out,) = run["outputs"]
        assert out["summary"]["reused_tokens_by_mode"] == {"exact": len(prompt) - 1}, tier
        assert out["token_ids"] == list(ref.outputs[0].token_ids), tier
        assert run["hits"].get(f"hits.{tier}", 0) >= 4, run["hits"]


def test_tenants_never_share_entries(live):
    prompt = _prompt(2000, num_chunks=2)
    keys_by_tenant = {}
    t1 = {"orbitkv": {"tenant": "t1"}}
    for name, request, params in (
        ("salt-a", _tokens(prompt, cache_salt="a"), None),
        ("salt-b", _tokens(prompt, cache_salt="b"), None),
        ("tenant-1", _tokens(prompt), t1),
        ("tenant-2", _tokens(prompt), {"orbitkv": {"tenant": "t2"}}),
        # Salts under one tenant are disjoint, and tenant "x" is not salt "x".
        ("tenant-1 salt-A", _tokens(prompt, cache_salt="A"), t1),
        ("tenant-1 salt-B", _tokens(prompt, cache_salt="B"), t1),
        ("tenant-1 salt-C", _tokens(prompt, cache_salt="C"), t1),
        ("tenant-x", _tokens(prompt), {"orbitkv": {"tenant": "x"}}),
        ("salt-x", _tokens(prompt, cache_salt="x"), None),
    ):
        before = _memory_keys(live)
        out, _ = live.run(request, params, max_tokens=MAX_TOKENS)
        flush(live)
        assert summary(out)["num_reused_tokens"] == 0, name  # nothing from the other tenants
        assert summary(out)["num_saved_chunks"] == 3, name
        keys_by_tenant[name] = _memory_keys(live) - before
    names = list(keys_by_tenant)
    for i, a in enumerate(names):
        assert keys_by_tenant[a], a
        for b in names[i + 1 :]:
            assert not keys_by_tenant[a] & keys_by_tenant[b], (a, b)
    # A tenant the deployment does not allow is refused: nothing read, nothing written.
    before = _memory_keys(live)
    out, _ = live.run(_tokens(prompt), {"orbitkv": {"tenant": "intruder"}}, max_tokens=MAX_TOKENS)
    flush(live)
    assert summary(out)["num_reused_tokens"] == 0 and summary(out)["num_saved_chunks"] == 0
    assert "request_tenants" in summary(out)["refused"] and _memory_keys(live) == before
    # Each tenant does find its own entries.
    again, _ = live.run(_tokens(prompt, cache_salt="b"), max_tokens=MAX_TOKENS)
    assert summary(again)["reused_tokens_by_mode"] == {"exact": len(prompt) - 1}
    again, _ = live.run(_tokens(prompt), t1, max_tokens=MAX_TOKENS)
    assert summary(again)["reused_tokens_by_mode"] == {"exact": len(prompt) - 1}
    again, _ = live.run(_tokens(prompt, cache_salt="B"), t1, max_tokens=MAX_TOKENS)
    assert summary(again)["reused_tokens_by_mode"] == {"exact": len(prompt) - 1}


def total(name: str, **labels) -> float:
    """A metric's value on vLLM's Prometheus registry (what /metrics serves), summed over the
    samples with these labels."""
    from prometheus_client import REGISTRY

    found = 0.0
    for metric in REGISTRY.collect():
        for sample in metric.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                found += sample.value
    return found


def _flip(buf: bytes, at: int) -> bytes:
    return buf[:at] + bytes([buf[at] ^ 0xFF]) + buf[at + 1 :]


def test_corrupt_entries_are_misses(live, redis):
    import redis as redis_py

    prompt = _prompt(3000)
    ref, _ = live.run(_tokens(prompt), OFF, max_tokens=MAX_TOKENS)
    before = _memory_keys(live)
    live.run(_tokens(prompt), max_tokens=MAX_TOKENS)
    flush(live)
    keys = sorted(k for k in _memory_keys(live) - before if k.split(":")[1] in ENTRY_KINDS)
    assert len(keys) >= 4
    disk, remote = _tier(live, "disk"), _tier(live, "redis")
    client = redis_py.Redis.from_url(redis.url)
    for key in keys:
        path = Path(disk.path_of(key))
        data = path.read_bytes()
        path.write_bytes(_flip(data, len(data) // 2))  # in the tensor payload
        name = remote.key_prefix + key
        value = client.get(name)
        client.set(name, _flip(value, len(value) - 3))
    live.sched_connector.store.memory.batch_delete(keys)  # reads go to disk, then Redis

    corrupt_before = total("vllm:orbitkv_errors_total", kind="corrupt_entries")
    failed_before = total("vllm:orbitkv_errors_total", kind="failed_loads")
    out, _ = live.run(_tokens(prompt), max_tokens=MAX_TOKENS)
    assert summary(out)["num_reused_tokens"] == 0
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    stats = live.sched_connector.store.stats()
    assert stats.get("corrupt.disk", 0) >= 1 and stats.get("corrupt.redis", 0) >= 1, stats
    assert total("vllm:orbitkv_errors_total", kind="corrupt_entries") >= corrupt_before + 2
    assert total("vllm:orbitkv_errors_total", kind="failed_loads") >= failed_before + 1
    client.close()


def test_preemption_and_waiting_leak_no_pins_or_blocks(live, monkeypatch):
    from vllm import SamplingParams

    core = live.llm.llm_engine.engine_core.engine_core
    scheduler = core.scheduler
    pool = scheduler.kv_cache_manager.block_pool
    half = live.sched_connector.scheduler
    shared = [_segment(4000 + i) for i in range(3)]
    # Warm the store: the concurrent requests below load these chunks (and pin their entries).
    live.run(_tokens([t for s in shared for t in s] + _segment(4090, 8)), max_tokens=1)
    flush(live)

    calls: Counter[str] = Counter()
    preempted: list[str] = []
    plan, preempt = half.get_num_new_matched_tokens, scheduler._preempt_request

    def counting_plan(request, num_computed_tokens):
        calls[request.request_id] += 1
        return plan(request, num_computed_tokens)

    def counting_preempt(request, *args, **kwargs):
        preempted.append(request.request_id)
        return preempt(request, *args, **kwargs)

    monkeypatch.setattr(half, "get_num_new_matched_tokens", counting_plan)
    monkeypatch.setattr(scheduler, "_preempt_request", counting_preempt)

    assert live.llm.reset_prefix_cache()
    num_free = pool.get_num_free_blocks()
    prompts = [
        _tokens([t for s in shared[: 1 + i % 3] for t in s] + _segment(4100 + i, 40))
        for i in range(4)
    ]
    sp = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    outs = live.llm.generate(prompts, sp, use_tqdm=False)

    assert preempted, "the tiny KV cache should have forced a preemption"
    assert max(calls.values()) > 1  # waiting and resumed requests are planned again
    assert all(len(o.outputs[0].token_ids) == 60 for o in outs)
    assert sum(summary(o)["num_reused_tokens"] for o in outs) > 0
    flush(live)
    # Nothing is held: every block is back once vLLM's prefix cache lets go of them...
    assert live.llm.reset_prefix_cache()
    assert pool.get_num_free_blocks() == num_free
    # ... and no entry stays pinned, no request state stays in the scheduler half.
    memory = live.sched_connector.store.memory
    assert [k for k in memory.iter_keys() if memory.pin_count(k)] == []
    assert half.num_tracked_requests == 0
    assert not scheduler.requests


def test_prometheus_metrics_record_the_connector(live):
    prompt = _prompt(5000)
    live.run(_tokens(prompt), max_tokens=MAX_TOKENS)
    flush(live)
    # Alone, vLLM's prefix cache would still hold the prompt and OrbitKV serve only its last block.
    assert live.llm.reset_prefix_cache()
    live.run(_tokens(prompt), max_tokens=MAX_TOKENS)  # exact hit from memory
    live.run(_tokens(prompt), max_tokens=MAX_TOKENS)  # stats of the previous step land now

    assert total("vllm:orbitkv_loaded_tokens_total", mode="exact") >= len(prompt) - 1
    assert total("vllm:orbitkv_hit_chunks_total", mode="exact") >= 4
    assert total("vllm:orbitkv_hit_tokens_total", tier="memory") >= len(prompt) - 1
    assert total("vllm:orbitkv_prompt_tokens_total", source="orbitkv") >= len(prompt) - 1
    assert total("vllm:orbitkv_prompt_tokens_total", source="computed") > 0
    assert total("vllm:orbitkv_loaded_bytes_total") > 0
    assert total("vllm:orbitkv_saved_bytes_total") > 0
    assert total("vllm:orbitkv_stored_bytes_total", kind="conditioned") > 0
    assert total("vllm:orbitkv_saved_chunks_total") >= 4
    assert total("vllm:orbitkv_load_latency_seconds_count") >= 1
    assert total("vllm:orbitkv_save_latency_seconds_count") >= 4


def test_redis_killed_mid_workload(live, redis):
    prompts = [_prompt(6000 + 100 * i, num_chunks=2) for i in range(3)]
    refs = [live.run(_tokens(p), OFF, max_tokens=MAX_TOKENS)[0] for p in prompts]
    for ref in refs:
        assert_informative(ref)
    remote = _tier(live, "redis")
    outs = [live.run(_tokens(prompts[0]), max_tokens=MAX_TOKENS, keep_prefix_cache=False)[0]]
    redis.kill()
    try:
        outs.append(live.run(_tokens(prompts[1]), max_tokens=MAX_TOKENS, keep_prefix_cache=False)[0])
        flush(live)  # the disk has both prompts' entries; Redis dropped the second's
        live.sched_connector.store.memory.batch_delete(list(_memory_keys(live)))
        for p in (prompts[0], prompts[1], prompts[2]):  # disk hits, and a write Redis drops
            outs.append(live.run(_tokens(p), max_tokens=MAX_TOKENS, keep_prefix_cache=False)[0])
        flush(live)
    finally:
        redis.start()
    want = [refs[0], refs[1], refs[0], refs[1], refs[2]]
    for got, ref in zip(outs, want, strict=True):
        assert got.outputs[0].token_ids == ref.outputs[0].token_ids
    assert summary(outs[2])["reused_tokens_by_mode"] == {"exact": len(prompts[0]) - 1}
    assert summary(outs[3])["reused_tokens_by_mode"] == {"exact": len(prompts[1]) - 1}
    stats = remote.stats()
    assert sum(v for k, v in stats.items() if k.startswith(("errors", "dropped"))) > 0, stats


def test_metrics_agree_with_vllm_prompt_tokens_by_source(live, redis):
    """OrbitKV's prompt-token metric and vLLM's own ``prompt_tokens_by_source`` move together,
    for a clean hit and for a hit whose first chunk is corrupt in every tier (vLLM recomputes
    everything after it, so neither counts any of it as transferred)."""
    import redis as redis_py

    prompt = _prompt(7000)
    ref, _ = live.run(_tokens(prompt), OFF, max_tokens=MAX_TOKENS)
    assert_informative(ref)
    live.run(_tokens(prompt), max_tokens=MAX_TOKENS, keep_prefix_cache=False)
    first = live.last_chunks[0]
    flush(live)

    def counts():
        return (
            total("vllm:orbitkv_prompt_tokens_total", source="orbitkv"),
            total("vllm:prompt_tokens_by_source_total", source="external_kv_transfer"),
        )

    def served_by(prompt_ids):
        before = counts()
        out, _ = live.run(_tokens(prompt_ids), max_tokens=MAX_TOKENS, keep_prefix_cache=False)
        live.run(_tokens(_prompt(7500 + len(before))), OFF, max_tokens=1)  # flush the stats
        after = counts()
        return out, (after[0] - before[0], after[1] - before[1])

    out, (ours, vllms) = served_by(prompt)
    assert summary(out)["num_reused_tokens"] == ours == vllms == len(prompt) - 1

    from orbitkv.store.keys import conditioned_key

    key = conditioned_key(first.cid, first.antecedent_hash)
    # Corrupt every lower copy (a Redis that an earlier test restarted may not hold one).
    disk, remote = _tier(live, "disk"), _tier(live, "redis")
    path = Path(disk.path_of(key))
    path.write_bytes(_flip(path.read_bytes(), path.stat().st_size // 2))
    client = redis_py.Redis.from_url(redis.url)
    value = client.get(remote.key_prefix + key)
    if value is not None:
        client.set(remote.key_prefix + key, _flip(value, 7))
    client.close()
    live.sched_connector.store.memory.batch_delete([key])
    out, (ours, vllms) = served_by(prompt)
    assert summary(out)["num_reused_tokens"] == ours == vllms == 0
    assert out.num_cached_tokens == 0
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
