"""``bench replicas``' pairing: twins named apart, requests matched by episode and step."""

from __future__ import annotations

import pytest
from orbitkv_bench.replicas import format_ratios, labels, pair_ratios


def _rec(episode, step, ttft_s, engine_ttft_s, answer="a"):
    return {"episode": episode, "step": step, "ttft_s": ttft_s, "engine_ttft_s": engine_ttft_s,
            "answer": answer}


def test_a_system_named_again_is_another_arm():
    assert labels(["apc", "orbitkv", "apc", "orbitkv", "apc"]) == [
        "apc", "orbitkv", "apc#2", "orbitkv#2", "apc#3"]


def test_pairs_match_requests_by_episode_and_step():
    records = {
        "apc": [_rec(0, 0, 2.0, 1.8), _rec(0, 1, 1.0, 0.9), _rec(1, 0, 4.0, 3.6)],
        # the same steps in another order, one missing, one answer differing
        "orbitkv": [_rec(1, 0, 2.0, 1.8), _rec(0, 0, 1.0, 0.9, answer="b")],
        "apc#2": [_rec(0, 0, 2.0, 1.8), _rec(0, 1, 1.0, 0.9), _rec(1, 0, 4.0, 3.6)],
    }
    pairs = pair_ratios(records)
    assert list(pairs) == ["apc_vs_orbitkv", "apc_vs_apc#2", "orbitkv_vs_apc#2"]
    r = pairs["apc_vs_orbitkv"]
    assert r["num_requests"] == 2 and r["answers_equal"] == 1
    assert r["ttft_per_request_median"] == pytest.approx(0.5)  # half the time on both requests
    assert r["engine_ttft_per_request_median"] == pytest.approx(0.5)
    assert r["ttft_p50"] == pytest.approx(1.5 / 3.0)
    twins = pairs["apc_vs_apc#2"]
    assert twins["ttft_per_request_median"] == 1.0 and twins["answers_equal"] == 3
    assert "apc_vs_orbitkv" in format_ratios(pairs)
