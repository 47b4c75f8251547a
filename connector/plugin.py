"""vLLM general plugin: registers ``OrbitKVConnector`` (and the encoder-cache connector
``OrbitKVECConnector``) by name with vLLM's connector factories.

The ``vllm.general_plugins`` entry point (``orbitkv = "orbitkv.connector.plugin:register"``) makes
vLLM call ``register`` in every process it starts, so ``--kv-transfer-config
'{"kv_connector": "OrbitKVConnector", "kv_role": "kv_both", ...}'`` needs no
``kv_connector_module_path``. The registration is lazy (vLLM imports the connector module only
when an engine asks for it) and idempotent: a second call, or a name already taken by an identical
registration, is a no-op.

It also makes the launch key and wraps vLLM's media hashing and request building
(``vllm_ext/mm_hashes.py``), so that an engine need not hash again what vLLM's front end hashed.

On CPUs with AMX tiles it also asks the kernel for the tile state in every vLLM process
(``kernels/paged_amx.request_amx_permission``): vLLM's CPU attention uses AMX without asking, and
a process whose first forward is short dies of SIGILL, with or without OrbitKV.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

CONNECTOR_NAME = "OrbitKVConnector"
MODULE_PATH = "orbitkv.connector.connector"
CLASS_NAME = "OrbitKVConnector"
EC_CONNECTOR_NAME = "OrbitKVECConnector"
EC_MODULE_PATH = "orbitkv.connector.encoder.connector"


def register() -> None:
    from orbitkv.kernels.paged_amx import request_amx_permission

    from orbitkv.config import ensure_launch_key

    from .vllm_ext import mm_hashes

    request_amx_permission()
    # vLLM calls this in its first process before it starts any other: the key is made there and
    # inherited; the front end's hooks then vouch for the media hashes vLLM makes itself.
    ensure_launch_key()
    mm_hashes.install()
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except ImportError:  # vLLM without the v1 connector API: nothing to register with
        logger.warning("OrbitKV: vLLM has no KVConnectorFactory; connector not registered")
        return
    _register(KVConnectorFactory, CONNECTOR_NAME, MODULE_PATH)
    try:
        from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory
    except ImportError:  # vLLM without the encoder-cache connector API
        return
    _register(ECConnectorFactory, EC_CONNECTOR_NAME, EC_MODULE_PATH)


def _register(factory: type, name: str, module_path: str) -> None:
    # ``register_connector`` raises ValueError for a name it already holds; vLLM calls general
    # plugins once per process (engine core, workers, API server), sometimes more than once.
    if name in getattr(factory, "_registry", {}):
        return
    try:
        factory.register_connector(name, module_path, name)
    except ValueError:
        pass  # registered concurrently (another thread of this process got there first)
