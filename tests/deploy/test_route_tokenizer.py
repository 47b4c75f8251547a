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


def test_the_front_trusts_its_tokenizer_after_agreeing_checks_and_drops_it_on_a_mismatch(tiny_qwen2):
    """A replica's ``/tokenize`` here is a small HTTP endpoint answering with the model's own
    tokenizer (``shift`` makes it disagree): the front asks it until its own tokenizer agreed
    ``NUM_TOKENIZER_CHECKS`` times, then stops asking; a disagreement turns its tokenizer off."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from orbitkv.routing.front import RoutingFront
    from orbitkv.routing.scorer import ChunkSetScorer

    path = str(tiny_qwen2 / "qwen2")
    hf = AutoTokenizer.from_pretrained(path)
    state = {"shift": 0, "num_asked": 0}

    class Replica(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            text = hf.apply_chat_template(body["messages"], tokenize=False, add_generation_prompt=True)
            ids = [t + state["shift"] for t in hf(text, add_special_tokens=False)["input_ids"]]
            state["num_asked"] += 1
            data = json.dumps({"tokens": ids}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Replica)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        front = RoutingFront(ChunkSetScorer(16), [url], "http://router", "chunk_set",
                             tokenizer=LocalTokenizer(path))
        body = {"messages": [{"role": "user", "content": "open the file"}]}
        want = front.tokenize(CHAT, body)
        for _ in range(front.NUM_TOKENIZER_CHECKS + 2):
            assert front.tokenize(CHAT, body) == want
        assert state["num_asked"] == front.NUM_TOKENIZER_CHECKS  # then the front's own ids
        # A template the replica renders differently: one mismatch, the replica's ids from then on.
        other = RoutingFront(ChunkSetScorer(16), [url], "http://router", "chunk_set",
                             tokenizer=LocalTokenizer(path))
        state["shift"] = 1
        assert other.tokenize(CHAT, body) == [t + 1 for t in want]
        assert other.tokenizer is None
        metrics = other.metrics().decode()
        assert 'orbitkv_router_tokenize_total{source="mismatch"} 1.0' in metrics
    finally:
        server.shutdown()
