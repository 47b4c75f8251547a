"""``orbitkv.client.AgentWindow`` against a real vLLM OpenAI server with OrbitKV (tiny SmolVLM)."""

from __future__ import annotations

import pytest

from orbitkv.client import AgentWindow

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from orbitkv.agent.demo import ensure_model, store_config
    from orbitkv.serving.anchor import chat_anchor_tokens
    from orbitkv.serving.server_process import model_server

    root = tmp_path_factory.mktemp("client")
    model_dir = ensure_model(root / "models")
    # The client's mechanism (dummy weights: nothing about answers), so the modes are uncalibrated.
    extra = {**store_config(root / "store"),
             "orbitkv": {"anchor_tokens": chat_anchor_tokens(model_dir), "approximate_reuse": "request",
                         "require_calibration": False}}
    srv = model_server(model_dir, "orbitkv", root / "server.log", extra_config=extra,
                       max_images=4, startup_timeout_s=300)
    with srv:
        yield srv


def _window(server) -> AgentWindow:
    from orbitkv.agent.workload import image_png
    from orbitkv.serving.http_client import first_model_id

    # One agent session (its cache salt), opted in to approximate KV.
    win = AgentWindow(server.base_url, first_model_id(server.base_url),
                      system="You watch a desktop.", max_tokens=2, session="desktop-agent",
                      kv_transfer_params={"orbitkv": {"approximate": True}})
    for i in range(5):
        win.add_item(f"s{i}", image=image_png(3, i), text=f"[screen {i}] a window and a button")
    return win


def test_register_is_once_and_malformed_is_an_error(server):
    win = _window(server)
    assert win.register("s0")["status"] == "formed"
    assert win.register("s0")["status"] == "already stored"
    # Two items in one canonicalize request: not [anchor . item], answered with an error.
    win.items["pair"] = win.items["s1"]
    body = win._body([{"role": "system", "content": "x"},
                      {"role": "user", "content": win._content([win.items["s1"], win.items["s2"]])}],
                     max_tokens=1)
    body["kv_transfer_params"] = {"orbitkv": {"role": "canonicalize"}}
    outcome = win._post(body).summary["canonicalize"]
    assert outcome["status"] == "error" and "anchor" in outcome["error"]


def test_window_operations_and_their_reuse(server):
    win = _window(server)
    for item in ("s1", "s2", "s3", "s4"):
        assert win.register(item)["status"] in ("formed", "already stored")
    for item in ("s1", "s2", "s3"):
        win.slide(item, size=3)
    first = win.ask("What changed?")
    assert first.summary["num_saved_chunks"] > 0
    win.slide("s4", size=3)  # s1 leaves: s2, s3 and their observations survive, relocated
    slid = win.ask("What changed?")
    assert slid.reused_tokens_by_mode.get("survivor", 0) > 0, slid.summary
    assert win.window == ["s2", "s3", "s4"] and win.evicted == ["s1"]
    win.reorder(["s4", "s2", "s3"])
    reordered = win.ask("Which is newest?")
    # s4 moved first: its entry (after s2, s3) survives the removal of what preceded it.
    assert reordered.reused_tokens_by_mode.get("survivor", 0) > 0, reordered.summary
    win.recall("s1", replace="s2")
    recalled = win.ask("Which came back?")
    assert win.window == ["s4", "s3", "s1"] and win.evicted == ["s2"]
    assert recalled.reused_tokens_by_mode.get("survivor", 0) > 0, recalled.summary
    with pytest.raises(ValueError):
        win.reorder(["s4", "s3"])
    # The same slide by a window in its own session that does not opt in: exact reuse only.
    anonymous = _window(server)
    anonymous.session, anonymous.kv_transfer_params = "other-agent", None
    for item in ("s1", "s2", "s3"):
        anonymous.slide(item, size=3)
    anonymous.ask("What changed?")
    anonymous.slide("s4", size=3)
    exact = anonymous.ask("What changed?")
    assert set(exact.reused_tokens_by_mode) <= {"exact"}, exact.summary
    assert exact.summary["num_approximate_tokens"] == 0 and exact.summary["policy"] == ""
