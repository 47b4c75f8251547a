"""The operator exactness check passes on every arch, and fails when the relocation is wrong."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from orbitkv.kernels.rope import RopeSpec
from orbitkv_lab.checks import operator as co

from orbitkv.models import hfrun
from orbitkv.models.make_model import ARCHES, ensure_models


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.set_num_threads(1)
    root = tmp_path_factory.getbasetemp() / "orbitkv-tiny-models"
    ensure_models(root)
    return root


_loaded: dict[str, hfrun.HFModel] = {}


def _model(models_dir: Path, arch: str) -> hfrun.HFModel:
    if arch not in _loaded:
        _loaded[arch] = hfrun.load(models_dir / f"{arch}-tiny")
    return _loaded[arch]


@pytest.mark.parametrize("arch", ARCHES)
def test_check_passes(models_dir: Path, arch: str) -> None:
    row = co.check_arch(arch, models_dir)
    assert row["relocate_max_ulp"] <= co.MAX_ULP
    assert row["relocate_mean_ulp"] <= 0.5
    assert row["relocate_fp32_max_ulp"] <= 0.5
    assert row["kl_relocated"] <= co.MAX_KL
    assert row.get("values_max_ulp", 0.0) <= co.MAX_VALUE_ULP
    assert row.get("values_identical_frac", 1.0) >= 0.99
    assert row.get("values_layer0_identical", True)
    assert row["patch_full_rank_max_ulp"] <= co.MAX_ULP
    assert row["patch_monotone"]
    errs = row["patch_rel_err_by_rank"]
    assert errs[str(row["patch_full_rank"])] < 1e-5 < errs["1"]
    assert row["kl_patched_full"] <= co.MAX_KL
    # Not relocating / not patching must cost far more than the threshold, or the KL check could not fail.
    assert row["kl_unrelocated"] > 10 * co.MAX_KL
    assert row["kl_blind"] > 10 * co.MAX_KL
    assert row["ok"] and row["failures"] == []


@pytest.mark.parametrize("arch", ["qwen2", "qwen2-vl", "deepseek-v2"])
def test_wrong_delta_fails(models_dir: Path, arch: str) -> None:
    row = co.check_relocation(_model(models_dir, arch), delta_error=1)
    assert row["relocate_max_ulp"] > 50
    assert row["kl_relocated"] > 10 * co.MAX_KL


@pytest.mark.parametrize("arch", ["qwen2", "phi", "deepseek-v2"])
def test_wrong_pair_style_fails(models_dir: Path, arch: str) -> None:
    hm = _model(models_dir, arch)
    wrong = dataclasses.replace(hm.spec, style="gptj" if hm.spec.style == "neox" else "neox")
    assert co.check_relocation(hm, spec=wrong)["relocate_max_ulp"] > 50


@pytest.mark.parametrize("arch", ["llama-yarn", "llama3-scaled", "deepseek-v2"])
def test_unscaled_frequencies_fail(models_dir: Path, arch: str) -> None:
    """Relocating a scaled-RoPE model with the plain ``theta^(-2i/d)`` frequencies is caught."""
    hm = _model(models_dir, arch)
    spec = hm.spec
    theta = hm.config.get_text_config().rope_parameters["rope_theta"]
    plain = 1.0 / theta ** (torch.arange(0, spec.rotary_dim, 2, dtype=torch.float64) / spec.rotary_dim)
    assert not torch.allclose(plain, spec.inv_freq_tensor())
    wrong = dataclasses.replace(spec, inv_freq=tuple(plain.tolist()))
    assert co.check_relocation(hm, spec=wrong)["relocate_max_ulp"] > 50


def test_ignoring_partial_rotary_fails(models_dir: Path) -> None:
    """phi rotates half of each head; a spec that rotates all of it is caught."""
    hm = _model(models_dir, "phi")
    dim = hm.spec.head_dim
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    wrong = RopeSpec("neox", dim, dim, tuple(inv_freq.tolist()))
    assert co.check_relocation(hm, spec=wrong)["relocate_max_ulp"] > 50


def test_yarn_mscale_is_inside_the_stored_keys(models_dir: Path) -> None:
    """YaRN scales cos/sin by mscale > 1; applying it again on relocation would be caught."""
    hm = _model(models_dir, "llama-yarn")
    rotary = next(m for n, m in hm.model.named_modules() if n.endswith("rotary_emb"))
    assert rotary.attention_scaling > 1.05
    prompt = hfrun.build_prompt(hm, [co.TEXT_A])
    _, kv1 = hfrun.run(hm, prompt)
    _, kv2 = hfrun.run(hm, prompt, 100)
    from orbitkv.kernels.relocate import relocate

    k1, k2 = kv1[0][0].to(torch.bfloat16), kv2[0][0].to(torch.bfloat16)
    twice = relocate(k1, 100, hm.spec).float() * rotary.attention_scaling
    assert co.ulp_error(twice, k2, hm.spec).max() > 5
    assert co.ulp_error(relocate(k1, 100, hm.spec), k2, hm.spec).max() <= co.MAX_ULP


def test_bf16_ulp() -> None:
    x = torch.tensor([1.0, 1.5, 0.75, 2.0, -3.0])
    assert co.bf16_ulp(x).tolist() == [2**-7, 2**-7, 2**-8, 2**-6, 2**-6]
    # One ULP up is the next representable bf16 value.
    up = (x.abs() + co.bf16_ulp(x)).to(torch.bfloat16).float()
    assert torch.equal(up - x.abs(), co.bf16_ulp(x))


def test_cli_json(models_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from orbitkv.cli import main

    assert main(["check", "operator", "--json", "--arch", "smolvlm", "--models-dir", str(models_dir)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is True
    (row,) = report["rows"]
    assert row["arch"] == "smolvlm"
    for key in ("relocate_max_ulp", "relocate_mean_ulp", "patch_full_rank_max_ulp", "kl_relocated"):
        assert isinstance(row[key], float)


def test_judge_flags_each_threshold() -> None:
    good = {
        "relocate_max_ulp": 1.0,
        "values_max_ulp": 0.0,
        "kl_relocated": 0.0,
        "patch_full_rank_max_ulp": 0.0,
        "patch_monotone": True,
    }
    assert co.judge(good) == []
    for key, bad in [
        ("relocate_max_ulp", 3.0),
        ("values_max_ulp", 2.0),
        ("kl_relocated", 1e-3),
        ("patch_full_rank_max_ulp", float("nan")),
        ("patch_monotone", False),
        ("values_layer0_identical", False),
    ]:
        assert len(co.judge({**good, key: bad})) == 1, key
