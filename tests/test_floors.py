"""The floors of a run (``orbitkv.agent.floors``) on small synthetic traces, against counts made
independently from the trace's parts; and the ``recurring`` trace's properties.

The tokenizer here stands in for the server's ``/tokenize`` (which the vLLM tests call): one id per
word and a fixed number of placeholder ids per image, so every part's token count is known."""

from __future__ import annotations

import zlib

import pytest

from orbitkv.agent import floors
from orbitkv.agent.workload import (
    OBSERVE,
    RECALL,
    REORDER,
    SLIDE,
    START,
    chat_messages,
    image_data_url,
    make_fresh_workload,
    make_recurring_workload,
    make_workload,
    observation_text,
)

IMAGE_ID = 7
PER_IMAGE = 5  # placeholders per image, wrapped in two marker tokens


def _word(w: str) -> int:
    return 100 + zlib.crc32(w.encode()) % 100_000


def word_tokenize(messages: list[dict]) -> list[int]:
    system, user = messages
    ids = [1, *(_word(w) for w in system["content"].split()), 2]
    for part in user["content"]:
        if part["type"] == "text":
            ids += [_word(w) for w in part["text"].split()]
        else:
            ids += [3, *[IMAGE_ID] * PER_IMAGE, 4]
    return ids + [5, 6]


def _words(text: str) -> int:
    return len(text.split())


def independent_content_floor(w, step, *, is_first: bool) -> int:
    """Fresh parts counted one by one from the trace."""
    if is_first:
        return len(word_tokenize(chat_messages(w, step)))
    num = _words(step.tool_text) + _words(step.question)
    for image_id in step.new_images:
        num += 2 + PER_IMAGE + _words(observation_text(w.seed, image_id, w.obs_words))
    return num


def independent_exact_floors(run) -> list[int]:
    """Tokens built from the parts, each marked fresh or not (the fresh parts as the content floor
    counts them); a token must be computed if it is fresh, comes after a fresh one, or its prefix
    (with it) was in no earlier prompt."""
    seen_prefixes: set[tuple] = set()
    out = []
    for i, (w, step) in enumerate(run):
        system, user = chat_messages(w, step)
        tokens = [(t, i == 0) for t in [1, *(_word(x) for x in system["content"].split()), 2]]
        fresh_texts = {step.tool_text + "\n", step.question}
        fresh_texts |= {observation_text(w.seed, j, w.obs_words) + "\n" for j in step.new_images}
        for part in user["content"]:
            if part["type"] == "text":
                is_fresh = i == 0 or part["text"] in fresh_texts
                tokens += [(_word(x), is_fresh) for x in part["text"].split()]
            else:
                url = part["image_url"]["url"]
                is_fresh = i == 0 or any(url == image_data_url(w.seed, j, w.image_size) for j in step.new_images)
                tokens += [(3, is_fresh), *[((url, k), is_fresh) for k in range(PER_IMAGE)], (4, is_fresh)]
        tokens += [(5, i == 0), (6, i == 0)]
        ids = tuple(t for t, _ in tokens)
        first_fresh = next((p for p, (_, f) in enumerate(tokens) if f), len(tokens))
        must = [p >= first_fresh or ids[: p + 1] not in seen_prefixes for p in range(len(ids))]
        out.append(max(1, sum(must)))
        seen_prefixes |= {ids[: p + 1] for p in range(len(ids))}
    return out


@pytest.mark.parametrize("trace", ["basic", "recurring", "fresh"])
def test_floors_against_an_independent_count(trace):
    if trace == "basic":
        workloads = [make_workload(seed=s, window=3, num_steps=6, obs_words=4, tool_words=5) for s in (0, 1)]
    elif trace == "fresh":
        workloads = [make_fresh_workload(seed=s, window=3, num_steps=4, obs_words=4, tool_words=5) for s in (0, 1)]
    else:
        workloads = [make_recurring_workload(seed=s, obs_words=4, tool_words=5) for s in (0, 1)]
    got = floors.run_floors(word_tokenize, workloads, IMAGE_ID)
    run = [(w, step) for w in workloads for step in w.steps]
    assert [(f.episode, f.step) for f in got] == [(e, s.index) for e, w in enumerate(workloads) for s in w.steps]
    want_exact = independent_exact_floors(run)
    for i, (f, (w, step)) in enumerate(zip(got, run, strict=True)):
        assert f.prompt_tokens == len(word_tokenize(chat_messages(w, step)))
        assert f.content_floor_tokens == independent_content_floor(w, step, is_first=i == 0), (f, step)
        assert f.exact_floor_tokens == want_exact[i], (f, step)
        assert f.exact_floor_tokens >= f.content_floor_tokens
        assert f.num_new_images == len(step.new_images)
    if trace == "fresh":
        # Nothing to reuse but the system text: after the first step every step's exact floor is
        # its prompt less the same prefix, all a prefix cache needs.
        assert len({f.prompt_tokens - f.exact_floor_tokens for f in got[1:]}) == 1
        assert got[1].prompt_tokens - got[1].exact_floor_tokens < got[1].prompt_tokens // 2
    first, second = got[0], got[len(workloads[0].steps)]
    assert first.exact_floor_tokens == first.content_floor_tokens == first.prompt_tokens
    # The second episode's start step: new images, but the system text was computed before.
    assert second.exact_floor_tokens < second.prompt_tokens


def test_exact_floor_by_hand():
    a, b, c = ("a", 0), ("b", 0), ("c", 0)
    prompts = [[1, 2, a, 3, b, 9], [1, 2, a, 3, b, 8], [1, 2, b, 3, a, 9], [1, 2, a, 3, c, 9],
               [1, 2, a, 3, b, 9], [1, 2, a, 3, b, 8, 7]]
    fresh = [0, None, None, 4, None, 5]
    # 2nd: only the last token changed; 3rd: reordered from the first image on; 4th: a new image
    # behind a seen antecedent; 5th: a repeat (vLLM still computes one token); 6th: fresh text
    # that starts like an earlier prompt's is still fresh.
    assert floors.exact_floors(prompts, fresh) == [6, 1, 4, 2, 1, 2]
    assert floors.common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2


def test_tag_images_splits_placeholders_per_image():
    ids = [1, IMAGE_ID, IMAGE_ID, 2, IMAGE_ID, IMAGE_ID, 3]
    assert floors.tag_images(ids, IMAGE_ID, ["p", "q"]) == [1, ("p", 0), ("p", 1), 2, ("q", 0), ("q", 1), 3]
    with pytest.raises(ValueError, match="do not split"):
        floors.tag_images(ids, IMAGE_ID, ["p", "q", "r"])
    with pytest.raises(ValueError, match="without images"):
        floors.tag_images(ids, IMAGE_ID, [])
    with pytest.raises(ValueError, match="distinct seeds"):
        floors.run_floors(word_tokenize, [make_workload(seed=1), make_workload(seed=1)], IMAGE_ID)


def test_recurring_trace_brings_the_window_operations_back():
    w = make_recurring_workload(obs_words=4, tool_words=5)
    kinds = [s.kind for s in w.steps]
    assert w.window >= 4 and len(w.steps) >= 12 and kinds[0] == START
    assert {SLIDE, REORDER, RECALL, OBSERVE} <= set(kinds)
    seen: set[int] = set()
    orders_by_set: dict[frozenset, list[tuple[int, ...]]] = {}
    recalls: dict[tuple, int] = {}
    window = w.steps[0].images
    for prev, step in zip(w.steps, w.steps[1:], strict=False):
        seen |= set(prev.images)
        assert not set(step.new_images) & seen
        if step.kind == REORDER:
            assert sorted(step.images) == sorted(window) and step.images != window
            orders_by_set.setdefault(frozenset(step.images), []).append(step.images)
        if step.kind == RECALL:
            back, before = step.images[-1], step.images[:-1]
            assert before == window and back in seen and back not in window
            recalls[(back, before)] = recalls.get((back, before), 0) + 1
        else:
            window = step.images
        if step.kind == OBSERVE:
            assert step.images == prev.images[: len(step.images)] and not step.new_images
    # A set reordered at least twice, into orders not seen before.
    assert any(len(set(orders)) >= 2 for orders in orders_by_set.values())
    first_order = {frozenset(s.images): s.images for s in reversed(w.steps) if s.kind != REORDER}
    for key, orders in orders_by_set.items():
        assert first_order.get(key) not in orders
    # An image recalled at least twice behind the same antecedent (the same window before it).
    assert max(recalls.values()) >= 2
    # Observations between images, and the tool output right before the question.
    for step in w.steps:
        parts = chat_messages(w, step)[1]["content"]
        types = [p["type"] for p in parts]
        assert "image_url,image_url" not in ",".join(types)
        assert parts[-2]["text"].startswith("[tool output") and parts[-1]["text"] == step.question


def test_recurring_trace_rejects_shapes_without_its_operations():
    with pytest.raises(ValueError, match="window"):
        make_recurring_workload(window=2)
    with pytest.raises(ValueError, match="num_steps"):
        make_recurring_workload(num_steps=9)
    longer = make_recurring_workload(window=5, num_steps=30)
    assert len(longer.steps) == 30 and all(len(s.images) in (5, 6) for s in longer.steps)
