"""Where each chunk of a prompt starts, in the model's own position units.

A chunk's relocation shift is the change of its start *position*, not of its token index. For 1-D
RoPE the two are the same. For M-RoPE (Qwen2-VL family) an image advances the positions by its grid
(``max(t, h, w)`` merged patches), not by its token count, so a chunk behind a different mix of
images and text moves by another amount than its index did. Inside a chunk every token's (t, h, w)
shifts by the same amount when the chunk moves (same content, same internal layout), so the shift
of the chunk's first token, in its t stream, is the rotation every token of it needs.

``ChunkPositions.for_request`` gives, per request, the position of any token index:

- 1-D RoPE: the index;
- M-RoPE: the model's own computation when vLLM's model class imports here (its
  ``get_mrope_input_positions``, the function vLLM's model runner uses for the request), else
  ``mrope_positions``, a port of that function for the Qwen2-VL / Qwen2.5-VL layout that is tested
  against ``transformers``' ``get_rope_index``;
- a model OrbitKV cannot place (M-RoPE without image grids, say): None, and the scheduler serves
  chunks only where they were stored (exact mode at the same index).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)

# token ids, mm_features -> positions [3, N] (or None when the request cannot be placed)
MRopeFn = Callable[[Sequence[int], Sequence[Any]], np.ndarray | None]


def mrope_positions(
    num_tokens: int,
    items: Sequence[tuple[int, int, int, int, float]],
) -> np.ndarray:
    """M-RoPE (t, h, w) positions ``[3, num_tokens]`` of a prompt, the Qwen2-VL way.

    ``items``: per image / video, ``(offset, grid_t, grid_h, grid_w, t_factor)`` with the grid in
    merged patches (the item's placeholder run is ``grid_t * grid_h * grid_w`` tokens from
    ``offset``). Text runs count on from the largest position so far plus one.
    """
    parts: list[np.ndarray] = []
    st = 0

    def next_index() -> int:
        return int(parts[-1].max()) + 1 if parts else 0

    for offset, grid_t, grid_h, grid_w, t_factor in sorted(items):
        text_len = offset - st
        if text_len < 0:
            raise ValueError(f"multimodal item at {offset} overlaps the previous one")
        st_idx = next_index()
        parts.append(np.broadcast_to(np.arange(text_len), (3, text_len)) + st_idx)
        grid = np.indices((grid_t, grid_h, grid_w)).reshape(3, -1)
        if t_factor != 1.0:
            grid[0] = (grid[0] * t_factor).astype(np.int64)
        parts.append(grid + text_len + st_idx)
        st = offset + grid_t * grid_h * grid_w
    if st < num_tokens:
        st_idx = next_index()
        parts.append(np.broadcast_to(np.arange(num_tokens - st), (3, num_tokens - st)) + st_idx)
    if not parts:
        return np.zeros((3, 0), dtype=np.int64)
    return np.concatenate(parts, axis=1)[:, :num_tokens]


def grid_items(mm_features: Sequence[Any], spatial_merge_size: int, tokens_per_second: float):
    """``mrope_positions`` items from vLLM's ``mm_features`` (their ``image_grid_thw`` /
    ``video_grid_thw`` data); None when a feature carries no grid."""
    items = []
    for f in mm_features:
        data = getattr(f, "data", None) or {}
        modality = str(getattr(f, "modality", "image"))
        field = data.get("image_grid_thw") if modality == "image" else data.get("video_grid_thw")
        if field is None:
            return None
        grid = getattr(field, "data", field)
        t, h, w = (int(x) for x in np.asarray(grid).reshape(-1)[:3])
        t_factor = 1.0
        if modality != "image":
            seconds = data.get("second_per_grid_ts")
            per_grid = float(np.asarray(getattr(seconds, "data", 1.0)).reshape(-1)[0]) if seconds else 1.0
            t_factor = per_grid * tokens_per_second
        m = spatial_merge_size
        items.append((int(f.mm_position.offset), t, h // m, w // m, t_factor))
    return items


class ChunkPositions:
    """The position of a request's tokens, in the units relocation rotates by."""

    def __init__(self, kind: str, mrope_fn: MRopeFn | None = None) -> None:
        if kind not in ("index", "mrope", "none"):
            raise ValueError(f"unknown position kind {kind!r}")
        self.kind = kind
        self._mrope_fn = mrope_fn

    @classmethod
    def from_vllm_config(cls, vllm_config: VllmConfig, is_mrope: bool) -> ChunkPositions:
        if not is_mrope:
            return cls("index")
        fn = _model_mrope_fn(vllm_config) or _ported_mrope_fn(vllm_config)
        if fn is None:
            logger.warning("OrbitKV: no M-RoPE position function for this model; chunks are "
                           "served only where they were stored")
            return cls("none")
        return cls("mrope", fn)

    def for_request(
        self, token_ids: Sequence[int], mm_features: Sequence[Any]
    ) -> Callable[[int], int] | None:
        """``index -> position`` for this prompt, or None when it cannot be placed."""
        if self.kind == "index":
            return _identity
        if self.kind == "none" or self._mrope_fn is None:
            return None
        try:
            positions = self._mrope_fn(list(token_ids), list(mm_features or ()))
        except Exception:  # a feature without grid data, a model-side assertion: cannot place
            logger.exception("OrbitKV: M-RoPE positions failed; serving exact chunks only")
            return None
        if positions is None:
            return None
        t_stream = np.asarray(positions)[0]
        return lambda index: int(t_stream[index])


def _identity(index: int) -> int:
    return index


def _model_mrope_fn(vllm_config: VllmConfig) -> MRopeFn | None:
    """vLLM's own ``get_mrope_input_positions`` of the served model, if its class imports."""
    try:
        from vllm.model_executor.models import ModelRegistry

        mc = vllm_config.model_config
        model_cls, _ = ModelRegistry.resolve_model_cls(mc.architectures, model_config=mc)
        method = model_cls.get_mrope_input_positions
    except Exception:  # e.g. the model file imports torchvision, missing on CPU installs
        return None
    shim = object.__new__(model_cls)  # only the config is read, never the weights
    object.__setattr__(shim, "config", vllm_config.model_config.hf_config)

    def fn(token_ids: Sequence[int], mm_features: Sequence[Any]) -> np.ndarray:
        positions, _ = method(shim, list(token_ids), list(mm_features))
        return np.asarray(positions)

    return fn


def _ported_mrope_fn(vllm_config: VllmConfig) -> MRopeFn | None:
    hf = vllm_config.model_config.hf_config
    vision = getattr(hf, "vision_config", None)
    merge = getattr(vision, "spatial_merge_size", None)
    if merge is None:
        return None
    tokens_per_second = float(getattr(vision, "tokens_per_second", 1.0) or 1.0)

    def fn(token_ids: Sequence[int], mm_features: Sequence[Any]) -> np.ndarray | None:
        items = grid_items(mm_features, int(merge), tokens_per_second)
        return None if items is None else mrope_positions(len(token_ids), items)

    return fn
