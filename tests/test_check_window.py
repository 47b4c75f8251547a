"""``orbitkv check window`` on a reduced set (slide, one reorder, recall; ranks 8 and full)."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

pytestmark = pytest.mark.vllm


def test_window_check_full_rank_equals_reprefill(tmp_path):
    from orbitkv.checks.window import format_table, run_check

    args = argparse.Namespace(ops="slide,reorder:201,recall", ranks="8,full", workdir=str(tmp_path))
    doc = run_check(args, lambda msg: None)
    print(format_table(doc))
    assert doc["ok"], doc["problems"]
    rows = {(r["op"], r["arm"], r["rank"]): r for r in doc["rows"]}
    assert {op for op, _, _ in rows} == {"slide", "reorder 201", "recall"}
    for op in ("slide", "reorder 201", "recall"):
        full, rank8 = rows[(op, "patched", "full")], rows[(op, "patched", 8)]
        blind, relocate = rows[(op, "blind", None)], rows[(op, "relocate", None)]
        # The arms were served as labelled: patched tokens cover the shared items.
        assert full["served"].get("patched") == full["num_served_item_tokens"] > 0
        assert blind["served"].get("blind") == blind["num_served_item_tokens"]
        assert max(full["kv_rel_error"]) == 0.0 and full["kl"] <= 1e-3
        assert full["greedy_agreement"] == 1.0
        # More rank, less error; the relocated entry sits between blind and the patch.
        assert np.mean(rank8["kv_rel_error"]) < np.mean(relocate["kv_rel_error"])
        assert np.mean(relocate["kv_rel_error"]) < np.mean(blind["kv_rel_error"])
        assert blind["kl"] > rank8["kl"] and blind["eta"] == 0.0 and rank8["eta"] > 0.5
