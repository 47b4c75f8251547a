"""The anchor of a chat model: the tokens its chat template puts before a lone user turn's content.

A canonical is a chunk's KV right after a fixed, short anchor. For a chat model served through the
OpenAI API every prompt goes through the chat template, so the natural anchor is what the template
writes before the first content of a user turn (SmolVLM: ``<|im_start|>User:``; SmolLM2, a
text-only template: its default system turn, then ``<|im_start|>user\n``): a canonicalize
request (``AgentWindow.register``: one user turn holding only the item) then puts the item right
after it. Configure the server with ``anchor_tokens`` set to these ids.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

# A private-use character: no chat template writes it, and a tokenizer keeps it apart.
_MARK = "\ue000"


def chat_anchor_tokens(model_dir: str | Path) -> list[int]:
    """Token ids the model's chat template writes before a user turn's content."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))

    def render(content: str | list[dict]) -> str:
        return tok.apply_chat_template(
            [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
        )

    # A text-only template (SmolLM2's) concatenates the content as a string, and vLLM hands it a
    # string; a multimodal one (SmolVLM's) walks a list of parts and writes nothing for a string.
    text = _render_or_none(render, _MARK)
    if text is None or _MARK not in text:
        text = _render_or_none(render, [{"type": "text", "text": _MARK}])
    if text is None or _MARK not in text:
        raise ValueError(f"the chat template of {model_dir} drops the user's content")
    prefix = text[: text.index(_MARK)]
    # Templates may write text content after a space and an image right after the colon: the
    # anchor is what both renderings share. A text-only template has no image rendering.
    with_image = _render_or_none(render, [{"type": "image"}])
    if with_image is not None:
        common = next((i for i, (a, b) in enumerate(zip(prefix, with_image, strict=False)) if a != b), len(prefix))
        prefix = prefix[:common]
    return list(tok(prefix, add_special_tokens=False)["input_ids"])


def _render_or_none(render: Callable[[Any], str], content: Any) -> str | None:
    try:
        return render(content)
    except Exception:  # the template does not take content of this shape
        return None
