"""Fidelity lab: the arms' anchors (ceiling, full-rank patch, r=100% CacheBlend, single-chunk
relocation) and the report's bytes accounting and schema, on tiny random models."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from orbitkv_lab.fidelity import arms, lab, metrics, prompts, report, selection

from orbitkv.models import hfrun

QUICK = lab.LabConfig.quick()


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fidelity-models")


@pytest.fixture(scope="module", params=["qwen2", "deepseek-v2"])
def setup(request, models):
    torch.set_num_threads(1)
    hm = lab.load_arch(request.param, models)
    item = prompts.make_items(hm, QUICK.prompt)[0]
    return hm, item


def test_ceiling_arm_has_zero_kl(setup):
    hm, item = setup
    res = arms.ceiling(hm, item)
    assert metrics.kl(item.ceiling_logits, res.logits) == 0.0
    assert res.extra_bytes == 0 and res.extra_tokens == 0


def test_ceiling_matches_plain_transformers_prefill(setup):
    hm, item = setup
    logits, _ = hfrun.run(hm, item.prompt)  # fp32 cache: differs only by the bf16 rounding
    assert metrics.kl(logits, item.ceiling_logits) < 1e-3


def test_reuse_has_a_gap_and_full_rank_patch_closes_it(setup):
    hm, item = setup
    kl_blind = metrics.kl(item.ceiling_logits, arms.blind(hm, item).logits)
    kl_reloc = metrics.kl(item.ceiling_logits, arms.relocate_only(hm, item).logits)
    full = arms.patch(hm, item, arms.full_rank(item), name="patch@full")
    kl_full = metrics.kl(item.ceiling_logits, full.logits)
    assert kl_blind > 1e-3 and kl_reloc > 1e-4
    assert kl_full < 1e-4
    assert metrics.eta(kl_full, kl_blind) > 0.99
    err = metrics.kv_rel_err(full.kv, item.ceiling_kv, item.chunk_rows[: item.n_prefix])
    assert max(err) < 1e-2  # bf16 rounding of relocated + patch only


def test_cacheblend_at_100_percent_is_the_ceiling(setup):
    hm, item = setup
    res = arms.cacheblend(hm, item, 1.0)
    assert metrics.kl(item.ceiling_logits, res.logits) < 1e-12
    assert res.extra_tokens == pytest.approx(float(item.chunk_rows.sum()))


def test_relocate_only_equals_blind_on_a_single_chunk(models):
    hm = lab.load_arch("qwen2", models)
    item = prompts.single_chunk_item(hm, QUICK.prompt)
    assert item.deltas == [0]
    b, r = arms.blind(hm, item), arms.relocate_only(hm, item)
    assert torch.equal(b.logits, r.logits)
    assert all(torch.equal(x[0], y[0]) for x, y in zip(b.kv, r.kv, strict=True))
    # ... while a multi-chunk prompt moves its later chunks, so there they differ.
    multi = prompts.make_items(hm, QUICK.prompt)[0]
    assert multi.deltas[1] > 0
    assert not torch.equal(arms.blind(hm, multi).logits, arms.relocate_only(hm, multi).logits)


def test_bytes_accounting(setup):
    hm, item = setup
    layers = len(item.ceiling_kv)
    rb = arms.row_bytes(item.ceiling_kv)
    k, v = item.ceiling_kv[0]
    assert rb == 2 * (k[0].numel() + (0 if v is None else v[0].numel()))
    assert arms.chunk_bytes(item) == int(item.chunk_rows.sum()) * rb * layers
    m = 4
    res = arms.patch(hm, item, m)
    feats = [k[0].numel()] + ([] if v is None else [v[0].numel()])
    want = sum(2 * m * ((e - s) + f) for s, e in item.chunks[1:] for f in feats) * layers
    assert res.extra_bytes == want
    assert res.stored_bytes == arms.chunk_bytes(item) + want
    deep = arms.patch(hm, item, m, set(range(layers // 2, layers)))
    assert deep.extra_bytes == want * (layers - layers // 2) / layers
    epic = arms.epic(hm, item, 16, 16)  # k=16 of a 16-token reference: every chunk token
    assert epic.extra_bytes == int(item.chunk_rows.sum()) * rb * layers
    cb = arms.cacheblend(hm, item, 0.25)
    n = int(item.chunk_rows.sum())
    assert cb.extra_tokens == pytest.approx((2 * n + (layers - 2) * math.ceil(0.25 * n)) / layers)


def test_vlcache_schedule_is_monotone_and_meets_target():
    sens = [[1.0, 0.5, 0.4, 0.3, 0.2, 0.1, 0.0], [1.0, 0.2, 0.1, 0.05, 0.0, 0.0, 0.0], [1.0] * 7]
    sched = selection.vlcache_schedule(sens, 0.05)
    assert all(a >= b for a, b in zip(sched, sched[1:], strict=False))
    assert sum(sched) / len(sched) >= 0.05
    assert sched[2] == 0.0  # the insensitive deepest layer gets nothing


def test_cli_json_schema_and_plots(tmp_path, models):
    from orbitkv_lab.fidelity import cli as fidelity

    out = tmp_path / "r.json"
    plot = tmp_path / "fig"
    pytest.importorskip("matplotlib")
    rc = fidelity.main(
        [
            "--arch",
            "qwen2",
            "--quick",
            "--json",
            "--out",
            str(out),
            "--plot",
            str(plot),
            "--models-dir",
            str(models),
        ]
    )
    assert rc == 0
    rep = json.loads(out.read_text())
    assert report.validate(rep) == []
    arms_ = {r["arm"]: r for r in rep["arches"][0]["arms"]}
    for name in (
        "ceiling",
        "blind",
        "relocate",
        "patch@8",
        "patch@full",
        "cacheblend@15%",
        "vlcache@10%",
        "mpic-32",
        "epic-16",
        "mm-shiftkv@C256",
        "kvcapsule@50%",
    ):
        assert name in arms_, name
    assert arms_["ceiling"]["kl"] == 0.0 and arms_["ceiling"]["eta"] == 1.0
    assert arms_["patch@full"]["eta"] > 0.99
    assert arms_["mm-shiftkv@C256"]["stored_bytes"] < rep["arches"][0]["canonical_bytes"]
    assert {Path(f).name for f in rep["figures"]} >= {
        "kl_vs_rank.png",
        "eta_vs_bytes.png",
        "energy_vs_rank.png",
    }
    bad = dict(rep)
    del bad["arches"][0]["arms"][0]["eta"]
    assert report.validate(bad) != []
