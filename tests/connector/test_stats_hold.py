"""The scheduler half ships its seconds with the step a request finishes in, not every step:
vLLM asks ``get_kv_connector_stats`` every step, decode included, and pickles whatever it gets to
the front end. A request's own time still arrives with the request (``bench agent`` reads it per
request from /metrics), and a long request's at least every ``SCHEDULER_REPORT_S``."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from halves_testlib import computed_step, new_step, request  # noqa: E402
from orbitkv.connector import connector as connector_module  # noqa: E402
from orbitkv.connector.connector import OrbitKVConnector  # noqa: E402
from orbitkv.connector.timing import PartSeconds  # noqa: E402

SYS, C1, Q = [1] * 4, [2] * 4, [9, 9]


def _connector(sched=None, worker=None) -> OrbitKVConnector:
    """The connector's hooks around real halves (no engine behind them)."""
    conn = object.__new__(OrbitKVConnector)
    conn._scheduler, conn._worker, conn._seconds = sched, worker, PartSeconds()
    conn._bridge = conn._events = None
    return conn


def _decode_step(conn, req_id):
    scheduler_output = new_step(req_id, [1, 2, 3], 10, 1)
    scheduler_output.scheduled_new_reqs = []
    conn.build_connector_meta(scheduler_output)
    return conn.get_kv_connector_stats()


def _seconds(stats) -> float:
    return sum(v for k, v in stats.data.items() if k.startswith("seconds."))


def test_the_scheduler_holds_its_seconds_until_a_request_finishes(halves):
    sched, worker, caches, shared = halves
    conn = _connector(sched=sched)
    req, _ = computed_step(halves, "a", SYS + C1 + Q, [1, 2, 3], seed=1)
    conn.get_kv_connector_stats()  # whatever the prefill reported
    assert [_decode_step(conn, "a") for _ in range(3)] == [None, None, None]
    shared.writer.flush()
    conn.request_finished(req, [1, 2, 3])
    stats = conn.get_kv_connector_stats()
    assert stats is not None and stats.data["seconds.meta"] > 0  # the three decode steps'
    assert stats.data["seconds.finish"] > 0 and stats.data["prompt_tokens.computed"] == 10


def test_held_seconds_ship_after_the_longest_hold(halves, monkeypatch):
    sched, worker, caches, shared = halves
    conn = _connector(sched=sched)
    computed_step(halves, "b", SYS + C1 + Q, [1, 2, 3], seed=2)
    conn.get_kv_connector_stats()
    assert _decode_step(conn, "b") is None
    monkeypatch.setattr(connector_module, "SCHEDULER_REPORT_S", 0.0)
    conn._hold_until = 0.0
    stats = _decode_step(conn, "b")
    assert stats is not None and _seconds(stats) > 0


def test_the_worker_ships_its_seconds_every_step(halves):
    """It cannot tell a request's last step: its seconds go with each step that has any."""
    sched, worker, caches, shared = halves
    conn = _connector(worker=worker)
    req = request("c", SYS + C1 + Q)
    sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, None, 0)
    scheduler_output = new_step("c", [1, 2, 3], 10, 1)
    scheduler_output.scheduled_new_reqs = []
    for _ in range(3):
        meta = sched.build_connector_meta(scheduler_output)
        conn._connector_metadata = meta
        conn.handle_preemptions(meta)
        conn.start_load_kv(None)
        conn.wait_for_save()
        stats = conn.get_kv_connector_stats()
        assert stats is not None and stats.data["seconds.hooks"] > 0


def test_a_step_the_workers_report_nothing_of_does_not_reach_the_scheduler_half(halves):
    """Every decode step's worker output carries no worker metadata: nothing to apply, no part
    timed. A report (entries stored) is applied as before."""
    from vllm.v1.outputs import KVConnectorOutput

    sched, worker, caches, shared = halves
    applied = []
    sched._reported.apply = applied.append
    conn = _connector(sched=sched)
    conn.update_connector_output(KVConnectorOutput())
    assert applied == [] and conn._seconds.take() == {}
    computed_step(halves, "d", SYS + C1 + Q, [1, 2, 3], seed=3)
    shared.writer.flush()
    report = worker.build_worker_meta()
    assert report is not None
    conn.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=report))
    assert applied == [report] and conn._seconds.take()["seconds.output"] > 0
