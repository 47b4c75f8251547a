"""The connector halves driven by hand (no engine): a real memory-only store, a paged CPU cache.

``build_halves`` makes a scheduler half and a worker half sharing one store, as in one vLLM
process, attached to OrbitKV's scheduler (``attach_scheduler``: loads are on) and allowing
approximate reuse for every request, uncalibrated (``approximate_reuse: all``,
``require_calibration: false``) unless a test says otherwise.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from types import SimpleNamespace

import torch
from orbitkv.connector import runtime
from orbitkv.connector.identity import ModelIdentity
from orbitkv.connector.scheduler.half import SchedulerHalf
from orbitkv.connector.worker.half import WorkerHalf
from orbitkv.kernels.paged import PagedLayout, gather_chunk, load_chunk
from orbitkv.kernels.rope import RopeSpec

from orbitkv.config import OrbitKVConfig

BS = 4  # block size
CS = 4  # chunk size
H, D, L = 2, 32, 2  # D: a head size vLLM's CPU cache writer supports
NUM_BLOCKS = 32


def identity() -> ModelIdentity:
    inv_freq = tuple(1.0 / (10000 ** (2 * i / D)) for i in range(D // 2))
    rope = RopeSpec("neox", D, D, inv_freq)
    return ModelIdentity(
        model_fingerprint="f" * 32,
        layout="mha:float32",
        cache_dtype=torch.float32,
        num_layers=L,
        num_kv_heads=H,
        head_dim=D,
        is_mla=False,
        rope=rope,
        rope_hash=rope.fingerprint(),
        anchor_ids=(),
    )


def config(patch_rank: int = 0, **overrides) -> OrbitKVConfig:
    # Patches of 4-token chunks outweigh the chunk's KV: the tests want them formed anyway.
    values = dict(
        chunk_size=CS, max_local_cpu_size=0.01, patch_rank=patch_rank, text_chunking="fixed",
        patch_max_bytes_fraction=100.0, approximate_reuse="all", require_calibration=False,
        save_admission="all",  # the halves' tests save what a first request computes
    )
    values.update(overrides)
    return OrbitKVConfig(**values)


def vllm_config() -> SimpleNamespace:
    return SimpleNamespace(
        cache_config=SimpleNamespace(block_size=BS),
        compilation_config=SimpleNamespace(
            static_forward_context={
                f"model.layers.{i}.self_attn.attn": SimpleNamespace(isa="vec") for i in range(L)
            }
        ),
    )


def build_halves(patch_rank: int = 0, *, is_attached: bool = True, **overrides):
    cfg = config(patch_rank, **overrides)
    shared = runtime.acquire(cfg)
    vcfg = vllm_config()
    ident = identity()
    sched = SchedulerHalf(vcfg, cfg, ident, shared)
    if is_attached:
        sched.attach_scheduler()
    worker = WorkerHalf(vcfg, cfg, ident, shared)
    caches = {
        f"model.layers.{i}.self_attn.attn": torch.zeros(NUM_BLOCKS, H, BS, 2 * D) for i in range(L)
    }
    worker.register_kv_caches(caches)
    return sched, worker, caches, shared


def release(built) -> None:
    built[1].shutdown()
    runtime.release(built[3])


def request(req_id, tokens, params=None, num_tokens=None, cache_salt=None):
    return SimpleNamespace(
        request_id=req_id,
        prompt_token_ids=tokens,
        num_tokens=num_tokens or len(tokens),
        kv_transfer_params=params,
        mm_features=[],
        cache_salt=cache_salt,
        skip_reading_prefix_cache=False,
    )


def new_step(req_id, blocks, num_computed, num_sched):
    return SimpleNamespace(
        scheduled_new_reqs=[
            SimpleNamespace(req_id=req_id, block_ids=(blocks,), num_computed_tokens=num_computed)
        ],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[]
        ),
        num_scheduled_tokens={req_id: num_sched},
    )


def cached_step(req_id, new_blocks, num_computed, num_sched, is_resumed=False):
    return SimpleNamespace(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[req_id],
            resumed_req_ids={req_id} if is_resumed else set(),
            new_block_ids=[(new_blocks,) if new_blocks is not None else None],
            num_computed_tokens=[num_computed],
        ),
        num_scheduled_tokens={req_id: num_sched},
    )


def fill(caches, blocks, num_tokens, seed):
    """Pretend vLLM computed ``num_tokens`` tokens of KV into these blocks."""
    g = torch.Generator().manual_seed(seed)
    slots = torch.tensor([blocks[p // BS] * BS + p % BS for p in range(num_tokens)])
    for cache in caches.values():
        k = torch.randn(num_tokens, H, D, generator=g)
        load_chunk(cache, slots, PagedLayout.CPU_VEC, k, torch.randn(num_tokens, H, D, generator=g))


def step(worker, meta, caches):
    """One forward as vLLM drives the worker half."""
    worker.start_load_kv(meta)
    for name in caches:
        worker.wait_for_layer_load(name)
    worker.wait_for_save(meta)


def kv(caches, blocks, begin, end):
    slots = torch.tensor([blocks[p // BS] * BS + p % BS for p in range(begin, end)])
    return [gather_chunk(c, slots, PagedLayout.CPU_VEC) for c in caches.values()]


def step_meta(sched, caches, req_id, tokens, blocks, seed):
    """The metadata of a step computing a new request whole (nothing to load), its KV filled in
    as vLLM's forward would have; no worker call made."""
    req = request(req_id, tokens)
    sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, None, 0)
    fill(caches, blocks, len(tokens), seed=seed)
    return sched.build_connector_meta(new_step(req_id, blocks, 0, len(tokens)))


def computed_step(halves, req_id, tokens, blocks, seed, params=None, cache_salt=None):
    """One request computed whole in one step (nothing loaded): the request and the step's
    metadata. Its saves are submitted, not awaited; it is not finished."""
    sched, worker, caches, _ = halves
    req = request(req_id, tokens, params, cache_salt=cache_salt)
    sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, None, 0)
    fill(caches, blocks, len(tokens), seed=seed)
    meta = sched.build_connector_meta(new_step(req_id, blocks, 0, len(tokens)))
    step(worker, meta, caches)
    return req, meta


def compute(halves, req_id, tokens, blocks, seed, params=None, cache_salt=None):
    """One request computed whole (nothing loaded) and finished; its step's metadata."""
    req, meta = computed_step(halves, req_id, tokens, blocks, seed, params, cache_salt)
    halves[3].writer.flush()
    halves[0].request_finished(req, blocks)
    return meta


@contextlib.contextmanager
def held_patches(queue) -> Iterator[None]:
    """The patch queue's thread busy with a job that blocks until the block exits: patch jobs
    submitted inside stay queued until then."""
    started, unblock = threading.Event(), threading.Event()
    queue.submit(lambda: (started.set(), unblock.wait(10), [])[2])
    queue.mark_step()
    assert started.wait(10), "the patch queue never ran the blocking job"
    try:
        yield
    finally:
        unblock.set()


@contextlib.contextmanager
def held_writer(writer) -> Iterator[None]:
    """The writer's thread busy with a job that blocks until the block exits: saves submitted
    inside stay in flight (pending) until then."""
    started, unblock = threading.Event(), threading.Event()
    writer.submit(frozenset(), lambda: (started.set(), unblock.wait(10), [])[2])
    assert started.wait(10), "the writer thread never ran the blocking job"
    try:
        yield
    finally:
        unblock.set()

