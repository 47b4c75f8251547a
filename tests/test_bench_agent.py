"""``orbitkv bench agent``: summaries, ratios with their spread, the report; the whole bench, small, on
real vLLM (slow)."""

from __future__ import annotations

import json

import pytest
from orbitkv_bench import agent as bench_agent

from orbitkv.agent import arms
from orbitkv.agent import driver as drv
from orbitkv.agent import report as agent_report


def _summary(system, p50, p95, computed, modes=None, error=None):
    by_kind = {"slide": {
        "num_steps": 4, "computed_tokens": computed, "exact_floor_tokens": 250, "content_floor_tokens": 100,
        "computed_over_exact_floor": computed / 250, "computed_over_content_floor": computed / 100,
        "num_new_images": 4, "encoder_items_run": 4, "encoder_items_registered": None,
        "orbitkv_encoded_items": 3 if system == "orbitkv" else None,
    }}
    return {
        "system": system, "num_requests": 6, "ttft_p50_s": p50, "ttft_p95_s": p95, "ttft_mean_s": p50,
        "engine_ttft_p50_s": None, "prompt_tokens": 1200, "prefill_tokens_computed": computed,
        "apc_tokens": 0, "connector_tokens": 0, "reused_tokens_by_mode": modes or {}, "error": error,
        "by_kind": by_kind,
    }


def _records(ttfts, computed):
    """Step records of two episodes with the given per-step TTFTs and tokens computed."""
    return [drv.StepRecord(i % 2, "slide", "", [0], 100, c, 0, 0, None, t, None, t, "", episode=i // 2)
            for i, (t, c) in enumerate(zip(ttfts, computed, strict=True))]


def test_speedups_for_every_pair_with_their_spread():
    s = {
        "orbitkv": _summary("orbitkv", 0.5, 1.0, 300, {"apc_prefix": 400, "survivor": 500}),
        "apc": _summary("apc", 1.0, 2.0, 800, {"apc_prefix": 400}),
        "none": _summary("none", 2.0, 3.0, 1200),
    }
    r = arms.speedups(s)
    assert set(r) == {"orbitkv_vs_apc", "orbitkv_vs_none", "apc_vs_none"}
    assert r["orbitkv_vs_apc"] == {"ttft_p50": 2.0, "ttft_p95": 2.0, "prefill_tokens_computed": 800 / 300}
    assert r["apc_vs_none"]["ttft_p50"] == 2.0 and r["orbitkv_vs_none"]["prefill_tokens_computed"] == 4.0
    # Per episode: episode 0 APC/OrbitKV p50 = 2.0, episode 1 = 3.0.
    records = {"orbitkv": _records([1.0, 1.0, 1.0, 1.0], [10, 10, 10, 10]),
               "apc": _records([2.0, 2.0, 3.0, 3.0], [20, 20, 40, 40]),
               "none": _records([4.0, 4.0, 4.0, 4.0], [50, 50, 50, 50])}
    r = arms.speedups(s, records)["orbitkv_vs_apc"]
    assert r["ttft_p50_per_episode"] == [2.0, 3.0] and r["prefill_tokens_per_episode"] == [2.0, 4.0]
    assert r["ttft_p50_spread"]["min"] == 2.0 and r["ttft_p50_spread"]["max"] == 3.0 and r["ttft_p50_spread"]["n"] == 2
    # A system that failed takes no part in the ratios.
    s["orbitkv"]["error"] = "connector failed to import"
    assert set(arms.speedups(s)) == {"apc_vs_none"}


def test_report_names_every_field():
    from orbitkv.agent.fairness import start_step_check

    doc = {
        "config": {"model": "smolvlm-bench", "trace": "recurring", "window": 4, "steps": 14, "episodes": 3},
        "systems": {
            "orbitkv": {**_summary("orbitkv", 0.5, 1.0, 300, {"apc_prefix": 400, "exact": 64}),
                        "engine_queue_p50_s": 0.056},
            "apc": _summary("apc", 1.0, 2.0, 800, {"apc_prefix": 400}),
            "none": {"error": "boom", "num_requests": 0},
        },
        "fairness": {
            "binding_check": {"is_equal": True, "reason": None, "core_ids": {"orbitkv": [[0, 1]], "apc": [[0, 1]]}},
            "start_step": start_step_check({"orbitkv": [4.4], "apc": [9.4]}, {}),
            "identical_work": {"orbitkv": {"reference": "apc", "num_requests": 12, "engine_ttft_ratio": {
                "n": 12, "min": 0.9, "p25": 0.97, "median": 0.985, "p75": 1.01, "max": 1.05}}},
        },
        "speedup_withheld": None,
        "speedup": {"orbitkv_vs_apc": {"ttft_p50": 2.0, "ttft_p95": 2.0, "prefill_tokens_computed": 2.67,
                                       "ttft_p50_spread": {"n": 3, "min": 1.5, "max": 2.5}}},
        "floor": {
            "step": 5, "kind": "recall", "prompt_tokens": 400, "repeats": 3,
            "all_cached": {"ttft_s": 0.2, "computed_tokens": 12, "connector_tokens": 388, "reused_tokens_by_mode": {"exact": 388},
                           "engine_ttft_s": 0.12, "connector_seconds": {"fetch": 0.004, "layer_load": 0.01}},
            "prefix_cached": {"ttft_s": 0.16, "engine_ttft_s": 0.1, "computed_tokens": 12, "prefix_cache_tokens": 388},
            "all_cached_over_prefix_cached": 1.25,
            "new_tokens_only": {"ttft_s": 0.1, "prompt_tokens": 12},
            "full_prefill": {"ttft_s": 1.5, "computed_tokens": 400},
        },
    }
    text = agent_report.format_report(doc)
    assert "orbitkv" in text and "apc_prefix 400, exact 64" in text and "x2.00" in text
    assert "queued_p50_s" in text and "0.056" in text  # vLLM's own queue time per request
    assert "none             FAILED: boom" in text
    assert "[1.50..2.50, n=3]" in text  # the per-episode spread
    assert "exact    250 (x1.20)" in text and "content    100 (x3.00)" in text
    assert "encoder 4 [3] of 4 new" in text and "encoder 4 of 4 new" in text
    assert "orbitkv [[0, 1]], apc [[0, 1]]" in text and "FLAGGED" in text
    assert "same work as apc (12 requests" in text and "apc / orbitkv median x0.985 [p25 0.970, p75 1.010]" in text
    assert "all chunks cached" in text and "new tokens only" in text and "full prefill" in text
    assert "prefix cache:   ttft 0.160 s (all cached / this x1.25)" in text
    assert "OrbitKV layer_load 10.0 ms, fetch 4.0 ms" in text


def test_summaries_feed_the_json_fields():
    recs = [
        drv.StepRecord(i, "slide", "", [0], 100, c, a, k, m, t, None, t, "")
        for i, (c, a, k, m, t) in enumerate([(100, 0, 0, None, 1.0), (20, 32, 48, {"survivor": 48}, 0.3)])
    ]
    s = drv.summarize("orbitkv", recs).to_json()
    for key in ("ttft_p50_s", "ttft_p95_s", "prefill_tokens_computed", "reused_tokens_by_mode"):
        assert key in s
    assert s["prefill_tokens_computed"] == 120 and s["reused_tokens_by_mode"] == {"apc_prefix": 32, "survivor": 48}
    assert s["engine_queue_p50_s"] is None  # no request reported vLLM's queue time
    recs[0].engine_queue_s, recs[1].engine_queue_s = 0.0, 0.056
    s = drv.summarize("orbitkv", recs).to_json()
    assert s["engine_queue_p50_s"] == pytest.approx(0.028) and s["engine_queue_max_s"] == 0.056
    json.dumps(s)


def test_episodes_alternate_the_arms_order_so_each_leads_as_often():
    order = [[a.system for a in arms.episode_order([
        arms.Arm(n, None) for n in ("orbitkv", "apc", "none")], e)] for e in range(4)]
    assert order[0] == ["orbitkv", "apc", "none"] and order[1] == ["none", "apc", "orbitkv"]
    assert order[2] == order[0] and order[3] == order[1]
    for name in ("orbitkv", "apc", "none"):  # over a pair of episodes, every arm's mean position is the same
        assert sum(o.index(name) for o in order) == 4


@pytest.mark.slow
@pytest.mark.vllm
def test_bench_agent_interleaved_and_fair(tmp_path, capsys):
    """The whole bench, small: tiny model, the recurring trace at its smallest, two episodes, all
    four servers up at once and the episodes alternating between them."""
    argv = ["--json", "--size", "tiny", "--window", "3", "--steps", "10", "--episodes", "2",
            "--workdir", str(tmp_path), "--out", str(tmp_path / "bench.json")]
    rc = bench_agent.main(argv)
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert json.loads(capsys.readouterr().out) == doc
    check = doc["fairness"]["binding_check"]
    assert check["is_equal"] and doc["speedup_withheld"] is None, check
    cores = {json.dumps(c) for c in check["core_ids"].values()}
    assert len(cores) == 1 and doc["config"]["binding_env"]["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    for name in ("apc", "none"):
        s = doc["systems"][name]
        assert s["error"] is None and s["num_requests"] == 20
        assert s["ttft_p50_s"] > 0 and s["ttft_p95_s"] >= s["ttft_p50_s"]
    steps = doc["steps"]
    # All servers up first, then the episodes alternated: each arm's episode e ran as a whole,
    # after every arm's episode e - 1, the arms' order reversed on the second episode.
    spans = {(name, e): [r["sent_at_unix_s"] for r in rs if r["episode"] == e] for name, rs in steps.items()
             for e in (0, 1)}
    order = sorted(spans, key=lambda k: min(spans[k]))
    assert [e for _, e in order] == [0] * len(steps) + [1] * len(steps)
    assert [n for n, _ in order[: len(steps)]] == [n for n, _ in order[len(steps) :]][::-1]
    for a, b in zip(order, order[1:], strict=False):
        assert max(spans[a]) < min(spans[b])
    for r in steps["none"]:
        assert r["computed_tokens"] == r["prompt_tokens"]
        assert r["exact_floor_tokens"] >= r["content_floor_tokens"] >= 1
        assert r["encoder_items_run"] is not None
    for r in steps["apc"]:
        if r["kind"] == "reorder":
            assert r["encoder_items_run"] == 0  # vLLM's own encoder cache still holds the images
    first = steps["none"][0]
    assert first["exact_floor_tokens"] == first["content_floor_tokens"] == first["prompt_tokens"]
    assert doc["systems"]["apc"]["prefill_tokens_computed"] < doc["systems"]["none"]["prefill_tokens_computed"]
    assert doc["speedup"]["apc_vs_none"]["ttft_p50_spread"]["n"] == 2
    for name in ("orbitkv", "orbitkv_patched"):
        orbit = doc["systems"][name]
        assert orbit["error"] is None, (name, orbit["error"])
        assert orbit["num_requests"] == 20 and orbit["reused_tokens_by_mode"], name
    assert rc == 0 and "orbitkv_vs_apc" in doc["speedup"]
    assert doc["floor"]["all_cached"]["ttft_s"] > 0 and doc["floor"]["new_tokens_only"]["ttft_s"] > 0
    # The replay loaded its chunks (the connector's time is there), then vLLM's prefix cache held them.
    assert doc["floor"]["all_cached"]["connector_seconds"]["layer_load"] > 0
    assert doc["floor"]["prefix_cached"]["prefix_cache_tokens"] >= doc["floor"]["all_cached"]["connector_tokens"]
