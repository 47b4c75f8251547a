"""Helpers for the connector's real-vLLM tests: an in-process engine whose paged cache can be read.

The engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so a test reaches both connector
halves and reads vLLM's paged cache back through the connector's own gather. Reference runs use
the same engine with the connector off per request (``OFF``): same weights and kernels, no reuse.

Weights are ``make_model``'s seeded safetensors (``load_format="auto"``): with vLLM's ``dummy``
weights every prompt decodes the same token at a flat logprob, so equal outputs would prove
nothing. ``run`` asks for top-2 logprobs, and ``assert_informative`` checks a reference output is
not degenerate before a test compares others with it.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

BLOCK = 32
CHUNK = 32
OFF = {"orbitkv": {"load": False, "save": False}}


class Engine:
    def __init__(self, llm) -> None:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        self.llm = llm
        self.worker = get_kv_transfer_group().worker
        self.sched_connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
        self.block_ids: dict[str, list[int]] = {}
        self.chunks: dict[str, list] = {}
        self.num_references = 0
        inner = self.sched_connector.request_finished

        def record(request, block_ids):
            self.block_ids[request.request_id] = list(block_ids)
            state = self.sched_connector.scheduler._reqs.get(request.request_id)
            self.chunks[request.request_id] = list(state.chunks) if state is not None else []
            return inner(request, block_ids)

        # Test-only spy: a finished request's blocks keep their KV until another request is
        # given them, so the cache can be read back right after generate().
        self.sched_connector.request_finished = record

    def run(
        self,
        request: dict,
        params: dict | None = None,
        max_tokens: int = 32,
        keep_prefix_cache: bool = True,
        **sampling: object,
    ):
        """Generate greedily for one request; returns (RequestOutput, its block ids).

        vLLM's own prefix cache is kept across requests, as a server keeps it; a test about what
        the connector serves, which a local prefix hit would otherwise take over, passes
        ``keep_prefix_cache=False`` (the cache is emptied first). A
        reference run (``params=OFF``) gets a cache_salt of its own: it neither reads a block
        another request computed or loaded, nor lets one read its blocks, so it is a full prefill
        whatever the cache holds. ``sampling``: more ``SamplingParams`` (``prompt_logprobs``) or
        ``lora_request``.
        """
        from vllm import SamplingParams

        if not keep_prefix_cache:
            assert self.llm.reset_prefix_cache()
        if params == OFF:
            self.num_references += 1
            request = {**request, "cache_salt": f"reference-{self.num_references}"}
        lora_request = sampling.pop("lora_request", None)
        extra = {"kv_transfer_params": params} if params is not None else None
        sp = SamplingParams(
            max_tokens=max_tokens, temperature=0.0, logprobs=2, extra_args=extra, **sampling
        )
        before = set(self.block_ids)
        out = self.llm.generate([request], sp, use_tqdm=False, lora_request=lora_request)[0]
        (req_id,) = set(self.block_ids) - before
        self.last_chunks = self.chunks[req_id]
        return out, self.block_ids[req_id]

    @property
    def core(self):
        return self.llm.llm_engine.engine_core.engine_core

    @property
    def model_runner(self):
        return self.core.model_executor.driver_worker.worker.model_runner

    def kv(self, block_ids: list[int], begin: int, end: int, layer: int):
        """K and V ``[N, H, D]`` of token positions [begin, end) of a finished request."""
        from orbitkv.connector.metadata import slots_for
        from orbitkv.kernels.paged import gather_chunk

        name = next(n for n, i in self.worker._layer_index.items() if i == layer)
        slots = torch.tensor(slots_for(block_ids, BLOCK, begin, end), dtype=torch.int64)
        k, v = gather_chunk(self.worker._caches[name], slots, self.worker._layout)
        return k.clone(), v.clone()

    def kv_layers(self, block_ids: list[int], begin: int, end: int):
        """``kv`` for every layer, in order."""
        return [self.kv(block_ids, begin, end, layer) for layer in sorted(self.worker._layer_index.values())]

    def poison(self, block_ids: list[int]) -> None:
        """Overwrite blocks in every layer, so later reads cannot see stale but correct KV."""
        assert self.llm.reset_prefix_cache()  # no later request may hit a poisoned block
        # What vLLM runs before a step writes the cache: the last step's save copy is done.
        self.worker.before_step()
        for cache in self.worker._caches.values():
            cache[block_ids] = 7.0


@contextmanager
def engine(model_dir, extra_config=None, module_path="orbitkv.connector", **llm_kwargs):
    """One in-process vLLM engine with the OrbitKV connector (``orbitkv.checks.engine``), torn
    down completely on exit, at the tests' chunk and block size.

    ``extra_config`` adds to the connector's ``kv_connector_extra_config``; ``module_path=None``
    loads the connector by name only, through the ``vllm.general_plugins`` entry point. The
    scheduler is OrbitKV's extension (holes), as ``orbitkv serve`` runs it, unless ``llm_kwargs``
    name another ``scheduler_cls``.
    """
    from orbitkv.checks.engine import orbitkv_llm

    extra = {
        "chunk_size": CHUNK,
        "max_local_cpu_size": 0.25,
        # The tests build prompts from CHUNK-token segments and check reuse chunk by chunk.
        "orbitkv_text_chunking": "fixed",
        # Requests that send OPT_IN receive approximate KV; these tests check the mechanism (bits,
        # lineage), not answers, so the modes need no calibration here.
        "orbitkv_approximate_reuse": "request",
        "orbitkv_require_calibration": False,
        **(extra_config or {}),
    }
    kwargs = dict(max_model_len=1024, block_size=BLOCK, max_num_seqs=2, max_num_batched_tokens=1024)
    kwargs.update(llm_kwargs)
    with orbitkv_llm(model_dir, extra, module_path=module_path, **kwargs) as llm:
        yield Engine(llm)


class StoreWithout:
    """The worker's store with some entries gone after the scheduler planned them (evicted
    between planning and loading): ``get`` answers a miss for ``gone`` keys."""

    def __init__(self, store, gone: set[str]) -> None:
        self._store = store
        self._gone = gone

    def get(self, keys, **kwargs):
        got = self._store.get(keys, **kwargs)
        return [None if k in self._gone else e for k, e in zip(keys, got, strict=True)]

    def __getattr__(self, name):
        return getattr(self._store, name)


# kv_transfer_params of a request that opts in to approximate KV.
OPT_IN = {"orbitkv": {"approximate": True}}


def segment(seed: int, n: int = CHUNK) -> list[int]:
    """``n`` random token ids, a function of ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 1000, (n,), generator=g).tolist()


def tokens(ids: list[int], **extra) -> dict:
    """A token-id prompt for ``LLM.generate``."""
    return {"prompt_token_ids": ids, **extra}


def flush(eng: Engine) -> None:
    """Wait until every queued save reached every tier (disk, Redis)."""
    eng.sched_connector.writer.flush()
    assert eng.sched_connector.store.flush(60.0)


def assert_informative(out, vocab_size: int = 1024) -> None:
    """A greedy output worth comparing against: several distinct tokens, each chosen well above
    a flat distribution (vLLM's dummy weights give one token at logprob ~ -log(vocab))."""
    import math

    completion = out.outputs[0]
    assert completion.logprobs, "run the reference with logprobs (Engine.run does)"
    chosen = [lp[tok].logprob for lp, tok in zip(completion.logprobs, completion.token_ids, strict=True)]
    flat = -math.log(vocab_size)
    assert len(set(completion.token_ids)) >= min(2, len(completion.token_ids)), completion.token_ids
    assert min(chosen) > flat + 1.0, f"top-1 logprobs {chosen} are near flat ({flat:.2f})"


def summary(out) -> dict:
    return (out.kv_transfer_params or {}).get("orbitkv", {})


def bf16_ulp(mag: torch.Tensor) -> torch.Tensor:
    """One bf16 ULP at magnitude ``mag`` (8 significant bits)."""
    mag = mag.float().abs().clamp_min(torch.finfo(torch.bfloat16).tiny)
    return torch.exp2(torch.floor(torch.log2(mag)) - 7)


def pair_magnitude(k: torch.Tensor) -> torch.Tensor:
    """|(k_i, k_{i+D/2})| for each feature: the scale a neox rotation works at."""
    half = k.shape[-1] // 2
    x, y = k.float()[..., :half], k.float()[..., half:]
    mag = torch.sqrt(x * x + y * y)
    return torch.cat([mag, mag], dim=-1)


def assert_within_ulps(got, want, num_ulps: int, scale: torch.Tensor) -> None:
    diff = (got.float() - want.float()).abs()
    bound = num_ulps * bf16_ulp(scale)
    worst = (diff / bound).max().item()
    assert bool((diff <= bound).all()), f"max error {worst:.2f} x {num_ulps} ULP"


def assert_loaded_as_relocated(eng: Engine, got, stored, delta: int) -> None:
    """Every layer of a relocate-only load (exact at another position, survivor) is the stored KV
    moved by ``delta``: K rotated in fp32 and rounded once, V as stored, bit for bit."""
    from orbitkv.kernels.relocate import relocate

    spec = eng.worker._identity.rope
    assert len(got) == len(stored) == eng.worker._identity.num_layers
    for layer, ((k_got, v_got), (k_stored, v_stored)) in enumerate(zip(got, stored, strict=True)):
        assert torch.equal(v_got, v_stored), f"layer {layer}: V differs from the stored entry"
        assert torch.equal(k_got, relocate(k_stored, delta, spec)), f"layer {layer}: K"


def assert_relocated_like_prefill(k_got, k_want, v_got, v_want) -> None:
    """Layer 0's K and V depend on the token and its position only, so a relocated chunk must
    reproduce a full prefill up to rounding. A rotation mixes each neox pair, so its rounding error
    scales with the pair's magnitude, not with the (possibly tiny) single element."""
    assert_within_ulps(k_got, k_want, 2, pair_magnitude(k_want))
    assert torch.equal(v_got, v_want)
