"""vLLM general plugin: registers ``OrbitKVConnector`` by name with vLLM's connector factory.

The ``vllm.general_plugins`` entry point (``orbitkv = "orbitkv.connector.plugin:register"``) makes
vLLM call ``register`` in every process it starts, so ``--kv-transfer-config
'{"kv_connector": "OrbitKVConnector", "kv_role": "kv_both", ...}'`` needs no
``kv_connector_module_path``. The registration is lazy (vLLM imports the connector module only
when an engine asks for it) and idempotent: a second call, or a name already taken by an identical
registration, is a no-op.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

CONNECTOR_NAME = "OrbitKVConnector"
MODULE_PATH = "orbitkv.connector.connector"
CLASS_NAME = "OrbitKVConnector"


def register() -> None:
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except ImportError:  # vLLM without the v1 connector API: nothing to register with
        logger.warning("OrbitKV: vLLM has no KVConnectorFactory; connector not registered")
        return
    # ``register_connector`` raises ValueError for a name it already holds; vLLM calls general
    # plugins once per process (engine core, workers, API server), sometimes more than once.
    if CONNECTOR_NAME in getattr(KVConnectorFactory, "_registry", {}):
        return
    try:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, MODULE_PATH, CLASS_NAME)
    except ValueError:
        pass  # registered concurrently (another thread of this process got there first)
