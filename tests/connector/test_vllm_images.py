"""OrbitKVConnector with images: a tiny SmolVLM (Idefics3, Llama text, 1-D RoPE) in real vLLM.

Each image's placeholder span is one chunk keyed by vLLM's content hash of the image, so the same
picture is found again at another offset, after the window dropped the image before it.

Each test starts its prompts with its own system line, so no test's stored chunks serve another's.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from connector_vllm_testlib import (
    OFF,
    OPT_IN,
    assert_informative,
    assert_loaded_as_relocated,
    assert_relocated_like_prefill,
    bf16_ulp,
    flush,
    pair_magnitude,
    summary,
)
from connector_vllm_testlib import engine as start_engine
from PIL import Image

pytestmark = pytest.mark.vllm

SYSTEM = (
    "<|im_start|>System: you are a careful assistant who looks at pictures.<end_of_utterance>\n"
)


def _image(seed: int) -> Image.Image:
    pixels = np.random.RandomState(seed).rand(64, 64, 3) * 255
    return Image.fromarray(pixels.astype("uint8"))


def _request(text: str, images: list, cache_salt: str | None = None) -> dict:
    prompt = {"prompt": text, "multi_modal_data": {"image": images}}
    return {**prompt, "cache_salt": cache_salt} if cache_salt else prompt


def _image_spans(engine, token_ids: list[int]) -> list[tuple[int, int]]:
    """[begin, end) of each image's placeholder run, read off the prompt's tokens, not the
    connector's chunking: ``<fake_token_around_image><global-img><image>...<fake_token_around_image>``
    (this tiny Idefics3 config never splits an image into tiles)."""
    tok = engine.llm.get_tokenizer()
    fake, glob = tok.convert_tokens_to_ids(["<fake_token_around_image>", "<global-img>"])
    spans = []
    for i in range(len(token_ids) - 1):
        if token_ids[i] == fake and token_ids[i + 1] == glob:
            end = token_ids.index(fake, i + 1) + 1
            spans.append((i, end))
    return spans


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from orbitkv.models.make_model import make_model

    model_dir = make_model(tmp_path_factory.mktemp("model") / "smolvlm", "smolvlm")
    # make_model's seeded weights, not vLLM's dummy ones: with dummy weights every prompt decodes
    # to the same two-token loop, so comparing greedy outputs would prove nothing.
    with start_engine(model_dir, load_format="auto", limit_mm_per_prompt={"image": 3}) as eng:
        yield eng


def test_image_survives_a_sliding_window(engine):
    img1, img2 = _image(1), _image(2)
    first, first_blocks = engine.run(
        _request(
            SYSTEM + "User:<image><image>What changed?<end_of_utterance>\nAssistant:", [img1, img2],
            cache_salt="agent-1",
        ),
        max_tokens=4,
    )
    assert summary(first)["num_saved_chunks"] == summary(first)["num_chunks"]
    engine.poison(first_blocks)

    second = _request(
        SYSTEM + "User:<image>What is new?<end_of_utterance>\nAssistant:", [img2], cache_salt="agent-1"
    )
    served, served_blocks = engine.run(second, OPT_IN, max_tokens=4)
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


def test_exact_repeat_of_three_images_computes_only_the_last_token(engine):
    system = "<|im_start|>System: you compare three pictures in order.<end_of_utterance>\n"
    prompt = _request(
        system + "User:<image><image><image>Describe them.<end_of_utterance>\nAssistant:",
        [_image(11), _image(12), _image(13)],
    )
    ref, _ = engine.run(prompt, OFF, max_tokens=32)
    assert_informative(ref)
    first, first_blocks = engine.run(prompt, max_tokens=32)
    ids = list(first.prompt_token_ids)
    n = len(ids)
    spans = _image_spans(engine, ids)
    # Chunks: the text before the images, img1, img2, img3 (adjacent), the query.
    assert len(spans) == 3 and spans[1][0] == spans[0][1] and spans[2][0] == spans[1][1]
    query_start = spans[2][1]
    assert summary(first)["num_reused_tokens"] == 0 and first.num_cached_tokens == 0
    assert summary(first)["num_chunks"] == summary(first)["num_saved_chunks"] == 5
    want = [engine.kv(first_blocks, 0, n - 1, layer) for layer in range(4)]
    engine.poison(first_blocks)

    second, second_blocks = engine.run(prompt, max_tokens=32)
    # Everything the model saw before (text, all three images, the query up to its last token)
    # comes from the store at its own position; vLLM computes the prompt's last token only.
    assert summary(second)["reused_tokens_by_mode"] == {"exact": n - 1}
    assert summary(second)["num_failed_load_tokens"] == 0
    assert second.num_cached_tokens == n - 1 > query_start
    assert len(ref.outputs[0].token_ids) == 32 and len(set(ref.outputs[0].token_ids)) > 8
    assert ref.outputs[0].token_ids == first.outputs[0].token_ids == second.outputs[0].token_ids
    for layer, (k1, v1) in enumerate(want):
        k2, v2 = engine.kv(second_blocks, 0, n - 1, layer)
        assert torch.equal(k1, k2) and torch.equal(v1, v2), f"layer {layer}"


def test_sliding_window_serves_surviving_images_relocated(engine):
    system = "<|im_start|>System: you follow a window of pictures.<end_of_utterance>\n"
    img1, img2, img3, img4 = (_image(20 + i) for i in range(4))
    template = system + "User:<image><image><image>{}<end_of_utterance>\nAssistant:"
    first, first_blocks = engine.run(
        _request(template.format("What do you see?"), [img1, img2, img3], "agent-2"), max_tokens=4
    )
    assert summary(first)["num_saved_chunks"] == summary(first)["num_chunks"] == 5
    old = _image_spans(engine, list(first.prompt_token_ids))
    k_stored_img2 = engine.kv(first_blocks, *old[1], 0)[0]
    stored = engine.kv_layers(first_blocks, old[1][0], old[2][1])
    engine.poison(first_blocks)

    second = _request(template.format("And now?"), [img2, img3, img4], "agent-2")
    served, served_blocks = engine.run(second, OPT_IN, max_tokens=4)
    new = _image_spans(engine, list(served.prompt_token_ids))
    text_len = new[0][0]  # the system line and "User:", one text chunk at the same offset
    assert text_len == old[0][0] <= 32
    img_len = new[0][1] - new[0][0]
    # img2 and img3 moved up by one image; img4 and the query are new, so vLLM computes them.
    assert summary(served)["reused_tokens_by_mode"] == {"exact": text_len, "survivor": 2 * img_len}
    assert served.num_cached_tokens == new[2][0] == text_len + 2 * img_len
    assert len(served.prompt_token_ids) - served.num_cached_tokens > img_len

    begin, end = new[0][0], new[1][1]  # the two served images
    k_got, v_got = engine.kv(served_blocks, 0, end, 0)
    # Every layer of both images is their stored KV moved up by one image.
    assert_loaded_as_relocated(engine, engine.kv_layers(served_blocks, begin, end), stored, -img_len)
    engine.poison(served_blocks)
    ref, ref_blocks = engine.run(second, OFF, max_tokens=4)
    assert summary(ref)["num_reused_tokens"] == 0 and ref.num_cached_tokens == 0
    k_want, v_want = engine.kv(ref_blocks, 0, end, 0)
    assert_relocated_like_prefill(k_got[begin:], k_want[begin:], v_got[begin:], v_want[begin:])
    # The text chunk was served exactly where it was computed: bit-equal, nothing rotated.
    assert torch.equal(k_got[:begin], k_want[:begin]) and torch.equal(v_got[:begin], v_want[:begin])
    # img2 moved by img_len positions: its keys as stored are far from the relocated ones.
    moved = k_want[new[0][0] : new[0][1]]
    diff = (k_stored_img2.float() - moved.float()).abs()
    assert (diff / bf16_ulp(pair_magnitude(moved))).max() > 16


def test_rotated_window_transfers_images_from_their_old_window(engine):
    """[img1, img2, img3] -> [img3, img1, img2]: img1 and img2 now sit behind img3, where they were
    never computed. With transfer allowed they are their old entries relocated (img3 is a
    survivor); without it, and for a request that does not opt in, vLLM computes them."""
    system = "<|im_start|>System: you follow a rotating window.<end_of_utterance>\n"
    img1, img2, img3 = (_image(40 + i) for i in range(3))
    template = system + "User:<image><image><image>{}<end_of_utterance>\nAssistant:"
    first, first_blocks = engine.run(
        _request(template.format("What do you see?"), [img1, img2, img3], "agent-3"), max_tokens=4
    )
    old = _image_spans(engine, list(first.prompt_token_ids))
    stored = engine.kv_layers(first_blocks, old[0][0], old[1][1])  # img1, img2
    engine.poison(first_blocks)

    rotated = template.format("And in this order?")
    transfer = {"orbitkv": {"modes": {"transfer": True}, "approximate": True}}
    served, served_blocks = engine.run(
        _request(rotated, [img3, img1, img2], "agent-3"), transfer, max_tokens=4,
        keep_prefix_cache=False,
    )
    new = _image_spans(engine, list(served.prompt_token_ids))
    text_len, img_len = new[0][0], new[0][1] - new[0][0]
    assert summary(served)["reused_tokens_by_mode"] == {
        "exact": text_len, "survivor": img_len, "transfer": 2 * img_len
    }
    assert summary(served)["approximate_from"] == text_len
    got = engine.kv_layers(served_blocks, new[1][0], new[2][1])
    assert_loaded_as_relocated(engine, got, stored, new[1][0] - old[0][0])
    engine.poison(served_blocks)

    # Not allowed, or not opted in (a salt does not opt in): the images are computed, exactly.
    ref, _ = engine.run(_request(rotated, [img3, img1, img2]), OFF, max_tokens=4)
    named = {"orbitkv": {"modes": {"transfer": True}}}
    for request, params in ((_request(rotated, [img3, img1, img2], "agent-3"), OPT_IN),
                            (_request(rotated, [img3, img1, img2], "agent-3"), named)):
        out, _ = engine.run(request, params, max_tokens=4, keep_prefix_cache=False)
        modes = summary(out)["reused_tokens_by_mode"]
        assert "transfer" not in modes and summary(out)["num_reused_tokens"] < text_len + img_len * 3
        if params is named:
            assert set(modes) <= {"exact"} and out.outputs[0].token_ids == ref.outputs[0].token_ids


def test_image_hole_behind_fresh_text_skips_the_encoder(engine):
    """``[sys, fresh text, cached image, fresh text, cached text, question]``: the image and the
    text behind the fresh spans are loaded (exact holes), the vision encoder never runs for the
    image (counted by OrbitKV and, independently, at the model runner), and tokens and KV of all
    layers equal a run with the connector off."""
    words = " ".join(f"w{i}" for i in range(60))
    text = (
        SYSTEM
        + "User: first look at this picture carefully please "
        + "<image>"
        + f"Then read these notes: {words} and answer.<end_of_utterance>\nAssistant:"
    )
    prompt = _request(text, [_image(31)])
    ref, ref_blocks = engine.run(prompt, OFF, max_tokens=16)
    assert_informative(ref)
    n = len(ref.prompt_token_ids)
    want = [engine.kv(ref_blocks, 0, n - 1, layer) for layer in range(4)]
    engine.poison(ref_blocks)
    first, first_blocks = engine.run(prompt, max_tokens=16)
    chunks = engine.last_chunks
    (image,) = [c for c in chunks if c.is_mm]
    before = [c for c in chunks if c.end <= image.start]
    after = [c for c in chunks if c.start >= image.end]
    assert len(before) >= 2 and len(after) >= 3, [(c.start, c.end) for c in chunks]
    # Fresh: the text right before the image and the first text chunk after it.
    from orbitkv.store.keys import conditioned_key

    fresh = [before[-1], after[0]]
    flush(engine)
    engine.sched_connector.store.delete(
        [conditioned_key(c.cid, c.antecedent_hash) for c in fresh]
    )
    engine.poison(first_blocks)

    runner = engine.model_runner
    batch = runner._batch_mm_inputs_from_scheduler
    encoded: list[str] = []

    def spy(scheduler_output):
        mm_hashes, mm_kwargs, *rest = batch(scheduler_output)
        encoded.extend(mm_hashes)
        return (mm_hashes, mm_kwargs, *rest)

    runner._batch_mm_inputs_from_scheduler = spy
    try:
        second, blocks = engine.run(prompt, max_tokens=16)
    finally:
        del runner._batch_mm_inputs_from_scheduler
    got = summary(second)
    holes = [image] + after[1:-1]
    assert got["num_hole_tokens"] == sum(c.length for c in holes)
    assert got["reused_tokens_by_mode"] == {
        "exact": sum(c.length for c in before[:-1] + holes)
    }
    assert got["num_mm_items"] == 1 and got["num_encoded_items"] == 0
    assert encoded == []
    assert second.outputs[0].token_ids == ref.outputs[0].token_ids
    for layer, (k_want, v_want) in enumerate(want):
        k_got, v_got = engine.kv(blocks, 0, n - 1, layer)
        assert torch.equal(k_got, k_want) and torch.equal(v_got, v_want), f"layer {layer}"
