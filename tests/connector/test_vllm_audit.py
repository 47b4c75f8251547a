"""The live audit against a real vLLM server: approximate requests are sampled, replayed exact in
idle time, and a mode whose disagreement exceeds its budget is switched off for that model.

The tiny seeded model's survivor KV differs from a full prefill's (its first-token distribution
moves), so with a zero KL budget every audited sample disagrees: the test shows the mechanism
acts on what it measures. Whether survivors keep answers on a real model is `bench fidelity`'s."""

from __future__ import annotations

import json

import pytest
from connector_vllm_testlib import segment

from orbitkv.serving.audit import Auditor, first_token_kl
from orbitkv.serving.http_client import http_post_json, scrape_metrics
from orbitkv.serving.server_process import model_server, running

pytestmark = pytest.mark.vllm
CHUNK = 32


def test_the_audit_measures_kl_as_the_calibration_does():
    """The audit judges a mode against the calibration's figures, so it uses the same KL:
    ``bench fidelity``'s, a token missing from one side's top list at that list's smallest logprob.
    (The audit once floored a missing token at -30: one token of probability 0.05 missing from the
    other list then added about 1.4 nats, whatever the two distributions were.)"""
    from orbitkv_bench import fidelity_metrics

    assert first_token_kl is fidelity_metrics.first_token_kl
    a = {"x": -0.1, "y": -2.5, "z": -4.0}
    assert first_token_kl(a, dict(a)) == pytest.approx(0.0, abs=1e-12)
    near = first_token_kl(a, {"x": -0.2, "y": -2.0, "z": -4.0})
    far = first_token_kl(a, {"x": -3.0, "y": -0.1, "z": -4.0})
    assert 0 < near < far
    # z missing from the other list: it gets that list's smallest logprob (-2.0), computed here
    # independently over the union {x, y, z}, each side renormalised.
    import math

    p = [math.exp(v) for v in (-0.1, -2.5, -4.0)]
    q = [math.exp(v) for v in (-0.2, -2.0, -2.0)]
    p, q = [v / sum(p) for v in p], [v / sum(q) for v in q]
    want = sum(pi * math.log(pi / qi) for pi, qi in zip(p, q, strict=True))
    assert first_token_kl(a, {"x": -0.2, "y": -2.0}) == pytest.approx(want, rel=1e-12)
    disjoint = first_token_kl(a, {"w": -0.01, "v": -5.0})
    assert math.isfinite(disjoint) and disjoint > near  # disjoint top lists: a floor, not a crash
    assert first_token_kl(a, {}) is None  # nothing to measure: the audit skips the sample


def _complete(url, ids, params, salt="agent"):
    body = {"model": "m", "prompt": ids, "max_tokens": 1, "temperature": 0.0,
            "cache_salt": salt, "kv_transfer_params": {"orbitkv": params}}
    status, data = http_post_json(url, "/v1/completions", body)
    assert status == 200, data
    return data["kv_transfer_params"]["orbitkv"]


def test_the_audit_switches_survivor_off_when_it_disagrees(tmp_path):
    from orbitkv.config import OrbitKVConfig
    from orbitkv.models.make_model import make_model

    model_dir = make_model(tmp_path / "qwen2-tiny", "qwen2")
    audit_dir = tmp_path / "audit"
    extra = {"chunk_size": CHUNK, "orbitkv_text_chunking": "fixed", "local_cpu": True,
             "local_disk": str(tmp_path / "store"), "orbitkv_approximate_reuse": "request",
             "orbitkv_require_calibration": False, "orbitkv_audit_fraction": 1.0,
             "orbitkv_audit_min_samples": 2, "orbitkv_audit_max_kl": 0.0,
             "orbitkv_audit_max_disagreement": 0.0, "orbitkv_audit_dir": str(audit_dir),
             "orbitkv_patch_rank": 0}
    server = model_server(model_dir, "orbitkv", tmp_path / "server.log", extra_config=extra,
                          load_format="auto", served_name="m", max_model_len=1024)
    with running(server):
        url = server.base_url
        sys_ = segment(700)
        windows = [[segment(701), segment(702)], [segment(703), segment(704)]]
        opt_in = {"approximate": True}
        num_survivor = 0
        for i, (a, b) in enumerate(windows):
            _complete(url, sys_ + a + b + segment(790 + i, 8), {})  # stores the window
            slid = _complete(url, sys_ + b + segment(795 + i, 8), opt_in)  # a dropped: b survives
            num_survivor += slid["reused_tokens_by_mode"].get("survivor", 0)
        assert num_survivor >= 2 * CHUNK
        pending = list((audit_dir / "pending").glob("*.json"))
        assert len(pending) == 2
        cfg = OrbitKVConfig.load(overrides={k.removeprefix("orbitkv_"): v for k, v in extra.items()
                                            if k.startswith("orbitkv_")}, env={})
        auditor = Auditor(url, audit_dir, cfg)
        assert auditor.is_idle()
        assert auditor.run_pending() == 2
        verdicts = json.loads((audit_dir / "verdicts.json").read_text())
        (cells,) = verdicts["models"].values()
        cell = cells["survivor:text"]
        assert cell["num_samples"] == 2 and cell["num_disagreed"] == 2 and cell["is_off"]
        assert cell["kl_sum"] > 0
        # The engine picks the verdict up: the same operation is now served exact only.
        a, b = segment(705), segment(706)
        _complete(url, sys_ + a + b + segment(798, 8), {})
        import time

        time.sleep(1.2)  # the verdicts file is re-read at most once a second
        after = _complete(url, sys_ + b + segment(799, 8), opt_in)
        assert "survivor" not in after["reused_tokens_by_mode"] and not after["policy"]
        metrics = scrape_metrics(url)
        assert any(k.startswith("vllm:orbitkv_audit_total") for k in metrics), sorted(metrics)[:20]
        assert any(k.startswith("vllm:orbitkv_model_info") for k in metrics)
