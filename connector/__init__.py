"""OrbitKV connector: ``kv_connector_module_path="orbitkv.connector"``, ``kv_connector="OrbitKVConnector"``;
its encoder-cache connector: ``ec_connector_module_path="orbitkv.connector"``,
``ec_connector="OrbitKVECConnector"`` (``encoder/``).

vLLM is imported lazily, so the pure parts (chunking, planner) work without it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["OrbitKVConnector", "OrbitKVECConnector"]


def __getattr__(name: str) -> Any:
    if name == "OrbitKVConnector":
        from .connector import OrbitKVConnector

        return OrbitKVConnector
    if name == "OrbitKVECConnector":
        from .encoder.connector import OrbitKVECConnector

        return OrbitKVECConnector
    raise AttributeError(name)
