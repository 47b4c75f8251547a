"""``orbitkv check exactness``: its mix covers every kind of request the issue names, its rows flag
what they must, and the whole check passes against live servers (CI runs it at its small size)."""

from __future__ import annotations

import json

import pytest

from orbitkv.checks.exactness_live import _row
from orbitkv.checks.exactness_mix import build_mix


def test_the_mix_covers_every_kind_and_has_forty_requests():
    asks = build_mix()
    assert len(asks) >= 40
    kinds = {a.kind for a in asks}
    assert kinds == {"agent", "exact_only", "reuse_off", "not_opted_in", "tenant", "salt", "lora",
                     "prompt_logprobs", "corrupt"}
    assert any(a.expect_refused for a in asks)  # a tenant the deployment does not allow
    assert {how for a in asks for _, how in a.corrupt} == {"flip", "cut"}
    opted = [a for a in asks if a.is_opted_in]
    assert opted and all(a.params.get("approximate") is True for a in opted)
    # Salted requests that name approximate modes without opting in: exact only.
    salted_not_opted = [a for a in asks if a.kind == "not_opted_in"]
    assert salted_not_opted and all(a.cache_salt and not a.is_opted_in for a in salted_not_opted)


def _response(tokens, logprobs, summary):
    return {"choices": [{"token_ids": tokens, "logprobs": {"token_logprobs": logprobs}}],
            "kv_transfer_params": {"orbitkv": summary}}


def test_rows_flag_a_different_answer_and_approximate_kv_where_it_was_not_asked_for():
    (ask,) = [a for a in build_mix() if a.kind == "not_opted_in"][:1]
    ref = _response([1, 2], [-0.5, -0.25], {})
    same = _row(ask, _response([1, 2], [-0.5, -0.25], {"approximate_from": None}), ref)
    assert same["is_exact"] and same["is_equal"] and same["is_expected"]
    other = _row(ask, _response([1, 3], [-0.5, -0.25], {}), ref)
    assert other["is_exact"] and not other["is_equal"]
    close = _row(ask, _response([1, 2], [-0.5, -0.2500001], {}), ref)
    assert not close["is_equal"]  # bit-exact, not close
    leaked = _row(ask, _response([1, 2], [-0.5, -0.25],
                                 {"approximate_from": 32, "num_approximate_tokens": 32, "policy": "p"}), ref)
    assert not leaked["is_exact"] and not leaked["is_expected"]


@pytest.mark.vllm
def test_check_exactness_passes_against_live_servers(tmp_path):
    from orbitkv.checks.exactness import main

    out = tmp_path / "report.json"
    assert main(["--json", "--workdir", str(tmp_path / "work"), "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    totals = report["totals"]
    assert report["ok"] and totals["num_requests"] >= 40
    assert totals["exact_lineage_tokens_differing"] == 0
    assert totals["exact_requests_differing"] == 0
    assert totals["approximate_tokens_not_opted_in"] == 0
    # A salted agent naming approximate modes without opting in was served exact KV only.
    not_opted = [r for r in report["requests"] if r["kind"] == "not_opted_in"]
    assert not_opted and all(r["is_exact"] and r["is_equal"] and r["is_expected"] for r in not_opted)
    # The mix did what it is for: approximate KV served to the agent that opted in, failed loads
    # recomputed, and a real number of stored exact tokens compared.
    assert totals["num_approximate_tokens_served_opted_in"] > 0
    assert totals["num_failed_load_tokens"] > 0
    assert totals["num_exact_tokens_compared"] > 1000
