"""A step with nothing to load skips the per-layer hooks: the connector answers vLLM's attention
wrapper (``kv_transfer_utils.maybe_transfer_kv_layer``) that it has no metadata, and the wrapper
then calls neither ``wait_for_layer_load`` nor ``save_kv_layer`` for that layer (every decode step
and every step that only saves, whose chunks are copied from every layer after the forward: 2 x
layers calls saved, each on the cold caches between two layers' compute)."""

from __future__ import annotations

import inspect

import pytest
from orbitkv.connector.connector import OrbitKVConnector
from orbitkv.connector.metadata import LoadSpec, OrbitKVMetadata, SaveSpec
from orbitkv.connector.timing import PartSeconds
from vllm.model_executor.layers.attention import kv_transfer_utils

pytestmark = pytest.mark.vllm


def _bare_connector() -> OrbitKVConnector:
    # Only the metadata binding is exercised: no engine, store or config behind it.
    conn = object.__new__(OrbitKVConnector)
    conn._connector_metadata = None
    conn._has_layer_work = False
    return conn


def _load() -> LoadSpec:
    return LoadSpec("r", "k", "exact", 0, 0, [0, 1], [0])


def _save() -> SaveSpec:
    return SaveSpec("r", "c" * 32, 0, [0, 1], (), "a" * 32, {"conditioned": "k"})


def test_the_wrapper_still_gates_both_hooks_on_the_metadata():
    source = inspect.getsource(kv_transfer_utils.maybe_transfer_kv_layer)
    gate = source.index("has_connector_metadata()")
    assert gate < source.index("wait_for_layer_load(") < source.index("save_kv_layer(")


@pytest.mark.parametrize(("meta", "has_work"), [
    (OrbitKVMetadata(), False),  # a decode step
    (OrbitKVMetadata(recovered=["r"]), False),  # handled at start_load_kv, not per layer
    (OrbitKVMetadata(loads=[_load()]), True),
    (OrbitKVMetadata(saves=[_save()]), False),  # copied from every layer at wait_for_save
    (OrbitKVMetadata(loads=[_load()], saves=[_save()]), True),
])
def test_only_a_step_with_loads_has_metadata_for_the_layers(meta, has_work):
    conn = _bare_connector()
    assert not conn.has_connector_metadata()
    conn.bind_connector_metadata(meta)
    assert conn.has_connector_metadata() is has_work
    assert conn._get_connector_metadata() is meta  # bound all the same, for the step's hooks
    conn.clear_connector_metadata()
    assert not conn.has_connector_metadata()


@pytest.mark.parametrize(("meta", "is_started"), [
    (OrbitKVMetadata(), False),  # a decode step: handle_preemptions marked its start
    (OrbitKVMetadata(saves=[_save()]), False),  # copied at wait_for_save
    (OrbitKVMetadata(recovered=["r"]), True),  # the worker lets the request's saves go
    (OrbitKVMetadata(loads=[_load()]), True),
])
def test_start_load_kv_reaches_the_worker_only_with_loads_or_recovered_requests(meta, is_started):
    class Worker:
        started: list[OrbitKVMetadata] = []

        def start_load_kv(self, bound: OrbitKVMetadata) -> None:
            self.started.append(bound)

    conn = _bare_connector()
    conn._worker = Worker()
    conn._seconds = PartSeconds()
    conn.bind_connector_metadata(meta)
    conn.start_load_kv(None)
    assert conn._worker.started == ([meta] if is_started else [])
    conn.clear_connector_metadata()
    conn._connector_metadata = meta  # bound by a caller that skipped bind: never skipped
    conn.start_load_kv(None)
    assert conn._worker.started[-1] is meta


def test_the_worker_marks_a_step_s_start_before_its_forward(halves):
    """The patch former waits for an idle engine from the last mark: a step is marked busy at
    ``handle_preemptions``, which both of vLLM's model runners call before the forward, since
    ``start_load_kv`` may not run at all."""
    _, worker, _, shared = halves
    patches = shared.writer.patches
    patches._last_step_at = 0.0
    worker.before_step()
    assert patches._last_step_at > 0.0
