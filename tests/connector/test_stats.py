"""OrbitKVStats (vLLM's KVConnectorStats payload) and its Prometheus export, without an engine."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")


def _prom(registry):
    from orbitkv.connector.connector import OrbitKVConnector
    from prometheus_client import Counter, Gauge, Histogram

    types = {cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    return OrbitKVConnector.build_prom_metrics(
        SimpleNamespace(kv_transfer_config=None),
        types,
        ["model_name", "engine"],
        {0: ["m", "0"], 1: ["m", "1"]},
    )


def test_stats_aggregate_sums_counters_and_joins_observations():
    from orbitkv.connector.stats import OrbitKVStats

    a, b = OrbitKVStats(), OrbitKVStats()
    assert a.is_empty()
    a.add("loaded_tokens.exact", 31)
    a.add("failed_loads", 0)  # a zero is not recorded
    a.observe("load_latency_s", 0.5)
    b.add("loaded_tokens.exact", 1)
    b.add("saved_bytes", 10)
    b.observe("load_latency_s", 1.5)
    merged = a.aggregate(b)
    assert merged.data == {
        "loaded_tokens.exact": 32,
        "load_latency_s": [0.5, 1.5],
        "saved_bytes": 10,
    }
    assert merged.reduce() == {
        "load_latency_s.count": 2,
        "load_latency_s.mean": 1.0,
        "loaded_tokens.exact": 32,
        "saved_bytes": 10,
    }
    # vLLM rebuilds the stats from the payload in the logger process.
    from orbitkv.connector.connector import OrbitKVConnector

    rebuilt = OrbitKVConnector.build_kv_connector_stats(merged.to_dict())
    assert rebuilt.reduce() == merged.reduce() and not rebuilt.is_empty()


def test_prom_metrics_record_counters_labels_and_histograms():
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    prom = _prom(registry)
    payload = {
        "loaded_tokens.exact": 63,
        "loaded_tokens.survivor": 32,
        "hit_chunks.exact": 2,
        "hit_tokens.disk": 95,
        "prompt_tokens.orbitkv": 95,
        "prompt_tokens.computed": 9,
        "loaded_bytes": 4096,
        "saved_bytes": 2048,
        "saved_chunks": 3,
        "failed_loads": 1,
        "corrupt_entries": 2,
        "dropped_saves": 0,
        "load_s": 0.25,  # forward-pass time: logged, not exported
        "load_latency_s": [0.002, 0.2],
        "save_latency_s": [0.01],
    }
    prom.observe(payload, engine_idx=1)
    prom.observe({"loaded_tokens.exact": 1, "load_latency_s": [3.0]}, engine_idx=1)

    def value(name, **labels):
        got = registry.get_sample_value(name, {"model_name": "m", "engine": "1", **labels})
        return 0.0 if got is None else got

    assert value("vllm:orbitkv_loaded_tokens_total", mode="exact") == 64
    assert value("vllm:orbitkv_loaded_tokens_total", mode="survivor") == 32
    assert value("vllm:orbitkv_hit_chunks_total", mode="exact") == 2
    assert value("vllm:orbitkv_hit_tokens_total", tier="disk") == 95
    assert value("vllm:orbitkv_prompt_tokens_total", source="orbitkv") == 95
    assert value("vllm:orbitkv_prompt_tokens_total", source="computed") == 9
    assert value("vllm:orbitkv_loaded_bytes_total") == 4096
    assert value("vllm:orbitkv_saved_bytes_total") == 2048
    assert value("vllm:orbitkv_saved_chunks_total") == 3
    assert value("vllm:orbitkv_errors_total", kind="failed_loads") == 1
    assert value("vllm:orbitkv_errors_total", kind="corrupt_entries") == 2
    assert value("vllm:orbitkv_load_latency_seconds_count") == 3
    assert value("vllm:orbitkv_load_latency_seconds_bucket", le="0.25") == 2
    assert value("vllm:orbitkv_save_latency_seconds_sum") == pytest.approx(0.01)
    # Engine 0 saw nothing.
    got = registry.get_sample_value(
        "vllm:orbitkv_saved_chunks_total", {"model_name": "m", "engine": "0"}
    )
    assert not got
