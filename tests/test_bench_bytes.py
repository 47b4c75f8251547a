"""``orbitkv bench bytes`` at its smallest: both arms run under the same budget, the patches arm
stores patches in place of conditioned entries, and every figure the report names is there."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.vllm


def test_bench_bytes_runs_both_arms_under_one_budget(tmp_path):
    from orbitkv_bench.bytes import main

    out = tmp_path / "bytes.json"
    argv = ["--size", "tiny", "--image-size", "64", "--items", "2", "--antecedents", "2",
            "--budget-fractions", "10.0", "--rank", "4", "--workdir", str(tmp_path), "--out", str(out)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    (budget,) = report["budgets"]
    arms = budget["arms"]
    for arm in arms.values():
        assert arm["stored_nbytes"] <= budget["budget_nbytes"]
        assert 0 < arm["tokens_served"] <= arm["prompt_tokens"]
    # With everything fitting, the conditioned arm serves the images exactly on the replay; the
    # patches arm replaced their conditioned entries with patches and serves them patched.
    assert arms["conditioned"]["x_hit_rate"] == 1.0
    assert "patched" in arms["patches"]["reused_tokens_by_mode"]
    for name in ("ratio_tokens_served_per_byte", "ratio_tokens_served", "ratio_x_tokens_served"):
        assert budget[name] is not None and budget[name] > 0, name
    # Everything fits: the patches arm serves X whole too (its conditioned entries never stored).
    assert arms["patches"]["x_hit_rate"] == 1.0
