"""Run a Hugging Face model at chosen positions and read / write its KV cache as OrbitKV chunks.

The exactness checks need what vLLM hides: the same tokens run at shifted positions, the cache of
each run in OrbitKV's chunk layout (``internal-api.md``: ``[N, H, D]`` per layer; MLA one
``[N, kv_lora_rank + rope]`` row per token) and the next-token logits from a cache we built.

transformers 5 caches DeepSeek-V2 compressed: its ``DynamicCache`` layer holds the normalised
latent ``kv_c`` as "keys" and the rotated ``k_pe`` as "values", so ``[keys | values]`` is exactly
the MLA row vLLM stores, and relocation rotates only its ``k_pe`` band.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from orbitkv.kernels.rope import RopeSpec

# One layer of a chunk: (k, v) with k, v [N, H, D]; MLA: (kv [N, lora + rope], None).
LayerKV = tuple[torch.Tensor, torch.Tensor | None]


@dataclasses.dataclass
class HFModel:
    arch: str
    model: Any
    config: Any
    tokenizer: Any
    spec: RopeSpec
    image_processor: Any = None

    @property
    def is_mla(self) -> bool:
        return getattr(self.config.get_text_config(), "kv_lora_rank", None) is not None

    @property
    def is_mrope(self) -> bool:
        return self.spec.is_mrope


@dataclasses.dataclass
class Prompt:
    """Token ids ``[N]``, their canonical positions (``[N]``, or ``[3, N]`` for M-RoPE, starting
    at 0), the model's extra inputs (pixels) and the ``(start, end)`` token span of each segment."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    extras: dict[str, torch.Tensor]
    spans: list[tuple[int, int]]

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def next_position(self) -> int:
        """Position of the token that would follow (M-RoPE: text resumes after the largest id)."""
        return int(self.positions.max()) + 1


def load(model_dir: str | Path, *, dtype: torch.dtype = torch.float32) -> HFModel:
    from transformers import AutoConfig, AutoTokenizer

    from orbitkv.models.make_model import model_class

    path = Path(model_dir)
    arch = json.loads((path / "orbitkv_model.json").read_text())["arch"]
    config = AutoConfig.from_pretrained(path)
    model = model_class(arch).from_pretrained(path, dtype=dtype).eval()
    image_processor = None
    if arch == "qwen2-vl":
        from transformers import Qwen2VLImageProcessorPil

        image_processor = Qwen2VLImageProcessorPil.from_pretrained(path)
    elif arch == "smolvlm":
        from transformers import Idefics3ImageProcessorPil

        image_processor = Idefics3ImageProcessorPil.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return HFModel(arch, model, config, tokenizer, RopeSpec.from_hf_config(config), image_processor)


def build_prompt(hm: HFModel, segments: list[str | Any], *, bos: bool = True) -> Prompt:
    """Token ids and positions for text strings and PIL images, in order (BOS first if ``bos``)."""
    tok = hm.tokenizer
    ids: list[int] = [tok.bos_token_id] if bos else []
    mm_types: list[int] = [0] * len(ids)
    spans: list[tuple[int, int]] = []
    pixels: list[dict[str, torch.Tensor]] = []
    for seg in segments:
        start = len(ids)
        if isinstance(seg, str):
            seg_ids = tok(seg, add_special_tokens=False)["input_ids"]
            ids += seg_ids
            mm_types += [0] * len(seg_ids)
        else:
            seg_ids, seg_types, px = _image_tokens(hm, seg)
            ids += seg_ids
            mm_types += seg_types
            pixels.append(px)
        spans.append((start, len(ids)))
    input_ids = torch.tensor(ids, dtype=torch.long)
    extras = _merge_pixels(hm, pixels)
    if hm.is_mrope and pixels:
        pos, _ = hm.model.model.get_rope_index(
            input_ids[None],
            torch.tensor(mm_types, dtype=torch.int)[None],
            image_grid_thw=extras["image_grid_thw"],
        )
        positions = pos[:, 0]
    elif hm.is_mrope:
        positions = torch.arange(len(ids)).expand(3, -1).clone()
    else:
        positions = torch.arange(len(ids))
    return Prompt(input_ids, positions, extras, spans)


def _image_tokens(hm: HFModel, image: Any) -> tuple[list[int], list[int], dict[str, torch.Tensor]]:
    tok = hm.tokenizer
    if hm.arch == "qwen2-vl":
        px = hm.image_processor(images=[image], return_tensors="pt")
        merge = hm.config.vision_config.spatial_merge_size
        n = int(px["image_grid_thw"].prod()) // merge**2
        ids = tok.convert_tokens_to_ids(["<|vision_start|>"] + ["<|image_pad|>"] * n + ["<|vision_end|>"])
        return ids, [0] + [1] * n + [0], dict(px)
    if hm.arch == "smolvlm":
        px = hm.image_processor(images=[[image]], return_tensors="pt")
        v = hm.config.vision_config
        n = (v.image_size // v.patch_size) ** 2 // hm.config.scale_factor**2
        fake = "<fake_token_around_image>"
        ids = tok.convert_tokens_to_ids([fake, "<global-img>"] + ["<image>"] * n + [fake])
        return ids, [0] * len(ids), dict(px)
    raise ValueError(f"arch {hm.arch!r} takes no images")


def _merge_pixels(hm: HFModel, pixels: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    if not pixels:
        return {}
    if hm.arch == "qwen2-vl":
        return {k: torch.cat([p[k] for p in pixels]) for k in ("pixel_values", "image_grid_thw")}
    # Idefics3 takes [batch, num_images, C, H, W]: the images of one prompt sit on dim 1.
    return {k: torch.cat([p[k] for p in pixels], dim=1) for k in ("pixel_values", "pixel_attention_mask")}


def _position_ids(hm: HFModel, positions: torch.Tensor) -> torch.Tensor:
    return positions[:, None, :] if hm.is_mrope else positions[None, :]


@torch.no_grad()
def run(hm: HFModel, prompt: Prompt, delta: int = 0) -> tuple[torch.Tensor, list[LayerKV]]:
    """Prefill ``prompt`` at its positions shifted by ``delta``: (last-token logits fp32, chunk KV)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    out = hm.model(
        input_ids=prompt.input_ids[None],
        position_ids=_position_ids(hm, prompt.positions + delta),
        past_key_values=cache,
        use_cache=True,
        **prompt.extras,
    )
    return out.logits[0, -1].float(), cache_to_chunk(hm, out.past_key_values)


@torch.no_grad()
def next_logits(hm: HFModel, kv: list[LayerKV], token_id: int, position: int) -> torch.Tensor:
    """Logits (fp32) of one more token at ``position`` read against the cache ``kv``."""
    ids = torch.tensor([[token_id]])
    pos = torch.full((3, 1, 1) if hm.is_mrope else (1, 1), position, dtype=torch.long)
    out = hm.model(input_ids=ids, position_ids=pos, past_key_values=chunk_to_cache(hm, kv), use_cache=True)
    return out.logits[0, -1].float()


def cache_to_chunk(hm: HFModel, cache: Any) -> list[LayerKV]:
    layers = []
    for layer in cache.layers:
        k, v = layer.keys[0], layer.values[0]  # [H, N, D]
        if hm.is_mla:
            layers.append((torch.cat([k[0], v[0]], dim=-1), None))
        else:
            layers.append((k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()))
    return layers


def chunk_to_cache(hm: HFModel, kv: list[LayerKV]) -> Any:
    from transformers import DynamicCache

    cache = DynamicCache()
    dtype = next(hm.model.parameters()).dtype
    for i, (k, v) in enumerate(kv):
        if hm.is_mla:
            lora = hm.spec.rope_offset
            k, v = k[None, None, :, :lora], k[None, None, :, lora:]
        else:
            k, v = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
        cache.update(k.to(dtype), v.to(dtype), i)
    return cache


def slice_chunk(kv: list[LayerKV], start: int, end: int) -> list[LayerKV]:
    return [(k[start:end], None if v is None else v[start:end]) for k, v in kv]


def cat_chunks(*chunks: list[LayerKV]) -> list[LayerKV]:
    return [
        (torch.cat([c[i][0] for c in chunks]), None if chunks[0][i][1] is None else torch.cat([c[i][1] for c in chunks]))
        for i in range(len(chunks[0]))
    ]
