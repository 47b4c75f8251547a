"""Connector metrics through vLLM's ``KVConnectorStats``: flat counters, summed across workers.

Names: ``loaded_tokens.<mode>``, ``failed_load_tokens``, ``saved_chunks``, ``dropped_saves``,
``failed_saves``, ``load_s`` (fetch + relocate/scatter), ``save_gather_s``.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats


@dataclass
class OrbitKVStats(KVConnectorStats):
    def reset(self) -> None:
        self.data = {}

    def add(self, name: str, value: float) -> None:
        self.data[name] = self.data.get(name, 0) + value

    def aggregate(self, other: KVConnectorStats) -> OrbitKVStats:
        for name, value in other.data.items():
            self.add(name, value)
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())
