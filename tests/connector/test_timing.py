"""Seconds per part of a step: counted by the connector, exported per part on /metrics."""

from __future__ import annotations

import time

import pytest
from orbitkv.connector.stats import OrbitKVPromMetrics, OrbitKVStats
from orbitkv.connector.timing import PartSeconds


def test_parts_add_up_and_drain():
    seconds = PartSeconds()
    with seconds.timed("fetch"):
        time.sleep(0.01)
    seconds.add("fetch", 0.5)
    seconds.add("plan", 0.25)
    taken = seconds.take()
    assert set(taken) == {"seconds.fetch", "seconds.plan"}
    assert 0.51 <= taken["seconds.fetch"] < 1.0 and taken["seconds.plan"] == 0.25
    assert seconds.take() == {}


def test_an_idle_steps_poll_waits_for_the_next_report():
    seconds = PartSeconds()
    assert seconds.is_only("stats")  # nothing yet
    seconds.add("stats", 1e-5)
    assert seconds.is_only("stats")  # the connector reports nothing for such a step
    seconds.add("stats", 2e-5)
    seconds.add("meta", 1e-4)
    assert not seconds.is_only("stats")
    assert seconds.take()["seconds.stats"] == pytest.approx(3e-5)


def test_a_part_that_raises_is_still_timed():
    seconds = PartSeconds()
    try:
        with seconds.timed("check"):
            raise ValueError("bad entry")
    except ValueError:
        pass
    assert "seconds.check" in seconds.take()


def test_seconds_are_exported_per_part():
    import functools
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    registry = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    config = SimpleNamespace(kv_transfer_config=None)
    metrics = OrbitKVPromMetrics(config, types, ["model_name", "engine"], {0: ["m", "0"]})
    stats = OrbitKVStats()
    stats.add("seconds.fetch", 0.25)
    stats.add("seconds.layer_load", 0.5)
    stats.add("seconds.layer_load", 0.25)
    metrics.observe(stats.data)
    text = generate_latest(registry).decode()
    assert 'vllm:orbitkv_seconds_total{engine="0",model_name="m",part="fetch"} 0.25' in text
    assert 'vllm:orbitkv_seconds_total{engine="0",model_name="m",part="layer_load"} 0.75' in text


def test_a_hook_timed_whole_counts_its_named_parts_once():
    seconds = PartSeconds()
    started, before = time.perf_counter(), seconds.on_path_s
    with seconds.timed("fetch"):
        time.sleep(0.05)
    seconds.add("save_copy", 5.0)  # off the path: not subtracted from the hook's rest
    time.sleep(0.01)
    seconds.add_rest("hooks", started, before)
    taken = seconds.take()
    assert taken["seconds.fetch"] >= 0.05
    assert 0.01 <= taken["seconds.hooks"] < 0.045  # the sleep after fetch, not fetch again
    assert seconds.on_path_s == pytest.approx(taken["seconds.fetch"] + taken["seconds.hooks"])
