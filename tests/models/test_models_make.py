"""``make-model`` writes directories transformers loads, for every arch, deterministically."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from orbitkv.kernels.rope import RopeSpec

from orbitkv.cli import main as cli_main
from orbitkv.models import hfrun
from orbitkv.models.make_model import (
    ARCHES,
    INIT_STD,
    VLLM_SUPPORT,
    build_config,
    ensure_models,
    image_seq_len,
    make_model,
    width_scaled_std,
)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    torch.set_num_threads(1)
    return ensure_models(tmp_path_factory.getbasetemp() / "orbitkv-tiny-models")


# (style, rotary_dim, head_dim, rope_offset, is_mrope) each arch must present to the relocation.
EXPECTED_ROPE = {
    "llama": ("neox", 32, 32, 0, False),
    "qwen2": ("neox", 32, 32, 0, False),
    "phi": ("neox", 16, 32, 0, False),
    "stablelm": ("neox", 8, 32, 0, False),
    "llama-yarn": ("neox", 32, 32, 0, False),
    "llama3-scaled": ("neox", 32, 32, 0, False),
    "qwen2-vl": ("neox", 32, 32, 0, True),
    "smolvlm": ("neox", 32, 32, 0, False),
    "deepseek-v2": ("gptj", 64, 576, 512, False),
}


def test_every_arch_is_listed() -> None:
    assert set(EXPECTED_ROPE) == set(ARCHES) == set(VLLM_SUPPORT)


@pytest.mark.parametrize("arch", ARCHES)
def test_directory_loads_in_transformers(models: dict[str, Path], arch: str) -> None:
    path = models[arch]
    for name in ("config.json", "generation_config.json", "tokenizer.json", "model.safetensors"):
        assert (path / name).is_file(), name
    hm = hfrun.load(path)
    spec = hm.spec
    assert (spec.style, spec.rotary_dim, spec.head_dim, spec.rope_offset, spec.is_mrope) == EXPECTED_ROPE[arch]
    assert hm.model.config.get_text_config().num_hidden_layers == 4
    segments = ["hello there", _image()] if hm.image_processor is not None else ["hello there"]
    prompt = hfrun.build_prompt(hm, segments)
    logits, kv = hfrun.run(hm, prompt)
    assert torch.isfinite(logits).all()
    assert len(kv) == 4 and kv[0][0].shape[0] == len(prompt)
    text = "Describe the image briefly."
    assert hm.tokenizer.decode(hm.tokenizer(text, add_special_tokens=False)["input_ids"]) == text


def test_rope_spec_matches_the_models_own_rotary(models: dict[str, Path]) -> None:
    """The spec's frequencies are the ones the model's rotary module rotates by (scaling included)."""
    for arch in ("llama-yarn", "llama3-scaled", "phi", "deepseek-v2"):
        hm = hfrun.load(models[arch])
        rotary = next(m for n, m in hm.model.named_modules() if n.endswith("rotary_emb"))
        torch.testing.assert_close(hm.spec.inv_freq_tensor().float(), rotary.inv_freq.float(), rtol=1e-6, atol=0)


def test_vlm_prompts_carry_their_image_tokens(models: dict[str, Path]) -> None:
    vl = hfrun.load(models["qwen2-vl"])
    prompt = hfrun.build_prompt(vl, ["a", _image(), "b"])
    start, end = prompt.spans[1]
    assert end - start == 16 + 2  # 4x4 merged patches between vision start/end
    assert prompt.positions.shape == (3, len(prompt))
    # Inside the image the h/w axes differ from t: this is genuinely 3-D M-RoPE.
    assert not torch.equal(prompt.positions[1, start:end], prompt.positions[0, start:end])
    smol = hfrun.load(models["smolvlm"])
    prompt = hfrun.build_prompt(smol, ["a", _image(), _image(2)])
    image_id = smol.tokenizer.convert_tokens_to_ids("<image>")
    assert int((prompt.input_ids == image_id).sum()) == 2 * 16
    assert prompt.extras["pixel_values"].shape[:2] == (1, 2)


def test_make_model_is_deterministic(tmp_path: Path) -> None:
    first = make_model(tmp_path / "a", "qwen2")
    second = make_model(tmp_path / "b", "qwen2")
    for name in ("config.json", "tokenizer.json", "model.safetensors", "generation_config.json"):
        assert _digest(first / name) == _digest(second / name), name


def test_cli_writes_a_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["make-model", str(tmp_path / "m"), "--arch", "stablelm"]) == 0
    assert json.loads((tmp_path / "m" / "orbitkv_model.json").read_text())["arch"] == "stablelm"
    assert str(tmp_path / "m") in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli_main(["make-model", str(tmp_path / "x"), "--arch", "gpt5"])


@pytest.mark.parametrize("arch", ARCHES)
def test_bench_size_is_larger_and_has_a_valid_rope(arch: str) -> None:
    cfg, _ = build_config(arch, "bench")
    text = cfg.get_text_config()
    assert text.num_hidden_layers == 16 and text.hidden_size == 1024
    RopeSpec.from_hf_config(cfg)


def test_bench_writes_no_weights_by_default(tmp_path: Path) -> None:
    path = make_model(tmp_path / "bench", "qwen2", "bench")
    assert (path / "config.json").is_file() and not (path / "model.safetensors").exists()


def test_unknown_arch_or_size_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown arch"):
        build_config("gpt5")
    with pytest.raises(ValueError, match="unknown size"):
        build_config("qwen2", "huge")


def test_smolvlm_image_size_sets_the_image_tokens(tmp_path: Path) -> None:
    from PIL import Image
    from transformers import AutoProcessor

    path = make_model(tmp_path / "smol", "smolvlm", weights=False, image_size=192)
    assert image_seq_len(path) == 144 == (192 // 16) ** 2
    assert json.loads((path / "orbitkv_model.json").read_text())["image_size"] == 192
    processor = AutoProcessor.from_pretrained(path)
    image = Image.fromarray((np.random.RandomState(0).rand(192, 192, 3) * 255).astype("uint8"))
    ids = processor(text="a<image>b", images=[image], return_tensors="pt")["input_ids"][0]
    assert int((ids == processor.tokenizer.convert_tokens_to_ids("<image>")).sum()) == 144
    assert image_seq_len(make_model(tmp_path / "default", "smolvlm", weights=False)) == 16


def test_image_size_is_refused_off_grid_or_off_smolvlm() -> None:
    with pytest.raises(ValueError, match="multiple of 16"):
        build_config("smolvlm", image_size=100)
    with pytest.raises(ValueError, match="smolvlm only"):
        build_config("qwen2", image_size=192)


def test_width_scaled_std_keeps_tiny_and_matches_the_attention_scale() -> None:
    assert width_scaled_std("tiny") == INIT_STD
    bench = build_config("smolvlm", "bench", init_std=width_scaled_std("bench"))[0].get_text_config()
    # Attention logits scale as std**2 * width: the same at both sizes.
    assert bench.initializer_range**2 * bench.hidden_size == pytest.approx(INIT_STD**2 * 128)
    assert build_config("smolvlm", "bench")[0].get_text_config().initializer_range == INIT_STD


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _image(seed: int = 0):
    from PIL import Image

    return Image.fromarray((np.random.RandomState(seed).rand(64, 64, 3) * 255).astype("uint8"))
