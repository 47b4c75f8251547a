"""kv-router's own tokenizer (``--tokenizer``): what it renders itself, and what it leaves to a
replica's ``/tokenize``. That its ids equal vLLM's is checked live by the front against a replica
(``test_fleet_routing.py``, real vLLM)."""

from __future__ import annotations

from transformers import AutoTokenizer

from orbitkv.routing.local_tokenizer import LocalTokenizer

CHAT = "/v1/chat/completions"


def test_text_chats_and_completions_are_rendered_as_vllm_renders_them(tiny_qwen2):
    path = str(tiny_qwen2 / "qwen2")
    local, hf = LocalTokenizer(path), AutoTokenizer.from_pretrained(path)
    messages = [{"role": "system", "content": "You are team 1."},
                {"role": "user", "content": "Screenshot 0: open file\nRole: planner. why?"}]
    ids = local.encode(CHAT, {"messages": messages})
    # vLLM renders the template to text, then encodes it without adding special tokens.
    text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ids == hf(text, add_special_tokens=False)["input_ids"] and len(ids) > 10
    assert local.encode(CHAT, {"messages": messages, "add_generation_prompt": False}) != ids
    # A completion's prompt is encoded with the tokenizer's special tokens; ids pass through.
    assert local.encode("/v1/completions", {"prompt": "open file"}) == hf("open file")["input_ids"]
    assert local.encode("/v1/completions", {"prompt": [5, 6, 7]}) == [5, 6, 7]


def test_what_it_does_not_render_goes_to_a_replica(tiny_qwen2):
    local = LocalTokenizer(str(tiny_qwen2 / "qwen2"))
    parts = [{"role": "user", "content": [{"type": "text", "text": "hi"},
                                          {"type": "image_url", "image_url": {"url": "data:,"}}]}]
    text = [{"role": "user", "content": "hi"}]
    assert local.encode(CHAT, {"messages": parts}) is None  # content parts: images, audio
    assert local.encode(CHAT, {"messages": text, "tools": [{"type": "function"}]}) is None
    assert local.encode(CHAT, {"messages": text, "chat_template": "{{ messages }}"}) is None
    assert local.encode(CHAT, {"messages": []}) is None
    assert local.encode("/v1/completions", {"prompt": None}) is None
