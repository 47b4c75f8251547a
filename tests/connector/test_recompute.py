"""Selective recompute (``recompute`` mode): the planner computes a chunk's first tokens and loads
the rest as a hole behind them; the mode is approximate, so it reaches a request only when the
request opts in, the deployment allows approximate KV and the calibration measured it within
budget at the fraction asked."""

from __future__ import annotations

import pytest
from orbitkv.connector.chunking import chunk_prompt
from orbitkv.connector.scheduler.calibration import ModeGate, write_calibration
from orbitkv.connector.scheduler.lineage import Policy
from orbitkv.connector.scheduler.options import RequestRules
from orbitkv.connector.scheduler.planner import EXACT, MISS, RECOMPUTE, plan_request
from orbitkv.connector.scheduler.recompute import num_recomputed
from orbitkv.store.keys import RequestKeys, canonical_key
from planner_testlib import CTX, DictView, P

from orbitkv.config import OrbitKVConfig

FP = "f" * 32
OPT_IN = {"orbitkv": {"approximate": True, "modes": ["exact", "recompute"]}}


def test_num_recomputed_is_the_fraction_rounded_up_at_least_one():
    assert num_recomputed(124, 0.05) == 7 and num_recomputed(124, 0.15) == 19
    assert num_recomputed(124, 0.30) == 38 and num_recomputed(100, 0.3) == 30
    assert num_recomputed(4, 0.01) == 1 and num_recomputed(4, 1.0) == 4
    assert num_recomputed(10, 0.0) == 0 and num_recomputed(0, 0.5) == 0


def make_chunks(*segments, tail=()):
    """8-token chunks, one per segment value."""
    ids = [t for seg in segments for t in [seg] * 8] + list(tail)
    return chunk_prompt(ids, [], 8, CTX, text_chunking="fixed")


def _view_with_canonicals(chunks, indices):
    view = DictView()
    view.add_conditioned(chunks[0])
    for i in indices:
        view.add(canonical_key(chunks[i].cid, ""))
    return view


def test_recompute_chunks_are_fresh_heads_and_holes():
    # [sys, c1, c2, q]: 8-token chunks; c1 and c2 have only canonicals.
    chunks = make_chunks(10, 5, 6, tail=[1, 2])
    sys_, c1, c2 = chunks[0], chunks[1], chunks[2]
    assert (c1.start, c1.length, c2.start) == (8, 8, 16)
    view = _view_with_canonicals(chunks, (1, 2))
    kw = dict(num_computed_tokens=0, num_tokens=26, modes={EXACT, RECOMPUTE},
              keys=RequestKeys(lineage=P), min_hole_tokens=1)
    plan = plan_request(chunks, view, recompute_fraction=0.25, **kw)
    assert plan.decision(1).mode == RECOMPUTE and plan.decision(2).mode == RECOMPUTE
    # sys is the prefix run; each chunk's first 2 tokens are computed, the other 6 are a hole
    # (separate holes: fresh tokens sit between them).
    assert [(i.begin, i.end, i.mode) for i in plan.loads] == [(0, 8, EXACT)]
    assert [(h.start, h.end) for h in plan.holes] == [(10, 16), (18, 24)]
    assert all(i.key == canonical_key(chunks[i.chunk_index].cid, "") for h in plan.holes for i in h.loads)
    assert plan.first_approximate_token == 10
    # Holes shorter than min_hole_tokens are computed, never served without their fresh head.
    plan = plan_request(chunks, view, recompute_fraction=0.25, **{**kw, "min_hole_tokens": 7})
    assert plan.holes == () and plan.num_external_tokens == sys_.length
    # No fraction, or no holes: the mode is off (the chunks miss).
    for fraction, holes in ((0.0, 1), (0.25, 0)):
        plan = plan_request(chunks, view, recompute_fraction=fraction,
                            **{**kw, "min_hole_tokens": holes})
        assert plan.decision(1).mode == MISS and plan.holes == ()
    # An exact request names no approximate mode: nothing but sys.
    plan = plan_request(chunks, view, recompute_fraction=0.25, **{**kw, "keys": RequestKeys()})
    assert plan.holes == () and plan.decision(1).mode == MISS


def test_recompute_behind_a_computed_prefix_cut_into_its_head():
    chunks = make_chunks(10, 5, tail=[1, 2])
    view = _view_with_canonicals(chunks, (1,))
    kw = dict(num_tokens=18, modes={EXACT, RECOMPUTE}, keys=RequestKeys(lineage=P),
              min_hole_tokens=1, recompute_fraction=0.5)
    # vLLM computed sys and 2 of c1's 4 fresh tokens: c1's rest is still a hole at 12.
    plan = plan_request(chunks, view, num_computed_tokens=10, **kw)
    assert [(h.start, h.end) for h in plan.holes] == [(12, 16)]
    # Past c1's head: the rest extends the prefix run.
    plan = plan_request(chunks, view, num_computed_tokens=12, **kw)
    assert [(i.begin, i.end) for i in plan.loads] == [(12, 16)] and plan.holes == ()


def _config(**over):
    base = {"approximate_reuse": "request", "enable_recompute": True, "recompute_fraction": 0.15}
    return OrbitKVConfig.load(overrides={**base, **over}, env={})


def _modes(config, params, fp=FP):
    rules = RequestRules(config, ModeGate(config, fp))
    return rules.options(params, None).policy


def test_recompute_is_served_only_opted_in_and_calibrated_at_its_fraction(tmp_path):
    table = tmp_path / "cal.json"
    rows = [{"modality": "text", "mode": "recompute", "num_questions": 100, "agreement": 0.97,
             "is_within_budget": True, "recompute_fraction": 0.3}]
    write_calibration(table, FP, "smollm2", rows, {"min_agreement": 0.95})
    calibrated = _config(calibration_file=str(table))
    # Not opted in: exact, whatever the modes name.
    assert _modes(calibrated, {"orbitkv": {"modes": ["exact", "recompute"]}}).is_exact
    # Opted in, but the calibration measured 0.3, not the configured 0.15.
    assert _modes(calibrated, OPT_IN).is_exact
    at_30 = {"orbitkv": {**OPT_IN["orbitkv"], "recompute_fraction": 0.3}}
    policy = _modes(calibrated, at_30)
    assert policy.modes == {RECOMPUTE} and policy.recompute_fraction == 0.3
    # Another model's fingerprint, no table, or approximate reuse off: exact.
    assert _modes(calibrated, at_30, fp="0" * 32).is_exact
    assert _modes(_config(), at_30).is_exact
    assert _modes(_config(approximate_reuse="off", require_calibration=False), at_30).is_exact
    # A bench's uncalibrated server serves it on opt-in.
    assert _modes(_config(require_calibration=False), OPT_IN).modes == {RECOMPUTE}


def test_each_fraction_is_its_own_lineage():
    a = Policy.of(frozenset({EXACT, RECOMPUTE}), 0, recompute_fraction=0.05)
    b = Policy.of(frozenset({EXACT, RECOMPUTE}), 0, recompute_fraction=0.3)
    assert a.tag and b.tag and a.tag != b.tag
    # Policies without recompute keep their tags whatever fraction is configured.
    s1 = Policy.of(frozenset({"survivor"}), 0, recompute_fraction=0.05)
    s2 = Policy.of(frozenset({"survivor"}), 0)
    assert s1.tag == s2.tag and s1.recompute_fraction == 0.0


def test_bad_recompute_config_fails_naming_the_key():
    with pytest.raises(ValueError, match="recompute_fraction"):
        _config(recompute_fraction=0.0)
    with pytest.raises(ValueError, match="enable_recompute"):
        _config(enable_recompute="sometimes")
