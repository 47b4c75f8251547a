"""The encoder connector's metrics: vLLM's ``ECConnectorStats`` and ``vllm:orbitkv_encoder_*``.

The payload is the KV connector's (``connector/stats.py``): a flat dict summed across steps, a
list value holds observations. The scheduler half reports all of it; the worker's counters reach
it through the worker metadata.

  ``items.loaded``        encoder outputs served from the store (the vision encoder did not run)
  ``items.computed``      encoder outputs the vision encoder computed, with the connector on
  ``loaded_bytes``        bytes of the outputs served
  ``saved_items``         outputs handed to the background writer (worker)
  ``dropped_saves``       writer queue full: the output is not stored (worker)
  ``unreadable_entries``  an entry the store listed but could not serve as a verified output of
                          the right size (corrupt, evicted meanwhile, another size): the encoder ran
  ``fetch_latency_s``     list: one store read per served or unreadable item, on the scheduler

Entries written and their bytes (kind ``encoder``), failed writes and the store's own faults are
counted where every entry is, by the KV connector's stats (``vllm:orbitkv_stored_bytes_total``
with ``kind="encoder"``, ``vllm:orbitkv_errors_total``).
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.ec_transfer.ec_connector.metrics import ECConnectorStats

from ..stats import OrbitKVPromMetrics, OrbitKVStats


@dataclass
class OrbitKVECStats(OrbitKVStats, ECConnectorStats):
    """``OrbitKVStats``'s flat-dict logic, as the stats type vLLM's EC logging expects."""


class OrbitKVECPromMetrics(OrbitKVPromMetrics):
    NAME_PREFIX = "vllm:orbitkv_encoder_"
    COUNTERS = (
        (
            "items",
            "Encoder outputs of multimodal items, by source: loaded (from the OrbitKV store, the "
            "vision encoder skipped) or computed.",
            "source",
        ),
        ("loaded_bytes", "Bytes of encoder outputs OrbitKV served.", None),
        ("saved_items", "Encoder outputs OrbitKV queued for storing.", None),
        (
            "errors",
            "OrbitKV encoder-cache faults, by kind (each is an encoder run or an output not "
            "stored, never a failed request).",
            "kind",
        ),
    )
    HISTOGRAMS = (
        (
            "fetch_latency_s",
            "fetch_latency_seconds",
            "OrbitKV encoder output fetch time per item, in the scheduler (lookup, read, verify).",
        ),
    )
    ERROR_KINDS = ("unreadable_entries", "dropped_saves")
