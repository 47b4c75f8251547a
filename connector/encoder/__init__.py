"""OrbitKV as vLLM's encoder-cache connector: vision encoder outputs in the OrbitKV store.

``--ec-transfer-config '{"ec_connector": "OrbitKVECConnector", "ec_role": "ec_both",
"ec_connector_module_path": "orbitkv.connector"}'`` beside the KV connector. Modules: ``entries``
(keys, entry build and check), ``scheduler`` and ``worker`` (the halves), ``metadata`` (what they
send each other), ``stats`` (metrics), ``summary`` (per-request counts for the KV connector's
summary) and ``connector`` (vLLM's ``ECConnectorBase``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["OrbitKVECConnector"]


def __getattr__(name: str) -> Any:
    if name == "OrbitKVECConnector":
        from .connector import OrbitKVECConnector

        return OrbitKVECConnector
    raise AttributeError(name)
