"""Per-request options, read from ``kv_transfer_params={"orbitkv": {...}}``.

Keys (all optional):
  load: bool           serve cached chunks to this request (default true)
  save: bool           store the chunks this request computes (default true)
  modes: list | dict   reuse modes allowed: a list of names, or {"blind": true, ...} applied
                       on top of the configured ones
  tenant: str          tenant namespace for the content keys (default: the config's tenant), only
                       one of the config's ``request_tenants``: the tenant is the deployment's, and
                       a request naming another is refused (served by vLLM alone). vLLM's
                       ``cache_salt`` is hashed beside it: keys differ per (tenant, salt) pair.
  chunk_boundaries: [int]   extra text cut points (token offsets), e.g. document ends
  role: str            "canonicalize": a request ``[anchor . B]`` sent to form B's canonical
  patch_rank: int      serve patches stored at this rank (default: the configured patch_rank)

The scheduler must never crash on a client's typo, so a bad value is logged and the default kept.

``RequestRules`` then applies the deployment's rules (``OrbitKVConfig``): the tenant allow-list, and
who may receive approximate KV (``approximate_reuse``: only requests with a vLLM ``cache_salt`` by
default, so one user's answer is never conditioned on another user's removed chunks). The result
carries the request's lineage policy (``lineage.Policy``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .lineage import EXACT_POLICY, Policy
from .planner import ALL_MODES, BLIND, EXACT, ORBIT, PATCHED, SURVIVOR, TRANSFER, TRANSFER_ATTACHED

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
    # The approximate KV this request accepts (set by RequestRules; exact until then).
    policy: Policy = EXACT_POLICY
    # Why OrbitKV neither loads nor saves for this request ("" when it does).
    refusal: str = ""


def configured_modes(config: Any) -> frozenset[str]:
    """Modes allowed by an ``OrbitKVConfig``; patched is on whenever patches are formed."""
    modes = set()
    if config.enable_exact:
        modes.add(EXACT)
    if config.enable_survivor:
        modes.add(SURVIVOR)
    if config.transfer_modalities or config.transfer_attached_modalities:
        modes.add(TRANSFER)  # narrowed to those modalities per chunk (mode_filter)
    if config.enable_blind:
        modes.add(BLIND)
    if config.patch_rank > 0:
        modes |= {PATCHED, ORBIT}
    if config.blind_modalities:
        modes.add(BLIND)  # narrowed to those modalities per chunk (mode_filter)
    return frozenset(modes)


class RequestRules:
    """The deployment's rules for what a request may ask (tenants, approximate KV)."""

    def __init__(self, config: Any) -> None:
        self._config = config
        self._default_modes = configured_modes(config)
        self._request_tenants = frozenset(config.request_tenants)
        self._blind_scope = ("*",) if config.enable_blind else tuple(config.blind_modalities)
        attached = tuple(f"{m}@attached" for m in config.transfer_attached_modalities)
        self._transfer_scope = tuple(config.transfer_modalities) + attached or ("*",)

    def options(self, params: Mapping[str, Any] | None, cache_salt: str | None) -> RequestOptions:
        config = self._config
        opts = parse_options(params, default_modes=self._default_modes, default_tenant=config.tenant)
        if opts.tenant != config.tenant and opts.tenant not in self._request_tenants:
            return dataclasses.replace(
                opts, is_load_enabled=False, is_save_enabled=False, tenant=config.tenant,
                refusal=f"tenant {opts.tenant!r} is not one of request_tenants",
            )  # fmt: skip
        modes = opts.modes
        if not opts.is_load_enabled or not self._may_approximate(cache_salt):
            modes = modes & {EXACT}
        policy = Policy.of(
            modes, opts.patch_rank or config.patch_rank, self._blind_scope, self._transfer_scope
        )
        return dataclasses.replace(opts, modes=modes, policy=policy)

    def _may_approximate(self, cache_salt: str | None) -> bool:
        scope = self._config.approximate_reuse
        return scope == "shared" or (scope == "salted" and bool(cache_salt))


def mode_filter(config: Any):
    """Per chunk: blind only for ``blind_modalities`` unless ``enable_blind`` allows it for all,
    transfer only for ``transfer_modalities`` (from any stored antecedent) and
    ``transfer_attached_modalities`` (``TRANSFER_ATTACHED``: from one ending with the same chunk).
    An empty list does not narrow: the mode is then off unless a request names it, and a request
    naming it gets it for every chunk."""
    scopes: list[tuple[str, frozenset[str]]] = []
    if config.blind_modalities and not config.enable_blind:
        scopes.append((BLIND, frozenset(config.blind_modalities)))
    attached = frozenset(config.transfer_attached_modalities) - frozenset(config.transfer_modalities)
    if config.transfer_modalities or attached:
        scopes.append((TRANSFER, frozenset(config.transfer_modalities)))
    if not scopes:
        return None
    every = frozenset(ALL_MODES)

    def modes_for(chunk: Any) -> frozenset[str]:
        modality = chunk.modality if chunk.is_mm else "text"
        out = every - {mode for mode, scope in scopes if modality not in scope}
        return out | {TRANSFER_ATTACHED} if modality in attached else out

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
