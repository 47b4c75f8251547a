"""``AgentWindow``: an agent's window of items over any OpenAI-compatible vLLM server with OrbitKV.

An item is an image (a PNG/JPEG as bytes or a data URL) with an optional text observation. The
window is the ordered list of items the next request shows; the client edits it the way an agent
does (``slide``, ``reorder``, ``drop``, ``recall``) and ``ask`` sends the system text, the window's
items in order and a question, returning the answer with OrbitKV's reuse summary. ``register``
canonicalizes an item once (``kv_transfer_params={"orbitkv": {"role": "canonicalize"}}``): the
server stores the item's canonical KV, so patches can be formed for it and it can be served behind
any antecedent. It is a no-op for an item already stored.

Standard library only (``http.client``): usable from any agent runtime.
"""

from __future__ import annotations

import base64
import http.client
import json
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit


@dataclass
class Item:
    item_id: str
    image_url: str | None = None  # a data: or http(s): URL
    text: str = ""  # an observation shown after the image (or the item itself, without one)


@dataclass
class Reply:
    answer: str
    summary: dict[str, Any] | None  # kv_transfer_params["orbitkv"]: reused tokens by mode, holes
    usage: dict[str, Any] = field(default_factory=dict)
    latency_s: float = 0.0

    @property
    def reused_tokens_by_mode(self) -> dict[str, int]:
        return dict((self.summary or {}).get("reused_tokens_by_mode") or {})


def image_data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


class AgentWindow:
    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        system: str | None = None,
        max_tokens: int = 16,
        timeout_s: float = 600.0,
        kv_transfer_params: dict[str, Any] | None = None,
        session: str | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        # vLLM's cache_salt for every request of this window: the agent's own namespace. It does not
        # opt in to approximate KV: kv_transfer_params {"orbitkv": {"approximate": true}} does.
        self.session = session
        self.model = model
        self.system = system
        self.max_tokens = max_tokens
        self.timeout_s = timeout_s
        self.kv_transfer_params = kv_transfer_params
        self.items: dict[str, Item] = {}
        self.window: list[str] = []
        self.evicted: list[str] = []

    # -- items -----------------------------------------------------------------------------------

    def add_item(self, item_id: str, *, image: bytes | str | None = None, text: str = "") -> Item:
        url = image_data_url(image) if isinstance(image, bytes) else image
        item = Item(item_id, url, text)
        self.items[item_id] = item
        return item

    def register(self, item_id: str, *, chunk_boundaries: list[int] | None = None) -> dict[str, Any]:
        """Canonicalize an item: one request over the item alone, as the first thing after the
        server's anchor. Returns the server's answer (``status``: formed / already stored / error).
        ``chunk_boundaries``: where a text item ends (token offsets), so that the chunk after the
        anchor is the item alone and not the item with the chat template's tail."""
        item = self.items[item_id]
        body = self._body([{"role": "user", "content": self._content([item])}], max_tokens=1)
        options: dict[str, Any] = {"role": "canonicalize"}
        if chunk_boundaries:
            options["chunk_boundaries"] = list(chunk_boundaries)
        body["kv_transfer_params"] = {"orbitkv": options}
        reply = self._post(body)
        outcome = (reply.summary or {}).get("canonicalize")
        if outcome is None:
            return {"status": "error", "error": "the server returned no OrbitKV summary"}
        return outcome

    # -- the window --------------------------------------------------------------------------------

    def slide(self, item_id: str, *, size: int | None = None) -> None:
        """Append an item; with ``size``, the oldest items leave to keep the window at that size."""
        self._need(item_id)
        self.window.append(item_id)
        while size is not None and len(self.window) > size:
            self.evicted.append(self.window.pop(0))

    def reorder(self, order: list[str]) -> None:
        if sorted(order) != sorted(self.window):
            raise ValueError(f"reorder needs the window's items {self.window}, got {order}")
        self.window = list(order)

    def drop(self, item_id: str) -> None:
        self.window.remove(item_id)
        self.evicted.append(item_id)

    def recall(self, item_id: str, *, replace: str | None = None) -> None:
        """Bring an evicted item back at the end (optionally in place of ``replace``)."""
        if item_id not in self.evicted:
            raise ValueError(f"{item_id!r} was not evicted")
        self.evicted.remove(item_id)
        if replace is not None:
            self.drop(replace)
        self.window.append(item_id)

    # -- requests ----------------------------------------------------------------------------------

    def messages(self, question: str) -> list[dict[str, Any]]:
        content = self._content([self.items[i] for i in self.window])
        content.append({"type": "text", "text": question})
        out: list[dict[str, Any]] = []
        if self.system is not None:
            out.append({"role": "system", "content": self.system})
        out.append({"role": "user", "content": content})
        return out

    def ask(self, question: str, **params: Any) -> Reply:
        body = self._body(self.messages(question), **params)
        if self.kv_transfer_params is not None:
            body["kv_transfer_params"] = self.kv_transfer_params
        return self._post(body)

    def _content(self, items: list[Item]) -> list[dict[str, Any]]:
        content: list[dict[str, Any]] = []
        for item in items:
            if item.image_url:
                content.append({"type": "image_url", "image_url": {"url": item.image_url}})
            if item.text:
                content.append({"type": "text", "text": item.text})
        return content

    def _body(self, messages: list[dict[str, Any]], **params: Any) -> dict[str, Any]:
        body = {"model": self.model, "messages": messages, "max_tokens": self.max_tokens,
                "temperature": 0.0, **params}
        if self.session:
            body["cache_salt"] = self.session
        return body

    def _need(self, item_id: str) -> None:
        if item_id not in self.items:
            raise KeyError(f"unknown item {item_id!r}: add_item() it first")

    def _post(self, body: dict[str, Any]) -> Reply:
        parts = urlsplit(self.base_url)
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=self.timeout_s)
        started = time.perf_counter()
        try:
            conn.request("POST", "/v1/chat/completions", json.dumps(body),
                         {"Content-Type": "application/json"})
            resp = conn.getresponse()
            data = json.loads(resp.read() or b"{}")
        finally:
            conn.close()
        if resp.status != 200:
            raise RuntimeError(f"/v1/chat/completions HTTP {resp.status}: {str(data)[:500]}")
        choice = (data.get("choices") or [{}])[0]
        summary = (data.get("kv_transfer_params") or {}).get("orbitkv")
        return Reply(
            answer=(choice.get("message") or {}).get("content") or "",
            summary=summary if isinstance(summary, dict) else None,
            usage=data.get("usage") or {},
            latency_s=time.perf_counter() - started,
        )
