"""The routing front's own tokenizer: the prompt's token ids without a round trip to a replica.

vLLM's ``/tokenize`` on a replica costs the front an HTTP call and the replica a chat-template
render on the cores it serves from, for every request (llm-d tokenizes in its scheduler for the
same reason). With the model's tokenizer (``--tokenizer``: the model directory the replicas serve)
the front renders text-only chats and completions itself, as vLLM does: a chat is rendered by the
model's chat template and encoded without special tokens; a completion prompt is encoded with them.
A chat with content parts (images, audio), tools or a chat template of the client's own, and any
render that raises, goes to a replica's ``/tokenize`` as before (``encode`` returns None).

The front checks the first requests it tokenizes locally against a replica's ``/tokenize``
(``front.RoutingFront.tokenize``): one mismatch turns the local tokenizer off for good, logged, so
a template vLLM renders differently costs routing quality never, only the round trip.
"""

from __future__ import annotations

import threading
from typing import Any


class LocalTokenizer:
    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._tokenizer: Any = None

    def _get(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                from transformers import AutoTokenizer

                self._tokenizer = AutoTokenizer.from_pretrained(self.path)
            return self._tokenizer

    def encode(self, path: str, body: dict[str, Any]) -> list[int] | None:
        """The token ids vLLM's ``/tokenize`` would give for this request, or None where this
        front does not render it itself (see the module doc)."""
        if path == "/v1/chat/completions":
            messages = body.get("messages")
            if (not isinstance(messages, list) or not messages or body.get("tools")
                    or body.get("chat_template")
                    or not all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages)):
                return None
            kwargs = dict(body.get("chat_template_kwargs") or {})
            tok = self._get()
            text = tok.apply_chat_template(
                messages, tokenize=False,
                add_generation_prompt=bool(body.get("add_generation_prompt", True)),
                continue_final_message=bool(body.get("continue_final_message", False)), **kwargs,
            )
            return list(tok(text, add_special_tokens=False)["input_ids"])
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        if isinstance(prompt, str):
            return list(self._get()(prompt, add_special_tokens=True)["input_ids"])
        return None
