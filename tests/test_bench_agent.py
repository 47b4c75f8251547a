"""``orbitkv bench agent``: summaries, speedups, the report; the full bench (slow) on real vLLM."""

from __future__ import annotations

import json

import pytest

from orbitkv.agent import driver as drv
from orbitkv.bench import agent as bench_agent


def _summary(system, p50, p95, computed, modes=None, error=None):
    return {
        "system": system, "num_requests": 6, "ttft_p50_s": p50, "ttft_p95_s": p95, "ttft_mean_s": p50,
        "engine_ttft_p50_s": None, "prompt_tokens": 1200, "prefill_tokens_computed": computed,
        "apc_tokens": 0, "connector_tokens": 0, "reused_tokens_by_mode": modes or {}, "error": error,
    }  # fmt: skip


def test_speedups_for_every_pair():
    s = {
        "orbitkv": _summary("orbitkv", 0.5, 1.0, 300, {"apc_prefix": 400, "survivor": 500}),
        "apc": _summary("apc", 1.0, 2.0, 800, {"apc_prefix": 400}),
        "none": _summary("none", 2.0, 3.0, 1200),
    }
    r = bench_agent.speedups(s)
    assert set(r) == {"orbitkv_vs_apc", "orbitkv_vs_none", "apc_vs_none"}
    assert r["orbitkv_vs_apc"] == {"ttft_p50": 2.0, "ttft_p95": 2.0, "prefill_tokens_computed": 800 / 300}
    assert r["apc_vs_none"]["ttft_p50"] == 2.0 and r["orbitkv_vs_none"]["prefill_tokens_computed"] == 4.0
    # A system that failed takes no part in the ratios.
    s["orbitkv"]["error"] = "connector failed to import"
    assert set(bench_agent.speedups(s)) == {"apc_vs_none"}


def test_report_names_every_field():
    doc = {
        "config": {"model": "smolvlm-bench", "window": 3, "steps": 6, "episodes": 1},
        "systems": {
            "orbitkv": _summary("orbitkv", 0.5, 1.0, 300, {"apc_prefix": 400, "exact": 64}),
            "apc": _summary("apc", 1.0, 2.0, 800, {"apc_prefix": 400}),
            "none": {"error": "boom", "num_requests": 0},
        },
        "speedup": {"orbitkv_vs_apc": {"ttft_p50": 2.0, "ttft_p95": 2.0, "prefill_tokens_computed": 2.67}},
        "floor": {
            "step": 5, "kind": "recall", "prompt_tokens": 400, "repeats": 3,
            "all_cached": {"ttft_s": 0.2, "computed_tokens": 12, "connector_tokens": 388, "reused_tokens_by_mode": {"exact": 388}},
            "new_tokens_only": {"ttft_s": 0.1, "prompt_tokens": 12},
            "full_prefill": {"ttft_s": 1.5, "computed_tokens": 400},
        },  # fmt: skip
    }
    text = bench_agent.format_report(doc)
    assert "orbitkv" in text and "apc_prefix 400, exact 64" in text and "x2.00" in text
    assert "none       FAILED: boom" in text
    assert "all chunks cached" in text and "new tokens only" in text and "full prefill" in text


def test_summaries_feed_the_json_fields():
    recs = [
        drv.StepRecord(i, "slide", "", [0], 100, c, a, k, m, t, None, t, "")
        for i, (c, a, k, m, t) in enumerate([(100, 0, 0, None, 1.0), (20, 32, 48, {"survivor": 48}, 0.3)])
    ]
    s = drv.summarize("orbitkv", recs).to_json()
    for key in ("ttft_p50_s", "ttft_p95_s", "prefill_tokens_computed", "reused_tokens_by_mode"):
        assert key in s
    assert s["prefill_tokens_computed"] == 120 and s["reused_tokens_by_mode"] == {"apc_prefix": 32, "survivor": 48}
    json.dumps(s)


@pytest.mark.slow
@pytest.mark.vllm
def test_bench_agent_three_systems(tmp_path, capsys):
    """The whole bench, small: tiny model, 4 steps, three servers one after another."""
    argv = ["--json", "--size", "tiny", "--window", "2", "--steps", "4", "--workdir", str(tmp_path),
            "--out", str(tmp_path / "bench.json")]  # fmt: skip
    rc = bench_agent.main(argv)
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert json.loads(capsys.readouterr().out) == doc
    for name in ("apc", "none"):
        s = doc["systems"][name]
        assert s["error"] is None and s["num_requests"] == 4
        assert s["ttft_p50_s"] > 0 and s["ttft_p95_s"] >= s["ttft_p50_s"]
        assert s["prefill_tokens_computed"] > 0
    assert doc["systems"]["none"]["prefill_tokens_computed"] == doc["systems"]["none"]["prompt_tokens"]
    assert doc["systems"]["apc"]["prefill_tokens_computed"] < doc["systems"]["none"]["prefill_tokens_computed"]
    assert "apc_vs_none" in doc["speedup"]
    orbit = doc["systems"]["orbitkv"]
    if orbit["error"] is None:
        assert rc == 0 and "orbitkv_vs_apc" in doc["speedup"]
        assert doc["floor"]["all_cached"]["ttft_s"] > 0 and doc["floor"]["new_tokens_only"]["ttft_s"] > 0
