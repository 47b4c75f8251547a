"""M-RoPE chunk positions, checked in ``transformers`` with a tiny Qwen2-VL.

A text chunk stored behind one mix of images and text is loaded behind another. Its shift is the
change of its M-RoPE start position (``orbitkv.connector.positions``), not of its token index: the
first must reproduce a re-prefill of the new prompt within 2 bf16 ULP of each rotation pair's
magnitude, the second must not.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from orbitkv.connector.positions import ChunkPositions, grid_items, mrope_positions
from orbitkv.kernels.relocate import relocate
from PIL import Image

from orbitkv.models import hfrun


@pytest.fixture(scope="module")
def hm(tmp_path_factory):
    from orbitkv.models.make_model import make_model

    torch.manual_seed(0)
    return hfrun.load(make_model(tmp_path_factory.mktemp("m") / "qwen2-vl", "qwen2-vl"))


def _image(seed: int, width: int, height: int) -> Image.Image:
    pixels = np.random.RandomState(seed).rand(height, width, 3) * 255
    return Image.fromarray(pixels.astype("uint8"))


def _features(hm, prompt) -> list:
    """vLLM-like ``mm_features`` of an ``hfrun`` prompt: each image's pad run and its grid."""
    pad = hm.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    ids = prompt.input_ids.tolist()
    grids = prompt.extras.get("image_grid_thw", torch.zeros(0, 3)).tolist()
    features, i = [], 0
    while i < len(ids):
        if ids[i] == pad:
            start = i
            while i < len(ids) and ids[i] == pad:
                i += 1
            features.append(
                SimpleNamespace(
                    modality="image",
                    mm_position=SimpleNamespace(offset=start, length=i - start),
                    data={"image_grid_thw": SimpleNamespace(data=torch.tensor(grids[len(features)]))},
                )
            )
        i += 1
    return features


def _positions(hm, prompt) -> np.ndarray:
    merge = hm.config.vision_config.spatial_merge_size
    return mrope_positions(len(prompt), grid_items(_features(hm, prompt), merge, 1.0))


def _pair_ulps(got: torch.Tensor, want: torch.Tensor) -> float:
    """Worst error in bf16 ULPs of each neox rotation pair's magnitude."""
    half = want.shape[-1] // 2
    w = want.float()
    mag = torch.sqrt(w[..., :half] ** 2 + w[..., half:] ** 2).repeat(1, 1, 2)
    ulp = torch.exp2(torch.floor(torch.log2(mag.clamp_min(1e-30))) - 7)
    return float(((got.float() - w).abs() / ulp).max())


SEGMENTS = {
    "stored": ["system notes", "IMG_A", "and then the shared paragraph"],
    "moved": ["a different opening line", "IMG_B", "IMG_C", "more text", "and then the shared paragraph"],
}


def _prompt(hm, name):
    images = {"IMG_A": _image(1, 56, 28), "IMG_B": _image(2, 28, 84), "IMG_C": _image(3, 56, 56)}
    return hfrun.build_prompt(hm, [images.get(s, s) for s in SEGMENTS[name]])


def test_ported_positions_match_transformers_get_rope_index(hm):
    for name in SEGMENTS:
        prompt = _prompt(hm, name)
        assert np.array_equal(_positions(hm, prompt), prompt.positions.numpy()), name


def test_chunk_positions_use_the_t_stream():
    vcfg = SimpleNamespace(
        model_config=SimpleNamespace(
            architectures=["NoSuchModelForTest"],
            hf_config=SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=2)),
        )
    )
    positions = ChunkPositions.from_vllm_config(vcfg, is_mrope=True)
    assert positions.kind == "mrope"
    feature = SimpleNamespace(
        modality="image",
        mm_position=SimpleNamespace(offset=3, length=8),
        data={"image_grid_thw": SimpleNamespace(data=torch.tensor([1, 4, 8]))},  # 2 x 4 merged
    )
    at = positions.for_request(list(range(20)), [feature])
    # 3 text tokens (0..2), the image from t=3 spans 4 positions, text resumes at 3 + 4 = 7.
    assert [at(i) for i in (0, 2, 3, 10, 11, 12)] == [0, 2, 3, 3, 7, 8]
    no_grid = SimpleNamespace(modality="image", mm_position=feature.mm_position, data={})
    assert positions.for_request(list(range(20)), [no_grid]) is None  # cannot be placed
    assert ChunkPositions.from_vllm_config(vcfg, is_mrope=False).for_request([1, 2], [])(1) == 1


def test_relocated_chunk_matches_a_reprefill_behind_another_mix(hm):
    stored, moved = _prompt(hm, "stored"), _prompt(hm, "moved")
    (s0, s1), (m0, m1) = stored.spans[-1], moved.spans[-1]
    assert s1 - s0 == m1 - m0
    _, kv_stored = hfrun.run(hm, stored)
    _, kv_moved = hfrun.run(hm, moved)
    k_stored = kv_stored[0][0][s0:s1].to(torch.bfloat16)  # the cache holds bf16
    k_want = kv_moved[0][0][m0:m1].to(torch.bfloat16)
    v_stored, v_want = (kv[0][1][a:b].to(torch.bfloat16) for kv, (a, b) in
                        ((kv_stored, (s0, s1)), (kv_moved, (m0, m1))))
    p_stored, p_moved = _positions(hm, stored)[0], _positions(hm, moved)[0]
    delta = int(p_moved[m0]) - int(p_stored[s0])
    index_delta = m0 - s0
    assert delta != index_delta  # the images advance positions by their grid, not token count
    assert _pair_ulps(relocate(k_stored, delta, hm.spec), k_want) <= 2.0
    assert torch.equal(v_stored, v_want)
    assert _pair_ulps(relocate(k_stored, index_delta, hm.spec), k_want) > 16.0
