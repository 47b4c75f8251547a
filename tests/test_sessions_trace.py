"""The ``sessions`` trace (interleaved agent sessions keeping their history) and the per-request
time breakdown the demo and ``bench agent`` print."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from orbitkv.agent.breakdown import (
    breakdown,
    format_breakdown,
    memcpy_nbytes_per_s,
    token_kv_nbytes,
)
from orbitkv.agent.workload import APPEND, START, TRACES, chat_messages, make_sessions_workload


def _content(w, step):
    return chat_messages(w, step)[1]["content"]


def test_sessions_interleave_and_each_turn_extends_the_session_s_last_prompt():
    w = make_sessions_workload(seed=3, window=4, num_steps=12, obs_words=5, tool_words=0)
    assert TRACES["sessions"] is make_sessions_workload
    assert [s.kind for s in w.steps] == [START] * 4 + [APPEND] * 8
    for step in w.steps:
        session, turn = step.index % 4, step.index // 4
        assert step.images == tuple(session * 1000 + j for j in range(turn + 1))
        assert step.new_images == step.images[-1:]
        if turn:
            before = w.steps[step.index - 4]
            # The previous turn's prompt without its question, then the new screenshot, its
            # observation and a new question: exact reuse, if the session's prefix was kept.
            assert _content(w, step)[: len(_content(w, before)) - 1] == _content(w, before)[:-1]
            assert _content(w, step)[-1]["type"] == "text" and len(_content(w, step)) == len(_content(w, before)) + 2
    # Between two turns of a session, every other session runs one.
    assert [s.index % 4 for s in w.steps[:8]] == [0, 1, 2, 3, 0, 1, 2, 3]


def test_sessions_trace_rejects_shapes_that_never_come_back():
    with pytest.raises(ValueError, match="sessions"):
        make_sessions_workload(window=1, num_steps=4)
    with pytest.raises(ValueError, match="at least once"):
        make_sessions_workload(window=4, num_steps=7)


def test_breakdown_sets_orbitkv_s_time_against_the_engine_and_the_load_s_memcpy(tmp_path):
    (tmp_path / "config.json").write_text(
        '{"text_config": {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,'
        ' "hidden_size": 64}}'
    )
    nbytes = token_kv_nbytes(tmp_path)
    assert nbytes == 2 * 2 * 2 * 16 * 2
    rate = 1e9  # bytes per second
    records = [
        SimpleNamespace(connector_seconds={"plan": 0.0002, "layer_load": 0.003, "save_writer": 0.01},
                        connector_tokens=10_000, engine_ttft_s=0.05),
        SimpleNamespace(connector_seconds={"plan": 0.0004, "fetch": 0.0001, "chunk": 0.0004,
                                           "mm_hash": 0.0003},
                        connector_tokens=0, engine_ttft_s=0.03),
        SimpleNamespace(connector_seconds=None, connector_tokens=None, engine_ttft_s=0.02),
    ]
    b = breakdown(records, nbytes, rate)
    assert b["num_requests"] == 2
    memcpy = 10_000 * nbytes / rate
    assert b["in_engine_p95_s"] == pytest.approx(0.0032)
    # mm_hash is inside chunk: counted once in the engine's time (0.9 ms), and shown apart.
    assert b["excess_p95_s"] == pytest.approx(max(0.0032 - memcpy, 0.0009), abs=1e-6)
    assert b["excess_beyond_hash_p50_s"] == pytest.approx(min(0.0032 - memcpy, 0.0006), abs=1e-6)
    assert b["mm_hash_p50_s"] == pytest.approx(0.0)  # the lower of 0 and 0.3 ms
    assert b["share_within_target"] == (0.5 if 0.0032 - memcpy > 1e-3 else 1.0)
    assert b["by_part_mean_s"]["save_writer"] == pytest.approx(0.005)
    assert "OrbitKV in the engine" in format_breakdown("orbitkv", b)
    assert breakdown(records[2:], nbytes, rate) is None
    # The worker's step hooks beyond their named parts count; a copy on its own thread does not.
    hooks = [SimpleNamespace(connector_seconds={"hooks": 0.0005, "save_copy": 0.002},
                             connector_tokens=0, engine_ttft_s=0.01)]
    assert breakdown(hooks, nbytes, rate)["in_engine_p50_s"] == pytest.approx(0.0005)
    assert memcpy_nbytes_per_s(1 << 20, repeats=2) > 1e8
