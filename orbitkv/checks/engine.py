"""An in-process vLLM engine with OrbitKV whose paged KV cache and store a check can read.

``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps the scheduler, the worker and their connector halves in
this process, so a check reads vLLM's paged cache back through the connector's own gather and
writes entries into the store the engine reads. A finished request's blocks keep their KV until
another request is given them, so the cache is read right after ``run``.
"""

from __future__ import annotations

import gc
import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from orbitkv.serving.server_process import SCHEDULER_CLS

OFF = {"orbitkv": {"load": False, "save": False}}


@dataclass
class Run:
    output: Any  # vLLM's RequestOutput
    block_ids: list[int]
    chunks: list[Any]  # the connector's chunks of the prompt
    # What the connector served, as its ledger kept it: (begin, end, mode) token runs.
    served: list[tuple[int, int, str]] = field(default_factory=list)

    def num_served(self, begin: int, end: int) -> int:
        """Tokens of ``[begin, end)`` the connector served."""
        return sum(max(0, min(end, e) - max(begin, b)) for b, e, _ in self.served)

    @property
    def summary(self) -> dict[str, Any]:
        return (self.output.kv_transfer_params or {}).get("orbitkv", {})


class InProcessEngine:
    def __init__(self, llm: Any, block_size: int) -> None:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        self.llm = llm
        self.block_size = block_size
        self.worker = get_kv_transfer_group().worker
        self.connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
        self._finished: dict[str, tuple[list[int], list[Any], list[tuple[int, int, str]]]] = {}
        inner = self.connector.request_finished

        def record(request: Any, block_ids: Any) -> Any:
            state = self.connector.scheduler._reqs.get(request.request_id)
            chunks = list(state.chunks) if state is not None else []
            served = [(r.begin, r.end, r.mode) for r in state.runs] if state is not None else []
            self._finished[request.request_id] = (list(block_ids), chunks, served)
            return inner(request, block_ids)

        self.connector.request_finished = record

    @property
    def store(self) -> Any:
        return self.connector.store

    def flush(self) -> None:
        self.connector.writer.flush()
        self.store.flush(60.0)

    def chat(
        self,
        messages: list[dict[str, Any]],
        params: dict[str, Any] | None = None,
        *,
        max_tokens: int = 1,
        logprobs: int | None = None,
        keep_prefix_cache: bool = False,
    ) -> Run:
        """Greedy chat completion of one request; vLLM's own prefix cache is emptied first."""
        from vllm import SamplingParams

        if not keep_prefix_cache:
            assert self.llm.reset_prefix_cache()
        extra = {"kv_transfer_params": params} if params is not None else None
        sp = SamplingParams(
            max_tokens=max_tokens, temperature=0.0, logprobs=logprobs, extra_args=extra
        )
        before = set(self._finished)
        out = self.llm.chat(messages, sp, use_tqdm=False)[0]
        (req_id,) = set(self._finished) - before
        self.flush()
        return Run(out, *self._finished.pop(req_id))

    def generate(
        self,
        ids: list[int],
        params: dict[str, Any] | None = None,
        *,
        cache_salt: str | None = None,
        lora_request: Any = None,
        max_tokens: int = 1,
    ) -> Run:
        """A greedy completion of token ids, vLLM's prefix cache emptied first: a full prefill
        (when OrbitKV's loads are off)."""
        from vllm import SamplingParams

        assert self.llm.reset_prefix_cache()
        extra = {"kv_transfer_params": params} if params is not None else None
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, extra_args=extra)
        prompt: dict[str, Any] = {"prompt_token_ids": list(ids)}
        if cache_salt:
            prompt["cache_salt"] = cache_salt
        before = set(self._finished)
        out = self.llm.generate([prompt], sp, use_tqdm=False, lora_request=lora_request)[0]
        (req_id,) = set(self._finished) - before
        return Run(out, *self._finished.pop(req_id))

    def kv(self, block_ids: list[int], begin: int, end: int, layer: int):
        """K and V ``[N, H, D]`` of token positions [begin, end) of a finished request."""
        from orbitkv.connector.metadata import slots_for
        from orbitkv.kernels.paged import gather_chunk

        name = next(n for n, i in self.worker._layer_index.items() if i == layer)
        slots = torch.tensor(slots_for(block_ids, self.block_size, begin, end), dtype=torch.int64)
        k, v = gather_chunk(self.worker._caches[name], slots, self.worker._layout)
        return k.clone(), None if v is None else v.clone()

    @property
    def num_layers(self) -> int:
        return len(self.worker._layer_index)


@contextmanager
def in_process_llm(model_dir: str, *, kv_cache_gb: str = "1", **llm_kwargs: Any):
    """A ``vllm.LLM`` in this process (no engine-core subprocess), torn down completely on exit:
    engine, KV connector if any, process group, and the environment it set."""
    saved = {k: os.environ.get(k) for k in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE")}
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = kv_cache_gb
    from vllm import LLM
    from vllm.distributed.kv_transfer import ensure_kv_transfer_shutdown
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    llm = LLM(model=str(model_dir), **llm_kwargs)
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        ensure_kv_transfer_shutdown()
        del llm
        cleanup_dist_env_and_memory()
        gc.collect()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextmanager
def orbitkv_llm(
    model_dir: str,
    extra_config: dict[str, Any],
    *,
    module_path: str | None = "orbitkv.connector",
    kv_cache_gb: str = "1",
    **llm_kwargs: Any,
):
    """A ``vllm.LLM`` in this process with the OrbitKV connector and its scheduler extension
    (seeded weights), torn down completely on exit: engine, connector, process group, env.
    ``module_path=None`` loads the connector by name, through the plugin entry point."""
    from vllm.config import KVTransferConfig

    ktc = KVTransferConfig(
        kv_connector="OrbitKVConnector",
        kv_connector_module_path=module_path,
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config=dict(extra_config),
    )
    kwargs = dict(
        load_format="auto",
        dtype="bfloat16",
        max_model_len=2048,
        block_size=32,  # vLLM's CPU attention takes multiples of 32
        enable_prefix_caching=True,
        enforce_eager=True,
        max_num_seqs=1,
        kv_transfer_config=ktc,
        scheduler_cls=SCHEDULER_CLS,
    )
    kwargs.update(llm_kwargs)
    with in_process_llm(model_dir, kv_cache_gb=kv_cache_gb, **kwargs) as llm:
        yield llm


@contextmanager
def engine(model_dir: str, extra_config: dict[str, Any], *, block_size: int = 32, **llm_kwargs: Any):
    """``orbitkv_llm`` wrapped for a check: its paged cache and store readable (``InProcessEngine``)."""
    with orbitkv_llm(model_dir, extra_config, block_size=block_size, **llm_kwargs) as llm:
        yield InProcessEngine(llm, block_size)
