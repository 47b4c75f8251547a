"""OrbitKV connector: ``kv_connector_module_path="orbitkv.connector"``, ``kv_connector="OrbitKVConnector"``.

vLLM is imported lazily, so the pure parts (chunking, planner) work without it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["OrbitKVConnector"]


def __getattr__(name: str) -> Any:
    if name == "OrbitKVConnector":
        from .connector import OrbitKVConnector

        return OrbitKVConnector
    raise AttributeError(name)
