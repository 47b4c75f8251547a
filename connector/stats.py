"""Connector metrics through vLLM's ``KVConnectorStats``, and their Prometheus export.

The payload is a flat dict, summed across workers and steps; a list value holds observations
(latencies) and is concatenated. Both halves report: vLLM adds the scheduler's
``get_kv_connector_stats`` to the worker's. The worker's seconds go every step; the scheduler's
wait for a step with counters of its own, at the latest the one a request finishes in (or
``SCHEDULER_REPORT_S``, ``connector.py``), so most decode steps ship only the worker's.

Worker half:
  ``fetched_bytes``         bytes of the entries (and patches) fetched for loads (I/O)
  ``failed_loads``, ``failed_load_tokens``  loads reported to vLLM for recomputation
  ``unsafe_saves_skipped``  chunks computed over a failed load, not saved (saved once recomputed)
  ``incomplete_saves_skipped``  chunks of a forward that raised (or of caches that are not the
                            model's layers once each), not saved
  ``saved_chunks``          chunks handed to the writer; ``saved_entries``, ``saved_bytes``: stored
  ``stored_bytes.<kind>``   stored bytes per entry kind (conditioned, canonical, patch, orbit)
  ``dropped_saves``, ``failed_saves``  writer queue full / a save raised
  ``patches_formed``, ``patches_dropped``, ``patches_failed``  patch entries formed at low
                            priority (``worker/patch_queue.py``), jobs dropped (queue full) or failed
  ``store_errors``, ``corrupt_entries``, ``planning_timeouts``  the store's own counters (I/O
                            faults, bad copies dropped, Redis lookups past ``remote_lookup_timeout_s``);
                            both halves report them, each process for its own store
  ``dropped_store_writes``  writes to a lower tier dropped: its queue over ``write_queue_depth`` or
                            ``write_queue_max_nbytes`` (a slow tier), or the tier failing
  ``load_s``, ``save_gather_s``  time in the forward pass (fetch + relocate/scatter; the saves'
                            copy, or where it runs between steps its hand-off)
  ``load_latency_s``, ``save_latency_s``  lists: one load per step, one save from queueing to stored
  ``seconds.<part>``        seconds per part of a step, both halves (``timing.py``)
Scheduler half, per finished request, from the one ledger that follows vLLM's recovery (tokens
vLLM recomputed after a failed load are not counted as loaded):
  ``loaded_tokens.<mode>``  prompt tokens served per reuse mode
  ``loaded_bytes``          KV bytes those tokens occupy in the paged cache
  ``hit_chunks.<mode>``     chunks served per mode; ``hit_tokens.<tier>``: tokens per tier
  ``prompt_tokens.<source>`` per finished request: ``orbitkv`` (served), ``prefix_cache`` (vLLM's
                            own hit when planned), ``computed`` (the rest)
  ``approximate_tokens``    tokens served under an approximate policy (``scheduler/lineage.py``)
  ``refused_requests``      requests OrbitKV left to vLLM alone (a tenant not allowed, prompt
                            embeddings)
  ``planning_errors``
  ``save_admission.<outcome>``  computed chunks ``admitted`` to a save or ``declined`` by the
                            ``save_admission`` policy (``scheduler/save_admission.py``)
  ``audit.<outcome>``       finished approximate requests ``sampled`` for the live audit, or
                            ``unauditable`` (images); ``switched_off``: modes the audit turned off
Exported once: ``vllm:orbitkv_model_info{model_fingerprint=...} 1``, the fingerprint the
calibration table is keyed by (``scheduler/calibration.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

OBSERVATIONS = ("load_latency_s", "save_latency_s")
ERROR_KINDS = (
    "failed_loads",
    "dropped_saves",
    "failed_saves",
    "store_errors",
    "corrupt_entries",
    "planning_errors",
    "planning_timeouts",
    "dropped_store_writes",
)


@dataclass
class OrbitKVStats(KVConnectorStats):
    def reset(self) -> None:
        self.data = {}

    def add(self, name: str, value: float) -> None:
        if value:
            self.data[name] = self.data.get(name, 0) + value

    def observe(self, name: str, value: float) -> None:
        self.data.setdefault(name, []).append(value)

    def aggregate(self, other: KVConnectorStats) -> OrbitKVStats:
        for name, value in other.data.items():
            if isinstance(value, list):
                self.data.setdefault(name, []).extend(value)
            else:
                self.add(name, value)
        return self

    def reduce(self) -> dict[str, int | float]:
        """One line per interval: counters as they are, observations as count and mean."""
        out: dict[str, int | float] = {}
        for name, value in sorted(self.data.items()):
            if isinstance(value, list):
                if value:
                    out[f"{name}.count"] = len(value)
                    out[f"{name}.mean"] = round(sum(value) / len(value), 6)
            else:
                out[name] = round(value, 6) if isinstance(value, float) else value
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


# name, documentation, label, stats prefix ("" for an unlabelled counter)
_COUNTERS = (
    ("loaded_tokens", "Prompt tokens OrbitKV served into the paged cache, by reuse mode.", "mode"),
    ("hit_chunks", "Chunks OrbitKV served, by reuse mode.", "mode"),
    (
        "hit_tokens",
        "Prompt tokens OrbitKV planned to serve, by the store tier holding them.",
        "tier",
    ),
    (
        "prompt_tokens",
        "Prompt tokens of finished requests, by source: orbitkv (served), "
        "prefix_cache (vLLM's own prefix cache), computed.",
        "source",
    ),
    ("loaded_bytes", "KV bytes OrbitKV served into the paged cache (tokens vLLM kept).", None),
    ("fetched_bytes", "Bytes of OrbitKV entries fetched for loads.", None),
    ("approximate_tokens", "Prompt tokens served approximately, under a request's policy.", None),
    ("refused_requests", "Requests OrbitKV left to vLLM alone (tenant, prompt embeddings).", None),
    ("audit", "Live audit: approximate requests sampled (or unauditable), modes switched off.",
     "outcome"),
    ("saved_bytes", "Bytes of OrbitKV entries stored.", None),
    (
        "stored_bytes",
        "Bytes of OrbitKV entries stored, by kind: conditioned, canonical, patch, orbit.",
        "kind",
    ),
    ("saved_chunks", "Chunks OrbitKV saved.", None),
    ("save_admission", "Computed chunks the save admission policy admitted or declined.",
     "outcome"),
    ("patches_formed", "Patch entries OrbitKV formed (at low priority, off the forward).", None),
    ("seconds", "Seconds OrbitKV spent per part of a step (timing.py): chunk, plan, alloc, meta, "
     "output, finish (scheduler; mm_hash: the part of chunk hashing new multimodal inputs); "
     "fetch, check, layer_load, save_gather, save_submit, save_wait, hooks (the rest of the "
     "step hooks) (worker); encoder (the encoder connector's hooks, either side); save_copy (saves copied "
     "out of the cache between steps, on their own thread), save_writer (the background "
     "writer's CPU seconds).", "part"),
    (
        "errors",
        "OrbitKV faults, by kind (each is a miss or a dropped save, never a failed request).",
        "kind",
    ),
)
_HISTOGRAMS = (
    (
        "load_latency_s",
        "load_latency_seconds",
        "OrbitKV load time per step (fetch, verify, relocate, scatter).",
    ),
    (
        "save_latency_s",
        "save_latency_seconds",
        "OrbitKV save time per chunk, from queueing to stored in the memory tier.",
    ),
)
_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class OrbitKVPromMetrics(KVConnectorPromMetrics):
    """``vllm:orbitkv_*`` counters and histograms, labelled like vLLM's own (model, engine).

    The tables are class attributes: the encoder connector's metrics (``encoder/stats.py``) are
    this class with its own tables under its own name prefix."""

    NAME_PREFIX = "vllm:orbitkv_"
    COUNTERS = _COUNTERS
    HISTOGRAMS = _HISTOGRAMS
    ERROR_KINDS = ERROR_KINDS

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, tuple[Any, str | None]] = {}
        for name, doc, label in self.COUNTERS:
            metric = self._counter_cls(
                name=f"{self.NAME_PREFIX}{name}",
                documentation=doc,
                labelnames=labelnames + ([label] if label else []),
            )
            self._counters[name] = (metric, label)
        self._histograms: dict[str, Any] = {}
        for key, name, doc in self.HISTOGRAMS:
            self._histograms[key] = self._histogram_cls(
                name=f"{self.NAME_PREFIX}{name}",
                documentation=doc,
                labelnames=labelnames,
                buckets=list(_BUCKETS),
            )
        self._children: dict[tuple[int, str, str], Any] = {}
        if self.NAME_PREFIX == OrbitKVPromMetrics.NAME_PREFIX:
            self._publish_model_info(vllm_config, labelnames)

    def _publish_model_info(self, vllm_config: VllmConfig, labelnames: list[str]) -> None:
        from .identity import model_identity

        try:
            fingerprint = model_identity(vllm_config, None).model_fingerprint
        except Exception:
            return  # a config the identity cannot read: the connector itself fails louder
        info = self._gauge_cls(
            name=f"{self.NAME_PREFIX}model_info",
            documentation="The model fingerprint OrbitKV keys entries and calibration by.",
            labelnames=labelnames + ["model_fingerprint"],
            multiprocess_mode="mostrecent",
        )
        for values in self.per_engine_labelvalues.values():
            info.labels(*values, fingerprint).set(1)

    def _child(self, metric: Any, name: str, engine_idx: int, label: str = "") -> Any:
        key = (engine_idx, name, label)
        child = self._children.get(key)
        if child is None:
            values = list(self.per_engine_labelvalues[engine_idx]) + ([label] if label else [])
            child = self._children[key] = metric.labels(*values)
        return child

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            if key in self._histograms:
                hist = self._child(self._histograms[key], key, engine_idx)
                for v in value:
                    hist.observe(v)
                continue
            if not value or isinstance(value, list):
                continue
            name, _, label = key.partition(".")
            if name in self.ERROR_KINDS:
                name, label = "errors", name
            counter = self._counters.get(name)
            if counter is None:
                continue  # times in the forward pass etc.: logged, not exported
            metric, label_name = counter
            if (label_name is None) != (not label):
                continue
            self._child(metric, name, engine_idx, label).inc(value)
