"""Per-request options, read from ``kv_transfer_params={"orbitkv": {...}}``.

Keys (all optional):
  load: bool           serve cached chunks to this request (default true)
  save: bool           store the chunks this request computes (default true)
  modes: list | dict   reuse modes allowed: a list of names, or {"blind": true, ...} applied
                       on top of the configured ones
  tenant: str          tenant namespace for the content keys (default: the config's tenant). vLLM's
                       ``cache_salt`` is hashed beside it: keys differ per (tenant, salt) pair.
                       A tenant name is a namespace, not a secret: a client that may not read a
                       tenant's KV must not be able to name it (set it in the config per
                       deployment) or the salt must be secret, as vLLM documents for cache_salt.
  chunk_boundaries: [int]   extra text cut points (token offsets), e.g. document ends
  role: str            "canonicalize": a request ``[anchor . B]`` sent to form B's canonical
  patch_rank: int      serve patches stored at this rank (default: the configured patch_rank)

The scheduler must never crash on a client's typo, so a bad value is logged and the default kept.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .planner import ALL_MODES, BLIND, EXACT, ORBIT, PATCHED, SURVIVOR

logger = logging.getLogger(__name__)

KEYS = frozenset({"load", "save", "modes", "tenant", "chunk_boundaries", "role", "patch_rank"})
ROLES = ("", "canonicalize")


@dataclass(frozen=True, slots=True)
class RequestOptions:
    is_load_enabled: bool = True
    is_save_enabled: bool = True
    modes: frozenset[str] = frozenset({EXACT, SURVIVOR})
    tenant: str = ""
    chunk_boundaries: tuple[int, ...] = ()
    role: str = ""
    # Serve patches of this rank (0: the configured patch_rank), e.g. a stored higher-rank set.
    patch_rank: int = 0


def configured_modes(config: Any) -> frozenset[str]:
    """Modes allowed by an ``OrbitKVConfig``; patched is on whenever patches are formed."""
    modes = set()
    if config.enable_exact:
        modes.add(EXACT)
    if config.enable_survivor:
        modes.add(SURVIVOR)
    if config.enable_blind:
        modes.add(BLIND)
    if config.patch_rank > 0:
        modes |= {PATCHED, ORBIT}
    if config.blind_modalities:
        modes.add(BLIND)  # narrowed to those modalities per chunk (mode_filter)
    return frozenset(modes)


def mode_filter(config: Any):
    """Per chunk: blind only for ``blind_modalities`` unless ``enable_blind`` allows it for all."""
    if config.enable_blind or not config.blind_modalities:
        return None
    allowed = frozenset(config.blind_modalities)
    without_blind = frozenset(ALL_MODES) - {BLIND}
    every = frozenset(ALL_MODES)

    def modes_for(chunk: Any) -> frozenset[str]:
        modality = chunk.modality if chunk.is_mm else "text"
        return every if modality in allowed else without_blind

    return modes_for


def parse_options(
    params: Mapping[str, Any] | None, *, default_modes: frozenset[str], default_tenant: str
) -> RequestOptions:
    raw = (params or {}).get("orbitkv") if isinstance(params, Mapping) else None
    if raw is None:
        return RequestOptions(modes=default_modes, tenant=default_tenant)
    if not isinstance(raw, Mapping):
        logger.warning("OrbitKV: kv_transfer_params['orbitkv'] is not a mapping; ignored")
        return RequestOptions(modes=default_modes, tenant=default_tenant)
    unknown = set(raw) - KEYS
    if unknown:
        logger.warning("OrbitKV: unknown request options %s ignored", sorted(unknown))
    return RequestOptions(
        is_load_enabled=_bool(raw, "load", True),
        is_save_enabled=_bool(raw, "save", True),
        modes=_modes(raw.get("modes"), default_modes),
        tenant=_str(raw, "tenant", default_tenant),
        chunk_boundaries=_ints(raw.get("chunk_boundaries")),
        role=_role(raw.get("role")),
        patch_rank=_rank(raw.get("patch_rank")),
    )


def _bool(raw: Mapping[str, Any], key: str, default: bool) -> bool:
    value = raw.get(key, default)
    if isinstance(value, bool):
        return value
    logger.warning("OrbitKV: option %s=%r is not a bool; using %s", key, value, default)
    return default


def _str(raw: Mapping[str, Any], key: str, default: str) -> str:
    value = raw.get(key, default)
    if isinstance(value, str):
        return value
    logger.warning("OrbitKV: option %s=%r is not a string; using the default", key, value)
    return default


def _modes(value: Any, default: frozenset[str]) -> frozenset[str]:
    if value is None:
        return default
    if isinstance(value, Mapping):
        modes = set(default)
        for name, is_on in value.items():
            if name not in ALL_MODES or not isinstance(is_on, bool):
                logger.warning("OrbitKV: option modes.%s=%r ignored", name, is_on)
            elif is_on:
                modes.add(name)
            else:
                modes.discard(name)
        return frozenset(modes)
    if isinstance(value, (list, tuple)) and all(v in ALL_MODES for v in value):
        return frozenset(value)
    logger.warning("OrbitKV: option modes=%r ignored; expected names from %s", value, ALL_MODES)
    return default


def _ints(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        return tuple(sorted(set(value)))
    logger.warning("OrbitKV: option chunk_boundaries=%r ignored; expected ints", value)
    return ()


def _rank(value: Any) -> int:
    if value is None:
        return 0
    if isinstance(value, int) and not isinstance(value, bool) and 0 < value <= 4096:
        return value
    logger.warning("OrbitKV: option patch_rank=%r ignored; expected an int in 1..4096", value)
    return 0


def _role(value: Any) -> str:
    if value is None:
        return ""
    if value in ROLES:
        return value
    logger.warning("OrbitKV: option role=%r ignored; expected one of %s", value, ROLES[1:])
    return ""
