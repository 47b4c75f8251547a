"""A request for prompt logprobs on a prompt with holes gets no holes (a bug found by the GPU check).

vLLM reads no cache for a request that asks for prompt logprobs (a loaded token has none):
``SamplingParams.skip_reading_prefix_cache`` makes the scheduler drop the connector's match after
``get_num_new_matched_tokens``. The scheduler half has planned the holes by then, and the hole
scheduler still jumps them, so the jumped positions get no prompt logprobs and vLLM hands out
whatever its buffers held: logprobs of other token ids, or ids the detokenizer cannot take (an
``OverflowError``; in the API server it ends the output-handler task that delivers every
request's outputs).

Found by ``orbitkv check gpu --device cpu`` (part ``server``, row ``holes_prompt_logprobs``).
Fixed in ``connector/scheduler/admission.py``: such a request is planned nothing, and the scheduler extension
caps none of its steps.
"""

from __future__ import annotations

import pytest
from connector_vllm_testlib import CHUNK, OFF, engine, flush, segment, summary, tokens

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def eng(tmp_path_factory):
    from orbitkv.models.make_model import make_model

    model_dir = make_model(tmp_path_factory.mktemp("model") / "qwen2", "qwen2")
    with engine(model_dir) as e:
        yield e


def _prompt_logprobs(eng, prompt: list[int], params: dict):
    from vllm import SamplingParams

    assert eng.llm.reset_prefix_cache()
    sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0,
                        extra_args={"kv_transfer_params": params})
    return eng.llm.generate([tokens(prompt)], sp, use_tqdm=False)[0]


def test_prompt_logprobs_request_gets_no_holes(eng):
    from orbitkv.store.keys import conditioned_key

    sys_, t1, c1, t2, c2 = (segment(1200 + i) for i in range(5))
    prompt = sys_ + t1 + c1 + t2 + c2 + segment(1299, 8)
    want = _prompt_logprobs(eng, prompt, OFF)
    eng.run(tokens(prompt), keep_prefix_cache=False)  # every chunk saved
    flush(eng)
    keys = [conditioned_key(c.cid, c.antecedent_hash) for c in eng.last_chunks]
    eng.sched_connector.store.delete([keys[1], keys[3]])  # t1 and t2 fresh: c1, c2 are holes
    assert summary(eng.run(tokens(prompt), {"orbitkv": {"save": False}}, keep_prefix_cache=False)[0])[
        "num_hole_tokens"] == 2 * CHUNK  # the setup makes holes

    got = _prompt_logprobs(eng, prompt, {"orbitkv": {"save": False}})
    assert summary(got).get("num_hole_tokens", 0) == 0
    for pos, (token, entry, ref) in enumerate(
            zip(prompt, got.prompt_logprobs, want.prompt_logprobs, strict=True)):
        if ref is None:
            assert entry is None
            continue
        assert token in entry, f"position {pos}: no logprob for the prompt token"
        assert entry[token].logprob == ref[token].logprob, f"position {pos}"
