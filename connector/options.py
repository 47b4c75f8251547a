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

The scheduler must never crash on a client's typo, so a bad value is logged and the default kept.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .planner import ALL_MODES, BLIND, EXACT, PATCHED, SURVIVOR

logger = logging.getLogger(__name__)

KEYS = frozenset({"load", "save", "modes", "tenant", "chunk_boundaries", "role"})
ROLES = ("", "canonicalize")


@dataclass(frozen=True, slots=True)
class RequestOptions:
    is_load_enabled: bool = True
    is_save_enabled: bool = True
    modes: frozenset[str] = frozenset({EXACT, SURVIVOR})
    tenant: str = ""
    chunk_boundaries: tuple[int, ...] = ()
    role: str = ""


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
        modes.add(PATCHED)
    return frozenset(modes)


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


def _role(value: Any) -> str:
    if value is None:
        return ""
    if value in ROLES:
        return value
    logger.warning("OrbitKV: option role=%r ignored; expected one of %s", value, ROLES[1:])
    return ""
