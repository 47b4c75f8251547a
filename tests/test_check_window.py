"""``orbitkv check window``: the default (tiny) configuration on a reduced set (slide, one reorder,
recall; ranks 8 and full), the report's per-operation facts, and (slow) the large configuration,
where rank 32 is below full rank."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch
from orbitkv.connector.worker.patching import patch_nbytes
from orbitkv_lab.checks.window_report import at_rank, op_facts


def _args(tmp_path, **changes) -> argparse.Namespace:
    args = dict(ops="slide,reorder:201,recall", ranks="8,full", workdir=str(tmp_path), size="tiny",
                image_size=None, init_std=None)
    return argparse.Namespace(**{**args, **changes})


def _kv_nbytes(num_tokens: int, num_features: int) -> int:
    return num_tokens * num_features * 2 * 2  # K and V, bf16


@pytest.mark.vllm
def test_window_check_full_rank_equals_reprefill(tmp_path):
    from orbitkv_lab.checks.window import format_table, run_check

    doc = run_check(_args(tmp_path), lambda msg: None)
    print(format_table(doc))
    assert doc["ok"], doc["problems"]
    rows = {(r["op"], r["arm"], r["rank"]): r for r in doc["rows"]}
    assert {op for op, _, _ in rows} == {"slide", "reorder 201", "recall"}
    num_features = doc["model"]["num_features_per_side"]
    assert num_features == doc["model"]["num_kv_heads"] * doc["model"]["head_dim"] == 64
    for op in ("slide", "reorder 201", "recall"):
        full, rank8 = rows[(op, "patched", "full")], rows[(op, "patched", 8)]
        blind, relocate = rows[(op, "blind", None)], rows[(op, "relocate", None)]
        # The arms were served as labelled: patched tokens cover the shared items.
        assert full["served"].get("patched") == full["num_served_item_tokens"] > 0
        assert blind["served"].get("blind") == blind["num_served_item_tokens"]
        assert max(full["kv_rel_error"]) == 0.0 and full["kl"] <= 1e-3
        # The full-rank patch gives back the items' KV but for a few near-zero values (a few of
        # their own ULPs); rank 8 really truncates.
        assert full["item_kv_num_off"] == 0 and full["item_kv_num_values"] > 0
        assert full["item_kv_num_differ"] <= 1e-3 * full["item_kv_num_values"]
        assert rank8["item_kv_num_off"] > 0 and min(rank8["item_kv_rel_error"][1:]) > 0
        assert full["greedy_agreement"] == 1.0 and full["greedy_prefix"] == 32
        # More rank, less error; the relocated entry sits between blind and the patch.
        assert np.mean(rank8["kv_rel_error"]) < np.mean(relocate["kv_rel_error"])
        assert np.mean(relocate["kv_rel_error"]) < np.mean(blind["kv_rel_error"])
        assert blind["kl"] > rank8["kl"] and blind["eta"] == 0.0 and rank8["eta"] > 0.5
        assert relocate["eta_relocate"] == 0.0 and rank8["eta_relocate"] == pytest.approx(
            1 - rank8["kl"] / relocate["kl"], abs=1e-6)
        # The planner's own transfer: an image now behind one it never followed is served from
        # its entry in the old window, as the relocate arm serves it by hand.
        transfer = rows[(op, "transfer", None)]
        if op != "slide":
            assert transfer["served"].get("transfer", 0) > 0, transfer["served"]
        if op != "recall":  # there the relocate arm recomputes an image it never saved
            assert transfer["item_kv_rel_error"] == relocate["item_kv_rel_error"]
            assert transfer["kl"] == pytest.approx(relocate["kl"], rel=1e-6)
        # The tiny images are 16 tokens + 3 markers: rank 8 is a real truncation, "full" is full.
        facts = doc["ops"][op]
        tokens = facts["item_tokens"]
        assert tokens and set(tokens) == {19} and facts["full_rank"] == 19
        assert not rank8["is_full_rank"] and full["is_full_rank"]
        # The stored patch's bytes are the connector's own accounting (fp32 factors, per layer).
        want = sum(patch_nbytes(n, num_features, 8, 2) for n in tokens) / sum(_kv_nbytes(n, num_features) for n in tokens)
        assert rank8["patch_bytes_fraction"] == pytest.approx(want, abs=1e-3)
        assert facts["byte_break_even_rank"] == pytest.approx(19 * 64 / (2 * (19 + 64)), abs=0.05)
    assert doc["at_patch_rank"]["rank"] == 32


def test_num_off_allows_a_few_ulps_of_a_near_zero_value_only():
    from orbitkv_lab.checks.window import _num_off, _ulps

    want = torch.tensor([1.0, -0.5, 2.4e-5, 0.75]).bfloat16()
    got = want.clone()
    got[2] = (want[2:3].view(torch.int16) + 2).view(torch.bfloat16)[0]  # 2 ULP of a near-zero value
    assert _num_off(got, want, _ulps(got, want)) == 0
    got[0] = (want[0:1].view(torch.int16) + 2).view(torch.bfloat16)[0]  # 2 ULP of a typical value
    assert _num_off(got, want, _ulps(got, want)) == 1


def test_ulps_counts_representable_steps():
    from orbitkv_lab.checks.window import _ulps

    x = torch.tensor([1.0, -2.5, 3e-5, 1e4]).bfloat16()
    away = (x.view(torch.int16) + 1).view(torch.bfloat16)  # the next bf16 away from zero
    assert _ulps(x, x).tolist() == [0] * 4
    assert _ulps(x, away).tolist() == [1] * 4
    assert (away.float().abs() > x.float().abs()).all()
    assert _ulps(torch.tensor([0.0]).bfloat16(), torch.tensor([-0.0]).bfloat16()).item() == 0
    # Across zero: the smallest subnormals on either side are two steps apart.
    sub, neg_sub = torch.tensor([1, -32767], dtype=torch.int16).view(torch.bfloat16)
    assert sub > 0 > neg_sub and _ulps(sub[None], neg_sub[None]).item() == 2
    assert _ulps(torch.tensor([1.0]), torch.tensor([1.0 + 2**-23])).item() == 1  # fp32 too


def _row(op: str, rank, eta: float, fraction: float | None, is_full: bool) -> dict:
    return {"op": op, "arm": "patched", "rank": rank, "eta": eta, "patch_bytes_fraction": fraction,
            "is_full_rank": is_full}


def test_op_facts_break_even_is_where_the_patch_costs_the_items_kv():
    tokens, features = [147, 147], 256
    def fraction(rank: int) -> float:
        return sum(patch_nbytes(n, features, rank, 2) for n in tokens) / sum(_kv_nbytes(n, features) for n in tokens)
    rows = [_row("slide", 16, 0.5, fraction(16), False), _row("slide", 8, 0.3, fraction(8), False),
            _row("slide", "full", 1.0, 3.1, True)]
    facts = op_facts(tokens, features, rows)
    assert facts["full_rank"] == 147 and facts["item_tokens"] == tokens
    # 4 m (N + F) fp32 bytes per side against N F bf16: m = N F / (2 (N + F)).
    assert facts["byte_break_even_rank"] == pytest.approx(147 * 256 / (2 * (147 + 256)), abs=0.05)
    assert fraction(round(facts["byte_break_even_rank"])) == pytest.approx(1.0, abs=0.03)
    # Only full-rank rows: no linear part to read the break-even from.
    assert op_facts(tokens, features, rows[2:])["byte_break_even_rank"] is None


def test_at_rank_reports_the_worst_operation_and_full_rank():
    rows = [_row("slide", 32, 0.95, 0.6, False), _row("recall", 32, 0.42, 0.6, False),
            _row("recall", 8, 0.1, 0.2, False)]
    got = at_rank(rows, 32)
    assert (got["min_eta"], got["min_eta_op"], got["meets_eta_target"]) == (0.42, "recall", False)
    assert not got["is_full_rank_anywhere"]
    rows[1] = _row("recall", 32, 0.97, 0.6, True)
    got = at_rank(rows, 32)
    assert got["meets_eta_target"] and got["is_full_rank_anywhere"] and got["min_eta_op"] == "slide"


@pytest.mark.vllm
@pytest.mark.slow
def test_window_check_large_images_measure_patches_below_full_rank(tmp_path):
    """The docs' large configuration on one slide: 144-token images, 256 features per side."""
    from orbitkv_lab.checks.window import format_table, run_check

    doc = run_check(_args(tmp_path, ops="slide", ranks="32,full", size="bench", image_size=192), lambda msg: None)
    print(format_table(doc))
    assert doc["model"]["image_tokens"] == 144 and doc["model"]["num_features_per_side"] == 256
    rows = {(r["arm"], r["rank"]): r for r in doc["rows"]}
    facts = doc["ops"]["slide"]
    assert min(facts["item_tokens"]) >= 128 and facts["full_rank"] > 32
    rank32, full = rows[("patched", 32)], rows[("patched", "full")]
    assert not rank32["is_full_rank"] and full["is_full_rank"]
    assert rank32["served"].get("patched") == rank32["num_served_item_tokens"] > 0
    # Truncation is real here: rank 32 leaves error the full-rank patch does not.
    assert np.mean(rank32["kv_rel_error"]) > 10 * np.mean(full["kv_rel_error"])
    assert rank32["patch_bytes_fraction"] < full["patch_bytes_fraction"]
    assert full["item_kv_num_off"] == 0 and doc["ok"], doc["problems"]
