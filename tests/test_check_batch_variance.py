"""``orbitkv check batch-variance``: the probe runs vLLM alone and reports, per step length, how
many trials computed other bits than a full prefill (the tiny model is batch-invariant here, and
the test says so: a change in vLLM's kernels that breaks that shows up in this test)."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.vllm


def test_the_tiny_model_computes_the_same_bits_in_any_step_length(tmp_path):
    from orbitkv_lab.checks.batch_variance import main

    out = tmp_path / "bv.json"
    assert main(["--workdir", str(tmp_path), "--out", str(out), "--trials", "2", "--tails", "1,2,33"]) == 0
    report = json.loads(out.read_text())
    assert set(report["differing_trials_by_tail"]) == {"1", "2", "33"}
    assert report["differing_trials_by_tail"] == {"1": 0, "2": 0, "33": 0}
