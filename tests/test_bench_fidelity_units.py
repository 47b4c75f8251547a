"""``bench fidelity``'s pure parts: the trace generator, the KL / agreement metrics, the arms'
configs and requests, and the calibration table."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
from orbitkv_bench import fidelity_arms as fa
from orbitkv_bench import fidelity_metrics as fm

from orbitkv.agent.doc_trace import OPERATIONS, make_episode, make_trace, user_text
from orbitkv.config import OrbitKVConfig


def test_trace_operations_move_the_window_as_named():
    ep = make_episode(seed=3, episode=0, window=4, num_steps=21)
    assert ep.steps[0].op == "start" and len(ep.steps) == 21
    assert [s.op for s in ep.steps[1:6]] == list(OPERATIONS)
    for prev, step in zip(ep.steps, ep.steps[1:], strict=False):
        assert len(step.window) == 4 and len(set(step.window)) == 4
        if step.op == "slide":
            assert step.window[:3] == prev.window[1:] and step.new_records == (step.window[3],)
        elif step.op == "reorder":
            assert step.window == (prev.window[1], prev.window[2], prev.window[0], prev.window[3])
        elif step.op == "revisit":
            assert step.window == ep.steps[step.index - 2].window
        elif step.op == "recall":
            back = step.window[-1]
            assert back not in prev.window and any(back in s.window for s in ep.steps[: step.index])
            assert step.new_records == ()
        q = step.question
        assert q.record in step.window
        record = ep.records[q.record]
        assert q.answer == (record.code if q.hops == 1 else record.colour)
        assert (record.name in q.text) if q.hops == 1 else (record.city in q.text)


def test_trace_facts_are_unique_and_records_one_line():
    ep = make_episode(seed=1, episode=2, num_steps=31)
    for field in ("name", "city", "code"):
        values = [getattr(r, field) for r in ep.records]
        if field == "name":
            values = [v.split()[0] for v in values]
        assert len(values) == len(set(values)), field
    for r in ep.records:
        assert r.text.endswith("\n") and r.text.count("\n") == 1
        assert r.city in r.text and r.code in r.text and r.colour in r.text
    # Deterministic per (seed, episode); episodes differ.
    assert make_episode(seed=1, episode=2, num_steps=31).records == ep.records
    assert make_trace(1, 2)[0].records != make_trace(1, 2)[1].records


def test_user_text_spans_are_the_records():
    ep = make_episode(seed=0, episode=0)
    step = ep.steps[2]
    text, spans = user_text(ep.records, step)
    assert [text[a:b] for a, b in spans] == [ep.records[r].text for r in step.window]
    assert text.endswith("Answer in a few words.") and step.question.text in text


def test_kl_against_an_independent_computation():
    ref = {"a": math.log(0.6), "b": math.log(0.3)}
    arm = {"a": math.log(0.2), "c": math.log(0.7)}
    # Union {a, b, c}; b missing from arm -> arm's floor log(0.2); c missing from ref -> log(0.3).
    p = [0.6, 0.3, 0.3]
    q = [0.2, 0.2, 0.7]
    p = [x / sum(p) for x in p]
    q = [x / sum(q) for x in q]
    expected = sum(pi * math.log(pi / qi) for pi, qi in zip(p, q, strict=True))
    assert fm.first_token_kl(ref, arm) == pytest.approx(expected)
    assert fm.first_token_kl(ref, ref) == pytest.approx(0.0, abs=1e-12)
    assert fm.first_token_kl({}, arm) is None


def test_correctness_is_a_whole_word_match():
    assert fm.is_correct("The code is 315.", "315")
    assert not fm.is_correct("The code is 3150.", "315")
    assert fm.is_correct("It is Green", "green")
    assert not fm.is_correct("evergreen", "green")


def _row(arm, op, hops, same, kl, computed, ref_computed=100, correct=True, mode=None):
    step = SimpleNamespace(episode=0, index=1, op=op, question=SimpleNamespace(hops=hops))
    ref = {
        "answer": "x",
        "first": {"t": -0.1, "u": -2.5},
        "computed_tokens": ref_computed,
        "ttft_s": 0.2,
    }
    mode = mode or arm.split("_")[0]
    out = {
        "answer": "x" if same else "y",
        "first": {"t": -0.1 - kl, "u": -2.0} if kl else ref["first"],
        "computed_tokens": computed,
        "ttft_s": 0.1,
        "by_mode": {mode: ref_computed - computed} if ref_computed > computed else {},
    }
    return fm.compare(arm, step, "x" if correct else "z", ref, out, mode=mode)


def test_summary_and_calibration_rows():
    rows = [_row("survivor", "slide", 1, True, 0, 40) for _ in range(18)]
    rows += [
        _row("survivor", "reorder", 2, False, 0.5, 60),
        _row("survivor", "reorder", 2, True, 0, 60),
    ]
    rows += [_row("patched_r8", "revisit", 1, True, 0, 10) for _ in range(4)]
    rows += [_row("exact", "slide", 1, True, 0, 100)]
    # Blind served one question, answered it differently, and computed the other nine whole.
    rows += [_row("blind", "slide", 1, True, 0, 100) for _ in range(9)] + [
        _row("blind", "recall", 1, False, 1, 5)
    ]
    res = fm.frontier(rows)
    s = res["survivor"]["all"]
    assert s["num_questions"] == 20 and s["agreement"] == 0.95 and s["agreement_two_hop"] == 0.5
    assert s["tokens_computed_ratio"] == pytest.approx((18 * 40 + 120) / 2000, abs=1e-4)
    assert res["survivor"]["by_op"]["reorder"]["agreement"] == 0.5
    assert s["reused_tokens_by_mode"] == {"survivor": 18 * 60 + 80}
    assert s["num_served"] == 20 and s["agreement_served"] == 0.95
    b = res["blind"]["all"]
    assert b["agreement"] == 0.9 and b["num_served"] == 1 and b["agreement_served"] == 0.0
    assert s["accuracy"] == 0.95 and s["reference_accuracy"] == 1.0  # one answer differs: "y"
    arms = {
        "survivor": {"mode": "survivor", "patch_rank": 0},
        "patched_r8": {"mode": "patched", "patch_rank": 8},
        "exact": {"mode": "exact", "patch_rank": 0},
        "blind": {"mode": "blind", "patch_rank": 0},
    }
    table = fm.calibration_table(arms, res, model_fingerprint="ab12", model="/m")
    assert table["format"] == "orbitkv-calibration-v1" and table["model_fingerprint"] == "ab12"
    assert table["budget"] == {
        "min_agreement": 0.95,
        "min_agreement_two_hop": 0.90,
        "min_served_questions": 10,
    }
    by_mode = {(r["mode"], r.get("patch_rank")): r for r in table["rows"]}
    assert set(by_mode) == {("survivor", None), ("patched", 8), ("blind", None)}  # exact: no row
    # 90% over all questions but 0% where it served: outside the budget.
    assert by_mode[("blind", None)]["is_within_budget"] is False
    assert by_mode[("survivor", None)]["is_within_budget"] is False  # two-hop 0.5 < 0.90
    assert by_mode[("patched", 8)]["num_questions"] == 4
    # All four agree, but four questions are too few to calibrate a mode on ...
    assert by_mode[("patched", 8)]["is_within_budget"] is False
    # ... and enough: within.
    rows += [_row("patched_r8", "revisit", 2, True, 0, 10) for _ in range(6)]
    table = fm.calibration_table(arms, fm.frontier(rows), model_fingerprint="ab12", model="/m")
    assert [r["is_within_budget"] for r in table["rows"] if r["mode"] == "patched"] == [True]


def test_arm_configs_load_and_requests_opt_in(tmp_path: Path):
    arms = fa.arm_specs([8, 32], ["exact", "survivor", "transfer", "blind", "patched", "orbit"])
    assert [a.name for a in arms] == [
        "exact",
        "survivor",
        "transfer",
        "blind",
        "patched_r8",
        "patched_r32",
        "orbit",
    ]
    assert [a.server for a in arms] == ["base"] * 4 + ["r8", "r32", "base"]
    configs = {
        s: OrbitKVConfig.from_kv_connector_extra_config(
            fa.arm_config(s, arms, tmp_path / s, [1, 2])
        )
        for s in ("base", "r8", "r32")
    }
    # Orbit on the base server at the largest rank, its conditioned entries kept.
    assert configs["base"].patch_rank == 32 and not configs["base"].patch_replaces_conditioned
    assert configs["base"].enable_blind and configs["base"].enable_survivor
    assert (
        configs["base"].transfer_modalities == ("text",)
        and configs["base"].text_chunking == "fixed"
    )
    assert configs["r8"].patch_rank == 8 and configs["r8"].patch_replaces_conditioned
    assert configs["r32"].patch_rank == 32 and configs["r32"].patch_replaces_conditioned
    # A rank-32 fp32 patch of the shortest record (69 tokens) of a KV-192-wide model, over the
    # record's bf16 KV: formed, not refused for its bytes (nothing would be measured).
    fraction = 32 * (69 + 192) * 4 / (69 * 192 * 2)
    assert (
        fraction < configs["r32"].patch_max_bytes_fraction
        and fraction < configs["base"].patch_max_bytes_fraction
    )
    exact = arms[0].request_options([5, 9])["orbitkv"]
    assert exact == {"modes": ["exact"], "chunk_boundaries": [5, 9]}
    patched = arms[4].request_options([5])["orbitkv"]
    assert (
        patched["approximate"] is True
        and patched["modes"] == ["exact", "patched"]
        and patched["patch_rank"] == 8
    )


def test_recompute_and_apc_arms(tmp_path: Path):
    arms = fa.arm_specs([32], ["exact", "recompute", "apc"], [0.05, 0.15, 0.3])
    assert [(a.name, a.server) for a in arms] == [
        ("exact", "base"), ("recompute_5", "base"), ("recompute_15", "base"),
        ("recompute_30", "base"), ("apc", "apc"),
    ]
    config = OrbitKVConfig.from_kv_connector_extra_config(
        fa.arm_config("base", arms, tmp_path / "base", [1, 2])
    )
    assert config.enable_recompute and config.approximate_reuse == "request"
    assert not config.require_calibration and config.min_hole_tokens > 0
    opts = arms[2].request_options([5])["orbitkv"]
    assert opts["approximate"] is True and opts["modes"] == ["exact", "recompute"]
    assert opts["recompute_fraction"] == 0.15 and arms[2].is_registering
    # vLLM's prefix cache alone: no OrbitKV options at all.
    assert arms[4].request_options([5]) is None and not arms[4].is_registering
    # The calibration row names the fraction it was measured at; apc is not a calibrated mode.
    specs = {a.name: {"mode": a.mode, "patch_rank": a.patch_rank,
                      "recompute_fraction": a.recompute_fraction} for a in arms}
    summary = {"num_questions": 20, "num_served": 12, "agreement": 0.96, "agreement_two_hop": 1.0,
               "agreement_served": 0.95, "agreement_two_hop_served": 1.0, "top1_agreement": 1.0,
               "kl_mean": 0.001, "tokens_computed_ratio": 0.5}
    results = {name: {"all": summary} for name in specs}
    table = fm.calibration_table(specs, results, model_fingerprint="f" * 32, model="m")
    assert [(r["mode"], r.get("recompute_fraction")) for r in table["rows"]] == [
        ("recompute", 0.05), ("recompute", 0.15), ("recompute", 0.3)
    ]


def test_boundaries_and_fingerprint_line():
    assert fa.boundaries_at([0, 3, 7, 9], 4, [3, 9, 0]) == [1, 3]
    with pytest.raises(ValueError, match="inside a token"):
        fa.boundaries_at([0, 3, 7], 3, [4])
    text = '# HELP x\nvllm:orbitkv_model_info{model_fingerprint="0a1b2c"} 1\n'
    assert fa.fingerprint_from_metrics(text) == "0a1b2c"
    assert fa.fingerprint_from_metrics("vllm:other 1\n") is None


def test_chat_result_keeps_the_first_tokens_top_logprobs():
    from orbitkv.serving.http_client import _result_from_full

    data = {
        "choices": [
            {
                "message": {"content": "Paris"},
                "logprobs": {
                    "content": [
                        {
                            "token": "Paris",
                            "logprob": -0.1,
                            "top_logprobs": [
                                {"token": "Paris", "logprob": -0.1},
                                {"token": "Lyon", "logprob": -2.5},
                            ],
                        },
                        {
                            "token": ".",
                            "logprob": -0.2,
                            "top_logprobs": [{"token": ".", "logprob": -0.2}],
                        },
                    ]
                },
            }
        ]
    }
    result = _result_from_full(data, 0.5)
    assert result.first_top_logprobs == {"Paris": -0.1, "Lyon": -2.5}
    assert (
        _result_from_full({"choices": [{"message": {"content": "x"}}]}, 0.5).first_top_logprobs
        is None
    )


def test_runs_merge_their_questions_and_refuse_another_model():
    from orbitkv_bench.fidelity_report import merged, recomputed

    def doc(seed, fingerprint="ab", same=True):
        row = _row("survivor", "slide", 1, same, 0, 40).to_json()
        config = {
            "model_fingerprint": fingerprint,
            "max_tokens": 16,
            "window": 4,
            "seed": seed,
            "episodes": 1,
            "steps_per_episode": 2,
        }
        return {
            "config": config,
            "arms": {"survivor": {"mode": "survivor", "patch_rank": 0}},
            "steps": [{"op": "slide", "arms": {"survivor": row}}],
        }

    both = merged([doc(0), doc(1, same=False)])
    assert both["config"]["episodes"] == 2 and len(both["steps"]) == 2
    assert recomputed(both)["survivor"]["all"]["agreement"] == 0.5
    with pytest.raises(ValueError, match="model_fingerprint"):
        merged([doc(0), doc(1, fingerprint="cd")])
    # A merged document merges again with a run that adds episodes: every run is kept.
    later = doc(1)
    later["config"]["first_episode"] = 1
    three = merged([both, later])
    assert [(r["seed"], r["first_episode"]) for r in three["config"]["runs"]] == [(0, 0), (1, 0), (1, 1)]
    assert three["config"]["episodes"] == 3 and len(three["steps"]) == 3


def test_a_trace_from_a_later_episode_extends_an_earlier_one():
    from orbitkv.agent.doc_trace import make_trace

    whole = make_trace(5, 3, num_steps=4)
    tail = make_trace(5, 2, num_steps=4, first_episode=1)
    assert [e.index for e in tail] == [1, 2]
    assert [s.question for e in tail for s in e.steps] == [s.question for e in whole[1:] for s in e.steps]


def test_runs_of_other_arms_join_on_the_questions_they_share():
    from orbitkv_bench.fidelity_report import joined, recomputed

    def step(index, arm, same, reference="ref", question="q"):
        row = {**_row(arm, "slide", 1, same, 0, 40).to_json(), "reference_answer": reference}
        return {"episode": 0, "index": index, "op": "slide", "question": {"text": question},
                "arms": {"exact": {**row, "arm": "exact", "is_same_answer": True}, arm: row}}

    def doc(arm, steps, fingerprint="ab"):
        config = {"model_fingerprint": fingerprint, "max_tokens": 16, "window": 4}
        return {"config": config, "arms": {"exact": {"mode": "exact", "patch_rank": 0},
                                           arm: {"mode": arm, "patch_rank": 0}}, "steps": steps}

    old = doc("survivor", [step(1, "survivor", True), step(2, "survivor", False)])
    # The new run asked step 1 and another question: only step 1 is joined; its exact control
    # is the first run's, and another directory's fingerprint of the same model does not matter.
    new = doc("recompute", [step(1, "recompute", False), step(3, "recompute", True)], "cd")
    both = joined([old, new])
    assert [s["index"] for s in both["steps"]] == [1]
    assert set(both["steps"][0]["arms"]) == {"exact", "survivor", "recompute"}
    results = recomputed(both)
    assert results["survivor"]["all"]["agreement"] == 1.0
    assert results["recompute"]["all"]["agreement"] == 0.0
    # A reference that answered otherwise: the arms were not measured against one reference.
    other = doc("recompute", [step(1, "recompute", False, reference="other")])
    with pytest.raises(ValueError, match="differently"):
        joined([old, other])


def test_recompute_criteria_deficit_and_shares():
    import torch
    from orbitkv.kernels.relocate import relocate_ref
    from orbitkv.kernels.rope import RopeSpec
    from orbitkv_bench.recompute_criteria import deficit, share, top

    spec = RopeSpec("neox", 8, 8, tuple(10000.0 ** (-2 * i / 8) for i in range(4)))
    g = torch.Generator().manual_seed(0)
    num_anchor, n, begin = 2, 5, 7
    canon = [(torch.randn(num_anchor + n, 2, 8, generator=g), torch.randn(num_anchor + n, 2, 8, generator=g))
             for _ in range(3)]
    # A context whose KV is the canonical relocated exactly: nothing lost.
    full = []
    for k, v in canon:
        kf, vf = torch.zeros(begin + n, 2, 8), torch.zeros(begin + n, 2, 8)
        kf[begin:] = relocate_ref(k[num_anchor:], begin - num_anchor, spec)
        vf[begin:] = v[num_anchor:]
        full.append((kf, vf))
    assert torch.allclose(deficit(full, canon, begin, num_anchor, spec), torch.zeros(n), atol=1e-9)
    # Token 3's V moved by 1 in one feature on one layer: its deficit is 1, the others' 0.
    full[1][1][begin + 3, 0, 0] += 1.0
    got = deficit(full, canon, begin, num_anchor, spec)
    assert torch.allclose(got, torch.tensor([0.0, 0, 0, 1, 0]), atol=1e-6)
    assert top(got, 1) == [3] and share(got, [3]) == pytest.approx(1.0)
    assert share(torch.zeros(3), [0]) == 0.0
