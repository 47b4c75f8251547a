"""The connector under vLLM's default process layout on the CPU.

With ``VLLM_ENABLE_V1_MULTIPROCESSING=1`` (the default) the engine core runs in a child process and
the CPU platform switches to the multiprocess executor, so the worker half runs in yet another
process: the scheduler half sees the worker's memory tier only through the worker's reports, and
the exactness boundary (lineage hashes, the scheduler's guard) runs in the engine-core process.
"""

from __future__ import annotations

import gc

import pytest
import torch
from connector_vllm_testlib import BLOCK, CHUNK, OFF, assert_informative, summary

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    from orbitkv.models.make_model import make_model
    from orbitkv.serving.server_process import SCHEDULER_CLS

    model_dir = make_model(tmp_path_factory.mktemp("model") / "qwen2", "qwen2")
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    mp.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    # By name only: the engine-core and worker processes each load the plugin entry point.
    ktc = KVTransferConfig(
        kv_connector="OrbitKVConnector",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={
            "chunk_size": CHUNK, "max_local_cpu_size": 0.25, "orbitkv_text_chunking": "fixed",
            "orbitkv_approximate_reuse": "request", "orbitkv_require_calibration": False,
        },
    )
    engine = LLM(
        model=str(model_dir),
        load_format="auto",  # seeded weights: outputs are compared
        dtype="bfloat16",
        max_model_len=1024,
        block_size=BLOCK,
        enforce_eager=True,
        max_num_seqs=2,
        kv_transfer_config=ktc,
        scheduler_cls=SCHEDULER_CLS,
    )
    yield engine
    engine.llm_engine.engine_core.shutdown()
    del engine
    gc.collect()
    mp.undo()


def _run(llm, ids, params=None, *, cache_salt=None, is_fresh=True):
    from vllm import SamplingParams

    if is_fresh:
        assert llm.reset_prefix_cache()  # what is served must come from the connector
    extra = {"kv_transfer_params": params} if params is not None else None
    sp = SamplingParams(max_tokens=16, temperature=0.0, logprobs=2, extra_args=extra)
    prompt = {"prompt_token_ids": ids, **({"cache_salt": cache_salt} if cache_salt else {})}
    return llm.generate([prompt], sp, use_tqdm=False)[0]


def _segment(seed: int, n: int = CHUNK) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 1000, (n,), generator=g).tolist()


def test_reuse_across_processes(llm):
    sys_, c1, c2, c3 = (_segment(500 + i) for i in range(4))
    q1, q2 = _segment(598, 8), _segment(599, 8)
    first_prompt = sys_ + c1 + c2 + q1
    ref = _run(llm, first_prompt, OFF)
    assert_informative(ref)
    first = _run(llm, first_prompt)
    again = _run(llm, first_prompt)
    assert summary(again)["reused_tokens_by_mode"] == {"exact": len(first_prompt) - 1}
    assert ref.outputs[0].token_ids == first.outputs[0].token_ids == again.outputs[0].token_ids
    # Survivors: approximate, so only for a request that opts in (here in its own salted session).
    _run(llm, first_prompt, cache_salt="agent")
    slid_prompt = sys_ + c2 + c3 + q2
    slid = _run(llm, slid_prompt, {"orbitkv": {"approximate": True}}, cache_salt="agent")
    assert summary(slid)["reused_tokens_by_mode"] == {"exact": CHUNK, "survivor": CHUNK}
    assert summary(slid)["approximate_from"] == CHUNK
    assert slid.num_cached_tokens == 2 * CHUNK
    # The same prompt, exact-only, right after (vLLM's cache kept): the slid request's
    # approximate blocks are not found; its answer is a full prefill's.
    ref = _run(llm, slid_prompt, OFF, cache_salt="reference")
    exact = _run(llm, slid_prompt, {"orbitkv": {"modes": ["exact"]}}, cache_salt="agent", is_fresh=False)
    assert summary(exact)["num_approximate_tokens"] == 0
    assert exact.num_cached_tokens == CHUNK  # sys: vLLM's own exact block
    assert exact.outputs[0].token_ids == ref.outputs[0].token_ids
