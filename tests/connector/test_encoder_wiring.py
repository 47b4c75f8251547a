"""The encoder-cache connector's wiring without an engine: the per-request summary it adds to the
KV connector's, its stats and Prometheus export, its config, and its registration by name."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from orbitkv.connector.encoder import summary  # noqa: E402


def test_summary_adds_loaded_items_to_the_kv_summary():
    summary.record("s1", is_loaded=True)
    summary.record("s1", is_loaded=True)
    summary.record("s1", is_loaded=False)
    params = summary.annotate({"orbitkv": {"num_encoded_items": 1}}, "s1")
    assert params == {"orbitkv": {"num_encoded_items": 1, summary.LOADED: 2}}
    assert summary.annotate(None, "s1") is None
    assert summary.annotate({"other": 1}, "s1") == {"other": 1}
    assert summary.forget("s1") == {summary.LOADED: 2, summary.COMPUTED: 1}
    assert summary.annotate({"orbitkv": {}}, "s1") == {"orbitkv": {summary.LOADED: 0}}


def test_prom_metrics_export_the_encoder_counters():
    from orbitkv.connector.encoder.connector import OrbitKVECConnector
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    registry = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    prom = OrbitKVECConnector.build_prom_metrics(
        SimpleNamespace(kv_transfer_config=None), types, ["model_name", "engine"], {0: ["m", "0"]}
    )
    stats = OrbitKVECConnector.build_ec_connector_stats(
        {"items.loaded": 2, "items.computed": 1, "loaded_bytes": 96, "saved_items": 1,
         "unreadable_entries": 1, "fetch_latency_s": [0.001, 0.002]}
    )
    assert stats.reduce()["fetch_latency_s.count"] == 2
    prom.observe(stats.data, engine_idx=0)

    def value(name, **labels):
        return registry.get_sample_value(name, {"model_name": "m", "engine": "0", **labels})

    assert value("vllm:orbitkv_encoder_items_total", source="loaded") == 2
    assert value("vllm:orbitkv_encoder_items_total", source="computed") == 1
    assert value("vllm:orbitkv_encoder_loaded_bytes_total") == 96
    assert value("vllm:orbitkv_encoder_saved_items_total") == 1
    assert value("vllm:orbitkv_encoder_errors_total", kind="unreadable_entries") == 1
    assert value("vllm:orbitkv_encoder_fetch_latency_seconds_count") == 2


def test_encoder_config_is_the_kv_connectors_unless_given():
    from orbitkv.connector.encoder.connector import encoder_config

    def vllm_config(ec_extra, kv_name="OrbitKVConnector"):
        return SimpleNamespace(
            ec_transfer_config=SimpleNamespace(ec_connector_extra_config=ec_extra),
            kv_transfer_config=SimpleNamespace(
                kv_connector=kv_name, kv_connector_extra_config={"chunk_size": 64}
            ),
        )

    assert encoder_config(vllm_config({})).chunk_size == 64
    assert encoder_config(vllm_config({"chunk_size": 32})).chunk_size == 32
    assert encoder_config(vllm_config({}, kv_name="OtherConnector")).chunk_size == 256
    assert not encoder_config(vllm_config({"orbitkv_enable_encoder_cache": False})).enable_encoder_cache
    with pytest.raises(ValueError, match="orbitkv_encoder_cache"):
        encoder_config(vllm_config({"orbitkv_encoder_cache": True}))


def test_plugin_registers_the_encoder_connector_by_name():
    from orbitkv.connector.encoder.connector import OrbitKVECConnector
    from orbitkv.connector.plugin import register
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

    register()
    register()
    cls = ECConnectorFactory.get_connector_class(SimpleNamespace(ec_connector="OrbitKVECConnector"))
    assert cls is OrbitKVECConnector
    import orbitkv.connector  # ec_connector_module_path="orbitkv.connector" finds it there too

    assert orbitkv.connector.OrbitKVECConnector is OrbitKVECConnector
