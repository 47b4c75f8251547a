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
  recompute_fraction: float  the share of a ``recompute`` chunk computed fresh, in (0, 1]
                       (default: the configured recompute_fraction)
  approximate: bool    opt in to approximate KV (under ``approximate_reuse: request``); without it
                       a request is served exact whatever its modes name

The scheduler must never crash on a client's typo, so a bad value is logged and the default kept.

``RequestRules`` then applies the deployment's rules (``OrbitKVConfig``) once per request: the
tenant allow-list, and who may receive approximate KV. Exact is the default for every request,
salted or not (a ``cache_salt`` isolates, it never opts in): approximate KV needs the deployment to
allow it (``approximate_reuse``: ``request`` for requests that opt in, ``all`` for every request)
and is served only in the modes the calibration measured within budget on this model and the audit
has not switched off (``calibration.ModeGate``). The result carries the request's policy
(``lineage.Policy``), the one thing the planner is given about what it may serve.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .calibration import GATED_MODES, ModeGate
from .lineage import ATTACHED, EVERY_MODALITY, EXACT_POLICY, Policy
from .planner import ALL_MODES, BLIND, EXACT, ORBIT, PATCHED, RECOMPUTE, SURVIVOR, TRANSFER

if TYPE_CHECKING:
    from orbitkv.config import OrbitKVConfig

logger = logging.getLogger(__name__)

KEYS = frozenset(
    {"load", "save", "modes", "tenant", "chunk_boundaries", "role", "patch_rank", "approximate",
     "recompute_fraction"}
)
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
    # A recompute chunk's share computed fresh (0: the configured recompute_fraction).
    recompute_fraction: float = 0.0
    # The request asked for approximate KV (kv_transfer_params.orbitkv.approximate).
    is_approximate_requested: bool = False
    # The approximate KV this request accepts (set by RequestRules; exact until then).
    policy: Policy = EXACT_POLICY
    # Why OrbitKV neither loads nor saves for this request ("" when it does).
    refusal: str = ""


def configured_modes(config: OrbitKVConfig) -> frozenset[str]:
    """Modes allowed by an ``OrbitKVConfig``; patched is on whenever patches are formed."""
    modes = set()
    if config.enable_exact:
        modes.add(EXACT)
    if config.enable_survivor:
        modes.add(SURVIVOR)
    if config.transfer_modalities or config.transfer_attached_modalities:
        modes.add(TRANSFER)  # narrowed to those modalities per chunk (Policy.mode_filter)
    if config.enable_blind:
        modes.add(BLIND)
    if config.patch_rank > 0:
        modes |= {PATCHED, ORBIT}
    if config.blind_modalities:
        modes.add(BLIND)  # narrowed to those modalities per chunk (Policy.mode_filter)
    if config.enable_recompute:
        modes.add(RECOMPUTE)
    return frozenset(modes)


# Distinct option sets kept resolved (a deployment's clients send a handful).
_MAX_RESOLVED = 256


class RequestRules:
    """The deployment's rules for what a request may ask (tenants, approximate KV)."""

    def __init__(self, config: OrbitKVConfig, gate: ModeGate | None = None) -> None:
        self._config = config
        self._gate = gate
        self._default_modes = configured_modes(config)
        self._request_tenants = frozenset(config.request_tenants)
        # An empty list does not narrow: a request that names the mode gets it for every chunk.
        blind = tuple(config.blind_modalities) if not config.enable_blind else ()
        blind = blind or (EVERY_MODALITY,)
        attached = tuple(f"{m}{ATTACHED}" for m in config.transfer_attached_modalities)
        transfer = tuple(config.transfer_modalities) + attached or (EVERY_MODALITY,)
        self._configured_scopes = {BLIND: blind, TRANSFER: transfer}
        self._has_warned_unrequested = False
        # What a request that names no option gets, while no request can be served approximate
        # KV without naming it: the same every time, so resolved once, not per request.
        self._plain: RequestOptions | None = None
        # The options as sent (their repr: JSON values) -> what they resolve to, where no gate
        # was asked (a gate's verdicts change while serving): an agent sends the same options
        # with every request, and resolving them cost about 40 us a request on cold caches.
        self._resolved: dict[str, RequestOptions] = {}

    def options(self, params: Mapping[str, Any] | None, cache_salt: str | None) -> RequestOptions:
        """The request's options with its policy, resolved once (``cache_salt`` only namespaces)."""
        raw = _raw(params)
        if self._config.approximate_reuse != "all" and raw is None:
            if self._plain is None:
                self._plain = self._resolve(None)
            return self._plain
        key = repr(raw)
        found = self._resolved.get(key)
        if found is not None:
            return found
        opts = self._resolve(params)
        if not opts.modes & GATED_MODES:
            if len(self._resolved) >= _MAX_RESOLVED:
                self._resolved.clear()
            self._resolved[key] = opts
        return opts

    def _resolve(self, params: Mapping[str, Any] | None) -> RequestOptions:
        config = self._config
        opts = parse_options(params, default_modes=self._default_modes, default_tenant=config.tenant)
        if opts.tenant != config.tenant and opts.tenant not in self._request_tenants:
            return dataclasses.replace(
                opts, is_load_enabled=False, is_save_enabled=False, tenant=config.tenant,
                modes=opts.modes & {EXACT}, refusal=f"tenant {opts.tenant!r} is not one of request_tenants",
            )
        modes = opts.modes
        if not opts.is_load_enabled or not self._may_approximate(opts, params):
            modes = modes & {EXACT}
        rank = opts.patch_rank or config.patch_rank
        fraction = opts.recompute_fraction or config.recompute_fraction
        policy = Policy.of(modes, rank, self._scopes(modes, rank, fraction), fraction)
        modes = (modes & {EXACT}) | policy.modes
        return dataclasses.replace(opts, modes=modes, policy=policy)

    def _scopes(
        self, modes: frozenset[str], patch_rank: int, recompute_fraction: float
    ) -> dict[str, tuple[str, ...]]:
        scopes = {}
        for mode in modes & GATED_MODES:
            scope = self._configured_scopes.get(mode, (EVERY_MODALITY,))
            scopes[mode] = (
                self._gate.narrow(mode, scope, patch_rank, recompute_fraction)
                if self._gate else scope
            )
        return scopes

    def _may_approximate(self, opts: RequestOptions, params: Mapping[str, Any] | None) -> bool:
        scope = self._config.approximate_reuse
        if scope == "all":
            return True
        if scope == "request" and opts.is_approximate_requested:
            return True
        if opts.modes - {EXACT} and _names_modes(params) and not self._has_warned_unrequested:
            self._has_warned_unrequested = True
            logger.warning(
                "OrbitKV: a request names approximate modes without opting in (approximate_reuse=%s, "
                "request option approximate=%s): it is served exact", scope,
                opts.is_approximate_requested,
            )
        return False


def _raw(params: Mapping[str, Any] | None) -> Any:
    """The request's ``orbitkv`` options as sent (None: it sent none)."""
    return params.get("orbitkv") if isinstance(params, Mapping) else None


def _names_modes(params: Mapping[str, Any] | None) -> bool:
    raw = _raw(params)
    return isinstance(raw, Mapping) and raw.get("modes") is not None


def parse_options(
    params: Mapping[str, Any] | None, *, default_modes: frozenset[str], default_tenant: str
) -> RequestOptions:
    raw = _raw(params)
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
        recompute_fraction=_fraction(raw.get("recompute_fraction")),
        is_approximate_requested=_bool(raw, "approximate", False),
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


def _fraction(value: Any) -> float:
    if value is None:
        return 0.0
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= 1:
        return float(value)
    logger.warning("OrbitKV: option recompute_fraction=%r ignored; expected a number in (0, 1]", value)
    return 0.0


def _role(value: Any) -> str:
    if value is None:
        return ""
    if value in ROLES:
        return value
    logger.warning("OrbitKV: option role=%r ignored; expected one of %s", value, ROLES[1:])
    return ""
