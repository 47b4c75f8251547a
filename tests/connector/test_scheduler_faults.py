"""The scheduler half in a process of its own (vLLM's CPU layout): faults of its own store are
counted and exported, and planning against a frozen Redis is bounded by the lookup timeout."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch
from orbitkv.connector import runtime
from orbitkv.connector.identity import ModelIdentity
from orbitkv.connector.scheduler.half import SchedulerHalf
from redis_server import RedisServer, has_redis

from orbitkv.config import OrbitKVConfig

pytestmark = [
    pytest.mark.redis,
    pytest.mark.skipif(not has_redis(), reason="redis-server is not installed"),
]

LOOKUP_TIMEOUT_S = 0.05


@pytest.fixture
def redis():
    with RedisServer() as server:
        yield server


def _identity() -> ModelIdentity:
    return ModelIdentity(
        model_fingerprint="e" * 32,
        layout="mha:float32",
        cache_dtype=torch.float32,
        num_layers=2,
        num_kv_heads=2,
        head_dim=32,
        is_mla=False,
        rope=None,
        rope_hash="none",
        anchor_ids=(),
    )


@pytest.fixture
def scheduler_only(redis):
    """A scheduler half whose store has no worker beside it (as in vLLM's CPU layout)."""
    config = OrbitKVConfig(
        chunk_size=4,
        remote_url=redis.url,
        remote_timeout_s=2.0,
        remote_lookup_timeout_s=LOOKUP_TIMEOUT_S,
        remote_backoff_s=0.2,
    )
    shared = runtime.acquire(config)
    vcfg = SimpleNamespace(cache_config=SimpleNamespace(block_size=4))
    half = SchedulerHalf(vcfg, config, _identity(), shared)
    half.attach_scheduler()
    yield half
    runtime.release(shared)


def _request(req_id: str) -> SimpleNamespace:
    tokens = list(range(10, 27))
    return SimpleNamespace(
        request_id=req_id,
        prompt_token_ids=tokens,
        num_tokens=len(tokens),
        kv_transfer_params=None,
        mm_features=[],
        cache_salt=None,
    )


def _plan(half, req_id: str) -> float:
    started = time.monotonic()
    assert half.get_num_new_matched_tokens(_request(req_id), 0) == (0, False)
    return time.monotonic() - started


def _faults(half) -> dict:
    stats = half.take_stats()
    return {} if stats is None else stats.data


def test_refused_redis_in_planning_is_counted(scheduler_only, redis):
    _plan(scheduler_only, "warm")
    assert _faults(scheduler_only).get("store_errors", 0) == 0
    redis.kill()
    _plan(scheduler_only, "down")  # the request is planned (nothing served), not failed
    assert _faults(scheduler_only)["store_errors"] >= 1


def test_frozen_redis_bounds_planning_and_counts_timeouts(scheduler_only, redis):
    _plan(scheduler_only, "warm")  # connections open before the freeze, as in a running server
    _faults(scheduler_only)
    redis.pause()
    try:
        times = [_plan(scheduler_only, f"frozen-{i}") for i in range(5)]
    finally:
        redis.resume()
    # The first lookup waits for its timeout; the breaker answers the next ones at once.
    assert times[0] < 20 * LOOKUP_TIMEOUT_S, times
    assert sum(times) < 40 * LOOKUP_TIMEOUT_S, times
    faults = _faults(scheduler_only)
    assert faults["planning_timeouts"] >= 1 and faults["store_errors"] >= 1, faults
    time.sleep(0.5)  # past the breaker's back-off: a resumed Redis answers again
    assert _plan(scheduler_only, "resumed") < 20 * LOOKUP_TIMEOUT_S
