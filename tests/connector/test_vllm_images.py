"""OrbitKVConnector with images: a tiny SmolVLM (Idefics3, Llama text, 1-D RoPE) in real vLLM.

Each image's placeholder span is one chunk keyed by vLLM's content hash of the image, so the same
picture is found again at another offset, after the window dropped the image before it.
"""

from __future__ import annotations

import numpy as np
import pytest
from connector_vllm_testlib import OFF, assert_relocated_like_prefill, summary
from connector_vllm_testlib import engine as start_engine
from PIL import Image

pytestmark = pytest.mark.vllm

SYSTEM = (
    "<|im_start|>System: you are a careful assistant who looks at pictures.<end_of_utterance>\n"
)


def _image(seed: int) -> Image.Image:
    pixels = np.random.RandomState(seed).rand(64, 64, 3) * 255
    return Image.fromarray(pixels.astype("uint8"))


def _request(text: str, images: list) -> dict:
    return {"prompt": text, "multi_modal_data": {"image": images}}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from orbitkv.tools.make_model import make_model

    model_dir = make_model(tmp_path_factory.mktemp("model") / "smolvlm", "smolvlm")
    with start_engine(model_dir, limit_mm_per_prompt={"image": 2}) as eng:
        yield eng


def test_image_survives_a_sliding_window(engine):
    img1, img2 = _image(1), _image(2)
    first, first_blocks = engine.run(
        _request(
            SYSTEM + "User:<image><image>What changed?<end_of_utterance>\nAssistant:", [img1, img2]
        ),
        max_tokens=4,
    )
    assert summary(first)["num_saved_chunks"] == summary(first)["num_chunks"]
    engine.poison(first_blocks)

    second = _request(SYSTEM + "User:<image>What is new?<end_of_utterance>\nAssistant:", [img2])
    served, served_blocks = engine.run(second, max_tokens=4)
    reused = summary(served)["reused_tokens_by_mode"]
    # Everything up to the image is text seen before (exact); the image moved up (survivor).
    assert reused["survivor"] == 19 and served.num_cached_tokens == sum(reused.values())
    num_served = served.num_cached_tokens
    image_start = num_served - 19
    k_got, v_got = engine.kv(served_blocks, image_start, num_served, 0)
    engine.poison(served_blocks)
    ref, ref_blocks = engine.run(second, OFF, max_tokens=4)
    assert summary(ref)["num_reused_tokens"] == 0
    k_want, v_want = engine.kv(ref_blocks, image_start, num_served, 0)
    assert_relocated_like_prefill(k_got, k_want, v_got, v_want)
