"""``chat_anchor_tokens``: the tokens a chat template writes before a lone user turn's content, for
a multimodal template (SmolVLM's parts) and a text-only one (the real SmolLM2's string content),
checked against the ids of a whole rendered chat."""

from __future__ import annotations

from pathlib import Path

import pytest

from orbitkv.serving.anchor import chat_anchor_tokens

RECORD = ("Record 7. Name: Alice Moreau. City: Lisbon. Colour: teal. Code: 315. "
          "She keeps the archive keys.")


def _assert_anchor_precedes_content(model_dir: Path, content) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    anchor = chat_anchor_tokens(model_dir)
    full = list(tok.apply_chat_template([{"role": "user", "content": content}], tokenize=True,
                                        add_generation_prompt=True, return_dict=True)["input_ids"])
    record_ids = tok(RECORD, add_special_tokens=False)["input_ids"]
    assert full[: len(anchor)] == anchor
    # What follows the anchor is the user's content, and only it (tokenized on its own).
    assert full[len(anchor) : len(anchor) + len(record_ids)] == record_ids
    return anchor


def test_text_only_template_of_the_real_model() -> None:
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    from orbitkv.models import smollm2

    try:
        model_dir = smollm2.smollm2_checkpoint()
    except FileNotFoundError as exc:  # the `real` extra is not installed
        pytest.skip(str(exc))
    anchor = _assert_anchor_precedes_content(model_dir, RECORD)
    from transformers import AutoTokenizer

    text = AutoTokenizer.from_pretrained(str(model_dir)).decode(anchor)
    # SmolLM2's template adds its default system turn before a lone user turn.
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_end|>\n<|im_start|>user\n")


def test_multimodal_template_keeps_the_shared_prefix(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from orbitkv.models.make_model import make_model

    model_dir = make_model(tmp_path / "smolvlm", "smolvlm", weights=False)
    anchor = chat_anchor_tokens(model_dir)
    # Text content follows "User: ", an image "User:": the anchor stops at the colon.
    assert AutoTokenizer.from_pretrained(str(model_dir)).decode(anchor) == "<|im_start|>User:"
    full = AutoTokenizer.from_pretrained(str(model_dir)).apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": RECORD}]}],
        tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert list(full[: len(anchor)]) == anchor
