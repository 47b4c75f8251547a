"""The binding task generator and the shipped binding model (fidelity lab ``--arch binding``)."""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from orbitkv_lab.binding import eval as beval  # noqa: E402
from orbitkv_lab.binding import task  # noqa: E402

# Measured on the shipped weights (n=200 items per question type, 40 legends, seed 12345; see
# lab/orbitkv_lab/assets/binding/eval_results.json); the test uses a smaller held-out set (seed 2024), so the
# thresholds below sit well under the measured values.
CEIL_SINGLE_MIN = 0.95  # measured 1.000
CEIL_MULTI_MIN = 0.90  # measured 1.000
BLIND_GAP_MIN = 0.40  # ceiling - blind on multi-hop, measured 0.795
BLIND_SINGLE_DROP_MAX = 0.05  # blind keeps single-hop: measured drop 0.000
PATCH8_MULTI_MIN = 0.85  # rank-8 oracle patch on multi-hop, measured 1.000


def test_task_deterministic_and_well_formed():
    a = task.make_eval_set(7, 20, legends=5)
    b = task.make_eval_set(7, 20, legends=5)
    assert len(a) == 60
    for x, y in zip(a, b, strict=True):
        assert np.array_equal(x.a, y.a) and np.array_equal(x.b, y.b)
        assert (x.qtype, x.qarg, x.answer, x.trap) == (y.qtype, y.qarg, y.answer, y.trap)
    c = task.make_eval_set(8, 20, legends=5)
    assert any(not np.array_equal(x.b, y.b) for x, y in zip(a, c, strict=True))
    for it in a:
        assert it.a.shape == (task.A_LEN,) and it.b.shape == (task.B_LEN,)
        assert (
            it.b.min() >= task.ENT0 and it.b.max() < task.ENT0 + task.N_ENT
        )  # B names no attribute
        assert 0 <= it.a.min() and it.a.max() < task.VOCAB_SIZE
        ec = np.bincount(it.b - task.ENT0, minlength=task.N_ENT)
        ac = np.bincount(it.attr_of[it.b - task.ENT0], minlength=task.N_ATTR)
        assert np.array_equal(ec, it.ent_counts) and np.array_equal(ac, it.attr_counts)
        se, sa = np.sort(ec), np.sort(ac)
        assert se[-1] - se[-2] >= 2 and sa[-1] - sa[-2] >= 2  # unique majorities
        assert it.trap == (it.attr_of[ec.argmax()] != ac.argmax())
        if it.qtype == "A":
            assert it.answer == task.ATTR0 + it.attr_of[it.qarg]
        elif it.qtype == "E":
            assert it.answer == task.ENT0 + ec.argmax()
        else:
            assert it.answer == task.ATTR0 + ac.argmax()
    m = [it for it in a if it.multi_hop]
    assert 0 < sum(it.trap for it in m) < len(m)
    toks, tgt, aux = task.train_batch(np.random.default_rng(0), 4)
    toks2, _, _ = task.train_batch(np.random.default_rng(0), 4)
    assert np.array_equal(toks, toks2)
    assert ((tgt >= 0).sum(1) == 4).all()
    rows, cols = np.nonzero(tgt >= 0)
    assert np.array_equal(toks[rows, cols + 1], tgt[rows, cols])  # answer follows its arg


@pytest.fixture(scope="module")
def model():
    if not os.path.exists(os.path.join(beval.ASSET_DIR, "model.safetensors")):
        pytest.skip("binding weights not shipped")
    torch.set_num_threads(1)
    return beval.load_model()


def test_shipped_weights_small(model):
    size = os.path.getsize(os.path.join(beval.ASSET_DIR, "model.safetensors"))
    assert size < 10 * 2**20


def test_ceiling_matches_single_forward(model):
    items = task.make_eval_set(3, 4)
    logits, _ = beval.run_arms(model, items, ranks=(32,))
    ids = torch.tensor(
        np.stack([np.concatenate([[task.BOS], it.a, it.b, it.question]) for it in items])
    )
    with torch.no_grad():
        ref = model(input_ids=ids).logits[:, -1]
    torch.testing.assert_close(logits["ceiling"], ref, atol=1e-4, rtol=1e-4)
    # a full-rank patch reconstructs KV(B|A) (rank 32 >= B_LEN rows): back to the ceiling
    torch.testing.assert_close(logits["patch@32"], ref, atol=1e-3, rtol=1e-3)


def test_ceiling_and_blind_multi_hop_gap(model):
    items = task.make_eval_set(2024, 50, legends=10)
    res = beval.evaluate(model, items, ranks=(8,), transfer=False)
    acc = res["acc"]
    assert acc["ceiling"]["single"] >= CEIL_SINGLE_MIN
    assert acc["ceiling"]["multi"] >= CEIL_MULTI_MIN
    assert acc["ceiling"]["multi"] - acc["blind"]["multi"] >= BLIND_GAP_MIN
    assert acc["ceiling"]["single"] - acc["blind"]["single"] <= BLIND_SINGLE_DROP_MAX
    assert acc["patch@8"]["multi"] >= PATCH8_MULTI_MIN
