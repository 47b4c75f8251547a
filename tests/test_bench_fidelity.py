"""``orbitkv bench fidelity --quick`` end to end: real vLLM servers with OrbitKV on a tiny seeded
llama, every arm served in its own mode, the JSON, the plot and the calibration table.

Slow (three vLLM servers start): ``ORBITKV_SLOW=1`` or ``-m slow``. Seeded random weights only
check the plumbing here; the fidelity figures themselves come from real weights
(``docs/fidelity.md``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_quick_bench_serves_each_mode_and_writes_the_table(tmp_path: Path):
    from orbitkv_bench import fidelity
    from orbitkv_bench.fidelity_arms import computed_fingerprint

    from orbitkv.agent.demo import ensure_model

    model = ensure_model(tmp_path / "models", "llama", "tiny", weights=True)
    out, table_path = tmp_path / "fidelity.json", tmp_path / "calibration.json"
    rc = fidelity.main(
        [
            "--model",
            str(model),
            "--quick",
            "--workdir",
            str(tmp_path / "work"),
            "--out",
            str(out),
            "--plot",
            str(tmp_path / "plot"),
            "--write-calibration",
            str(table_path),
        ]
    )
    assert rc == 0
    doc = json.loads(out.read_text())
    results = doc["results"]
    assert set(results) == {
        "exact", "survivor", "transfer", "blind", "patched_r8", "orbit", "recompute_15", "apc"
    }
    # Five questions per arm after the start step, every one compared with the reference.
    assert all(r["all"]["num_questions"] == 5 for r in results.values())
    steps = {s["op"]: s for s in doc["steps"]}
    served = {
        (op, arm): row["reused_by_mode"] or {}
        for op, s in steps.items()
        for arm, row in s["arms"].items()
    }
    # Each arm's own mode reached a live request where the trace gives it a chance.
    assert served[("slide", "survivor")].get("survivor", 0) > 0
    assert served[("slide", "blind")].get("blind", 0) > 0
    assert served[("revisit", "patched_r8")].get("patched", 0) > 0
    assert served[("slide", "recompute_15")].get("recompute", 0) > 0
    assert set(served[("revisit", "apc")]) == {"apc"}  # vLLM's prefix cache, no OrbitKV
    assert served[("revisit", "exact")].get("exact", 0) > 0
    assert set(served[("revisit", "exact")]) == {"exact"}  # exact-only requests get exact KV only
    # Tokens computed come from vLLM's own counters: the reference computes the whole prompt.
    revisit = steps["revisit"]["arms"]["exact"]
    assert revisit["reference_computed_tokens"] == revisit["prompt_tokens"]
    assert revisit["computed_tokens"] < revisit["prompt_tokens"] // 4
    table = json.loads(table_path.read_text())
    assert table["format"] == "orbitkv-calibration-v1"
    assert (
        table["model_fingerprint"]
        == computed_fingerprint(model)
        == doc["config"]["model_fingerprint"]
    )
    assert {(r["mode"], r.get("patch_rank")) for r in table["rows"]} == {
        ("survivor", None),
        ("transfer", None),
        ("blind", None),
        ("patched", 8),
        ("orbit", None),
        ("recompute", None),
    }
    assert all(
        r["num_questions"] == 5 and isinstance(r["is_within_budget"], bool) for r in table["rows"]
    )
    assert (tmp_path / "plot" / "fidelity.png").stat().st_size > 0
