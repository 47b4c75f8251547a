"""vLLM's own scheduler, step by step, with OrbitKV's scheduler class and connector half, and no
model: the test plays the worker (which tokens each step sampled, which loaded blocks failed).

``SchedulerRig`` builds vLLM's ``Scheduler`` or ``AsyncScheduler`` (``OrbitKVScheduler`` picks) on a
real ``VllmConfig`` of a tiny local model, with the OrbitKV connector's scheduler half and its real
store. It is how the CPU build (which forces async scheduling off) runs the async class, and how a
test puts a load failure or a preemption in exactly the step it wants. ``is_v2`` builds the
scheduler as vLLM builds it for its GPU model runner V2 (``v2_runner_testlib.py`` runs V2's
request-state code on what it schedules).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch

LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(4)]  # make_model's tiny qwen2
SAMPLED_TOKEN = 7


class SchedulerRig:
    def __init__(
        self,
        model_dir: Any,
        *,
        is_async: bool = False,
        is_v2: bool = False,
        block_size: int = 16,
        chunk_size: int = 16,
        max_num_batched_tokens: int = 64,
        max_num_seqs: int = 4,
        num_blocks: int = 64,
        extra_config: dict[str, Any] | None = None,
    ) -> None:
        from orbitkv.connector.vllm_ext.hole_scheduler import OrbitKVScheduler
        from vllm.config import (
            CacheConfig,
            DeviceConfig,
            KVTransferConfig,
            ModelConfig,
            SchedulerConfig,
            VllmConfig,
        )
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.structured_output import StructuredOutputManager

        self.block_size = block_size
        extra = {
            "chunk_size": chunk_size,
            "orbitkv_text_chunking": "fixed",
            "max_local_cpu_size": 0.05,
            **(extra_config or {}),
        }
        model = ModelConfig(model=str(model_dir), dtype="bfloat16", max_model_len=1024)
        cache = CacheConfig(block_size=block_size, enable_prefix_caching=True)
        cache.num_gpu_blocks = num_blocks
        sched = SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
            max_model_len=1024, enable_chunked_prefill=True, async_scheduling=is_async,
            is_encoder_decoder=False,
        )
        transfer = KVTransferConfig(
            kv_connector="OrbitKVConnector", kv_connector_module_path="orbitkv.connector",
            kv_role="kv_both", kv_load_failure_policy="recompute", kv_connector_extra_config=extra,
        )
        self.vllm_config = VllmConfig(
            model_config=model, cache_config=cache, scheduler_config=sched,
            kv_transfer_config=transfer, device_config=DeviceConfig("cpu"),
        )
        if is_async:
            # vLLM's CPU platform turns async scheduling off while the config is built; the
            # scheduler classes run without a device, so the test turns it back on.
            self.vllm_config.scheduler_config.async_scheduling = True
        spec = FullAttentionSpec(
            block_size=block_size, num_kv_heads=2, head_size=32, dtype=torch.bfloat16
        )
        self.kv_cache_config = KVCacheConfig(
            num_blocks=num_blocks, kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(LAYERS, spec)],
        )
        # vLLM's config refuses V2 without Triton (the CPU build), so it is built for V1; what V2
        # changes in the scheduler is read once, at its construction (use_v2_model_runner).
        with _v2_model_runner() if is_v2 else contextlib.nullcontext():
            assert self.vllm_config.use_v2_model_runner == is_v2
            self.scheduler = OrbitKVScheduler(
                self.vllm_config, self.kv_cache_config, StructuredOutputManager(self.vllm_config),
                block_size=block_size,
            )
            assert self.scheduler.use_v2_model_runner == is_v2
        hash_fn = get_hash_fn_by_name(cache.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self._block_hasher = get_request_block_hasher(block_size, hash_fn)
        self.outputs: dict[str, list[Any]] = {}
        # Per request, the most preemptions vLLM counted while it ran.
        self.num_preemptions: dict[str, int] = {}

    # -- parts ------------------------------------------------------------------------------------

    @property
    def connector(self) -> Any:
        return self.scheduler.connector

    @property
    def half(self) -> Any:
        return self.connector.scheduler

    @property
    def store(self) -> Any:
        return self.connector.store

    def close(self) -> None:
        self.scheduler.shutdown()

    # -- requests ---------------------------------------------------------------------------------

    def request(
        self, req_id: str, prompt: list[int], *, max_tokens: int = 2,
        params: dict[str, Any] | None = None, cache_salt: str | None = None,
        prompt_logprobs: int | None = None,
    ) -> Any:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        sampling = SamplingParams(
            max_tokens=max_tokens, temperature=0.0, prompt_logprobs=prompt_logprobs,
            extra_args={"kv_transfer_params": params} if params else None,
        )
        return Request(
            req_id, list(prompt), sampling, None, cache_salt=cache_salt,
            block_hasher=self._block_hasher,
        )

    def add(self, req_id: str, prompt: list[int], **kwargs: Any) -> Any:
        req = self.request(req_id, prompt, **kwargs)
        self.scheduler.add_request(req)
        return req

    def chunks(self, prompt: list[int], **kwargs: Any) -> list[Any]:
        """The connector's chunks of a prompt (as a request with these options would have)."""
        probe = self.request("probe-" + str(len(self.outputs)), prompt, **kwargs)
        chunks = self.half.admissions.chunks(probe)[1]
        self.half.admissions.forget(probe.request_id)
        return chunks

    def store_chunks(self, prompt: list[int], indexes: list[int] | None = None, *,
                     lineage: str = "", **kwargs: Any) -> list[str]:
        """Stored conditioned entries for these chunks of ``prompt`` (all by default), as if an
        earlier request had computed them (their KV is never read by the scheduler half)."""
        from orbitkv.store.entry import make_entry
        from orbitkv.store.keys import conditioned_key

        ident = self.half._identity
        keys = []
        for c in self.chunks(prompt, **kwargs):
            if indexes is not None and c.index not in indexes:
                continue
            key = conditioned_key(c.cid, c.antecedent_hash, lineage)
            tensors = {f"{n}.{i}": torch.zeros(c.length, 2, 32, dtype=torch.bfloat16)
                       for i in range(ident.num_layers) for n in ("k", "v")}
            self.store.put(key, make_entry(
                "conditioned", tensors, model_fingerprint=ident.model_fingerprint,
                layout=ident.layout, start_pos=c.start, rope_hash=ident.rope_hash,
                antecedent=c.antecedent, lineage=lineage,
            ))
            keys.append(key)
        self.store.flush()
        return keys

    # -- steps ------------------------------------------------------------------------------------

    def schedule(self) -> Any:
        out = self.scheduler.schedule()
        out._rig_prefill_done = self._prefill_done(out)
        for req_id, request in self.scheduler.requests.items():
            self.num_preemptions[req_id] = max(
                self.num_preemptions.get(req_id, 0), request.num_preemptions
            )
        return out

    def finish(self, out: Any, *, failed_blocks: set[int] | None = None) -> list[Any]:
        """What the worker would report for step ``out``; returns vLLM's engine-core outputs."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        req_ids = list(out.num_scheduled_tokens)
        sampled = [[SAMPLED_TOKEN] if r in out._rig_prefill_done else [] for r in req_ids]
        mro = ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=KVConnectorOutput(invalid_block_ids=set(failed_blocks))
            if failed_blocks else None,
        )
        produced = self.scheduler.update_from_output(out, mro)
        outputs = [o for engine_outputs in produced.values() for o in engine_outputs.outputs]
        for o in outputs:
            self.outputs.setdefault(o.request_id, []).append(o)
        return outputs

    def step(self, *, failed_blocks: set[int] | None = None) -> Any:
        out = self.schedule()
        self.finish(out, failed_blocks=failed_blocks)
        return out

    def run_until_done(self, max_steps: int = 200) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_requests():
                return
            self.step()
        raise AssertionError(f"requests still unfinished after {max_steps} steps")

    def _prefill_done(self, out: Any) -> set[str]:
        """Requests whose scheduled tokens reach the end of their known tokens this step (a
        sampled token comes back for them)."""
        done = set()
        starts = {new.req_id: new.num_computed_tokens for new in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        for req_id, num in out.num_scheduled_tokens.items():
            request = self.scheduler.requests[req_id]
            if starts[req_id] + num >= request.num_tokens:
                done.add(req_id)
        return done

    # -- what vLLM holds --------------------------------------------------------------------------

    def block_ids(self, req_id: str) -> list[int]:
        return list(self.scheduler.kv_cache_manager.get_block_ids(req_id)[0])

    def is_cached(self, block_id: int) -> bool:
        """Whether the block can be found in vLLM's prefix cache (it has a hash)."""
        return self.scheduler.kv_cache_manager.block_pool.blocks[block_id].block_hash is not None

    def local_hit(self, req_id: str, prompt: list[int], **kwargs: Any) -> int:
        """Tokens a new request with this prompt would get from vLLM's prefix cache now (the
        request is looked up as vLLM's scheduler would, then dropped)."""
        probe = self.request(req_id, prompt, **kwargs)
        self.connector.on_new_request(probe)
        _, num, _, _ = self.scheduler._get_local_prefix_cache_hit(probe)
        self.half.admissions.forget(req_id)
        return num

    def summary(self, req_id: str) -> dict[str, Any]:
        final = [o for o in self.outputs.get(req_id, ()) if o.kv_transfer_params]
        return final[-1].kv_transfer_params["orbitkv"] if final else {}

    def prefill_stats(self, req_id: str) -> Any:
        """What vLLM reported for the request's prefill (prompt_tokens_by_source, cached_tokens)."""
        return next(o.prefill_stats for o in self.outputs[req_id] if o.prefill_stats is not None)


@contextlib.contextmanager
def _v2_model_runner() -> Iterator[None]:
    """``VLLM_USE_V2_MODEL_RUNNER=1`` while the scheduler is built. vLLM caches its environment
    once an engine started in this process, so that cache is dropped first."""
    import vllm.envs

    vllm.envs.disable_envs_cache()
    saved = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("VLLM_USE_V2_MODEL_RUNNER", None)
        else:
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = saved
