"""The calibration gate and the live audit on the connector halves (no engine): an approximate mode
is served only where the table measured it within budget on this model, and stops being served once
the audit's verdicts switch it off."""

from __future__ import annotations

import json
import logging

import pytest
from halves_testlib import build_halves, compute, identity, new_step, release, request, step
from orbitkv.connector.scheduler.calibration import load_calibration, write_calibration

from orbitkv.config import OrbitKVConfig

SYS, C1, C2, Q = [1] * 4, [2] * 4, [3] * 4, [9, 9]
OPT_IN = {"orbitkv": {"approximate": True}}
FP = identity().model_fingerprint


def _table(path, *, fingerprint=FP, survivor_ok=True):
    rows = [{"modality": "text", "mode": "survivor", "num_questions": 120, "agreement": 0.97 if survivor_ok else 0.5,
             "is_within_budget": survivor_ok},
            {"modality": "text", "mode": "blind", "num_questions": 120, "agreement": 0.2,
             "is_within_budget": False}]
    write_calibration(path, fingerprint, "smollm2", rows, {"min_agreement": 0.95})
    return path


def _served_after_a_slide(**config):
    """Tokens served to an opted-in request whose window lost c1 (c2, q: survivors)."""
    built = build_halves(approximate_reuse="request", **{"require_calibration": True, **config})
    try:
        compute(built, "first", SYS + C1 + C2 + Q, [1, 2, 3, 4], seed=13)
        num, _ = built[0].get_num_new_matched_tokens(request("x", SYS + C2 + Q, OPT_IN), 0)
        return num
    finally:
        release(built)


def test_only_calibrated_modes_within_budget_are_served(tmp_path, caplog):
    assert _served_after_a_slide(require_calibration=False) == 9  # the mechanism serves survivors
    ok = _table(tmp_path / "ok.json")
    assert _served_after_a_slide(calibration_file=str(ok)) == 9
    with caplog.at_level(logging.WARNING, logger="orbitkv.connector.scheduler.calibration"):
        assert _served_after_a_slide(calibration_file=str(_table(tmp_path / "bad.json", survivor_ok=False))) == 4
        assert _served_after_a_slide(calibration_file=str(_table(tmp_path / "other.json", fingerprint="0" * 32))) == 4
        assert _served_after_a_slide() == 4  # required, and no table at all
    refusals = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert refusals and all("survivor" in m for m in refusals)


def test_a_bad_table_fails_at_start_naming_the_key(tmp_path):
    bad = tmp_path / "t.json"
    bad.write_text(json.dumps({"format": "orbitkv-calibration-v1", "model_fingerprint": FP,
                               "rows": [{"modality": "text", "mode": "warp"}]}))
    with pytest.raises(ValueError, match="calibration_file"):
        load_calibration(bad, FP)
    with pytest.raises(ValueError, match="calibration_file"):
        build_halves(approximate_reuse="request", require_calibration=True,
                     calibration_file=str(tmp_path / "missing.json"))
    # Tables of several models in one file: each model reads its own rows.
    write_calibration(bad, FP, "m", [], {"min_agreement": 0.9})
    _table(bad, fingerprint="0" * 32)
    assert load_calibration(bad, "0" * 32).allowed("survivor") == {"text"}
    assert load_calibration(bad, FP).allowed("survivor") == frozenset()


def test_audit_samples_approximate_requests_and_its_verdict_switches_the_mode_off(tmp_path, monkeypatch):
    import orbitkv.connector.scheduler.audit as audit_mod

    monkeypatch.setattr(audit_mod, "VERDICT_CHECK_INTERVAL_S", 0.0)
    audit = tmp_path / "audit"
    built = build_halves(approximate_reuse="request", audit_dir=str(audit), audit_fraction=1.0)
    sched = built[0]
    try:
        compute(built, "first", SYS + C1 + C2 + Q, [1, 2, 3, 4], seed=13)
        slid = request("slid", SYS + C2 + Q, OPT_IN)
        num, _ = sched.get_num_new_matched_tokens(slid, 0)
        assert num == 9
        sched.update_state_after_alloc(slid, None, num)
        step(built[1], sched.build_connector_meta(new_step("slid", [5, 6, 7], num, 1)), built[2])
        built[3].writer.flush()
        sched.request_finished(slid, [5, 6, 7])
        (sample_path,) = (audit / "pending").glob("*.json")
        sample = json.loads(sample_path.read_text())
        assert sample["served_modes"] == ["survivor"] and sample["modalities"] == ["text"]
        assert sample["prompt_token_ids"] == SYS + C2 + Q and sample["orbitkv"]["approximate"]
        stats = sched.take_stats().reduce()
        assert stats.get("audit.sampled") == 1
        # The auditor's verdict (orbitkv/serving/audit.py writes it): survivor off for text.
        from orbitkv.serving.audit import Auditor

        cfg = OrbitKVConfig(audit_min_samples=1, audit_max_disagreement=0.0)
        auditor = Auditor("http://127.0.0.1:9", audit, cfg)
        auditor._record(sample, True, 0.5)
        verdicts = json.loads((audit / "verdicts.json").read_text())
        assert verdicts["models"][FP]["survivor:text"]["is_off"]
        again = request("again", SYS + C2 + Q, OPT_IN)
        assert sched.get_num_new_matched_tokens(again, 0) == (4, False)  # exact prefix only
        assert sched.take_stats().reduce().get("audit.switched_off") == 1
    finally:
        release(built)
