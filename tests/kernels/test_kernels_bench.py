"""Smoke test of ``orbitkv bench kernels --quick --json``."""

from __future__ import annotations

import json

import pytest
from orbitkv.kernels import native
from orbitkv_bench import kernels as bench_kernels

ROW_KEYS = {"op", "tokens", "rank", "layout", "device", "gbps", "memcpy_gbps", "ratio"}


def test_quick_json(capsys):
    rc = bench_kernels.main(["--quick", "--json", "--tokens", "64", "--reps", "1"])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert {"device", "rows", "summary", "timed_layers", "scaled_from_timed_layers", "shape"} <= set(doc)
    assert {row["layout"] for row in doc["rows"]} == {"flash", "cpu_vec", "cpu_amx", "mla"}
    assert {row["rank"] for row in doc["rows"] if row["op"] == "load"} == set(bench_kernels.QUICK_RANKS)
    assert {(row["layout"], row["op"]) for row in doc["rows"]} == {
        (lay, op) for lay in ("flash", "cpu_vec", "cpu_amx", "mla") for op in ("load", "gather")}
    for row in doc["rows"]:
        assert ROW_KEYS <= set(row)
        assert row["gbps"] > 0 and row["memcpy_gbps"] > 0
        assert abs(row["ratio"] - row["gbps"] / row["memcpy_gbps"]) < 1e-2 * max(row["ratio"], 1e-3)


def test_many_ops_time_one_call_for_every_layer_of_the_cpu_caches(capsys):
    """``--ops load_many gather_many``: rows for the CPU caches the native op takes, none for the
    others (the op would not run there)."""
    if native.library() is None:
        pytest.skip("native CPU kernels unavailable (no C++ compiler)")
    rc = bench_kernels.main(["--quick", "--json", "--tokens", "64", "--reps", "1", "--timed-layers",
                             "2", "--ops", "load_many", "gather_many"])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert {(row["layout"], row["op"]) for row in doc["rows"]} == {
        (lay, op) for lay in ("cpu_vec", "cpu_amx") for op in ("load_many", "gather_many")}
    assert all(row["rank"] == 0 and row["gbps"] > 0 for row in doc["rows"])
