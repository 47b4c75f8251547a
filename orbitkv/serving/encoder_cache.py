"""``--ec-transfer-config`` for OrbitKV's encoder-cache connector, where vLLM accepts one.

``orbitkv serve`` and the benchmark servers add it beside the KV connector when the config's
``enable_encoder_cache`` is on and the model has a vision or audio encoder. vLLM refuses an
encoder-cache producer on a text-only model (it measures the encoder's output width at start-up
and fails when there is no encoder), so the model's Hugging Face config is read first: from the
model's directory, or from the local Hugging Face cache for a hub id (never the network: an
offline retry loop would hold the start for a minute). A model whose config cannot be read here
gets no encoder cache, with a log line, never a failed start.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

EC_CONNECTOR = {
    "ec_connector": "OrbitKVECConnector",
    "ec_connector_module_path": "orbitkv.connector",
    # Loads and saves. (vLLM runs an ec_producer-only engine as an encoder-only instance.)
    "ec_role": "ec_both",
}
# Sub-configs of a Hugging Face config that hold a multimodal encoder (LLaVA, Idefics3/SmolVLM,
# Qwen2-VL, Gemma 3, InternVL, Pixtral, Kimi-VL, DeepSeek-VL2, Ultravox, ...; one level of nesting
# for the omni models' thinker_config).
ENCODER_CONFIG_KEYS = ("vision_config", "audio_config", "vision_tower_config")


def ec_transfer_config() -> dict[str, Any]:
    """The ``--ec-transfer-config`` value. Its empty ``ec_connector_extra_config`` makes the
    connector use the KV connector's, so both share one store."""
    return dict(EC_CONNECTOR)


def has_encoder_config(config: Mapping[str, Any]) -> bool:
    if any(isinstance(config.get(k), Mapping) for k in ENCODER_CONFIG_KEYS):
        return True
    return any(
        isinstance(v, Mapping) and any(isinstance(v.get(k), Mapping) for k in ENCODER_CONFIG_KEYS)
        for v in config.values()
    )


def _local_config(model: str) -> dict[str, Any] | None:
    """The model's ``config.json``: in its directory, or in the local Hugging Face cache."""
    path = Path(model).expanduser()
    if path.is_dir():
        path = path / "config.json"
    else:
        from huggingface_hub import try_to_load_from_cache

        try:
            found = try_to_load_from_cache(model, "config.json")
        except ValueError:  # not a valid hub id either (a path that does not exist)
            return None
        if not isinstance(found, str):
            return None
        path = Path(found)
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def is_multimodal_model(model: str | None) -> bool:
    """Whether ``model`` (a directory or a Hugging Face id) has a vision or audio encoder."""
    if not model:
        return False
    config = _local_config(str(model))
    if config is None:
        logger.warning(
            "OrbitKV: no local config for %s; serving without the encoder cache (pass "
            "--ec-transfer-config for a multimodal model)", model
        )
        return False
    return has_encoder_config(config)


def model_of(vllm_args: list[str]) -> str | None:
    """The model in ``vllm serve`` args: the first positional, or ``--model``."""
    for i, arg in enumerate(vllm_args):
        if arg == "--model" and i + 1 < len(vllm_args):
            return vllm_args[i + 1]
        if arg.startswith("--model="):
            return arg.split("=", 1)[1]
    return vllm_args[0] if vllm_args and not vllm_args[0].startswith("-") else None


def ec_args(
    model: str | None, extra_config: Mapping[str, Any] | None, env: Mapping[str, str] | None = None
) -> list[str]:
    """``["--ec-transfer-config", ...]`` when the encoder cache is on for this model, else []."""
    from orbitkv.config import OrbitKVConfig

    config = OrbitKVConfig.from_kv_connector_extra_config(dict(extra_config or {}), env=env)
    if not config.enable_encoder_cache or not is_multimodal_model(model):
        return []
    return ["--ec-transfer-config", json.dumps(ec_transfer_config())]
