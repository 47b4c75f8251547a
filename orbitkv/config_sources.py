"""Where ``OrbitKVConfig`` reads its values from: a YAML file or an overrides mapping (LMCache's
keys at top level, OrbitKV's under ``orbitkv:`` or prefixed ``orbitkv_``) and the ``ORBITKV_*``
environment. Read only by ``config.py``, which gives each function its fields' rules and coercion;
every unknown key is a ``ValueError`` naming the key and its source."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml

from orbitkv.config_keys import (
    ENV_PREFIX,
    LMCACHE_IGNORED_KEYS,
    LMCACHE_KEYS,
    PREFIX,
    RESERVED_ENV,
    SECTION,
)

# (field name, raw value) -> the field's value, or ValueError.
Coerce = Callable[[str, Any], Any]


def read_yaml(path: Path) -> Mapping[str, Any]:
    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"config file {path}: cannot load: {exc}") from exc
    if not isinstance(doc, (Mapping, type(None))):
        raise ValueError(f"config file {path}: expected a mapping at top level")
    return doc or {}


def from_document(
    doc: Mapping[str, Any], source: str, ignored: set[str], rules: Mapping[str, Any],
    coerce: Coerce, *, is_flat_ok: bool = False,
) -> dict[str, Any]:
    """Map one document (a file or an overrides dict) to field values, naming the source on error.

    ``is_flat_ok`` lets programmatic overrides use bare OrbitKV names (``tenant=...``): they are
    written by code against this module, not by a user who could collide with an LMCache key.
    """
    out: dict[str, Any] = {}
    origins: dict[str, str] = {}

    def put(name: str, value: Any, where: str) -> None:
        if name in origins:
            raise ValueError(f"{source}: {name} is set twice ({origins[name]} and {where})")
        try:
            out[name] = coerce(name, value)
        except ValueError as exc:
            raise ValueError(f"{source}: {where}: {exc}") from None
        origins[name] = where

    for key, value in doc.items():
        if not isinstance(key, str):
            raise ValueError(f"{source}: key {key!r} is not a string")
        if key == SECTION:
            if not isinstance(value, Mapping):
                raise ValueError(f"{source}: '{SECTION}' must be a mapping")
            for sub, sub_value in value.items():
                if sub not in rules:
                    raise ValueError(f"{source}: unknown key {SECTION}.{sub!s}")
                put(sub, sub_value, f"{SECTION}.{sub}")
        elif key.startswith(PREFIX) and key[len(PREFIX) :] in rules:
            put(key[len(PREFIX) :], value, key)
        elif key in LMCACHE_KEYS or (is_flat_ok and key in rules):
            put(key, value, key)
        elif key in LMCACHE_IGNORED_KEYS:
            ignored.add(key)
        elif key in rules:
            raise ValueError(
                f"{source}: unknown top-level key {key!r}; OrbitKV keys go under '{SECTION}:' "
                f"or take the prefix '{PREFIX}' ({PREFIX}{key})"
            )
        else:
            raise ValueError(f"{source}: unknown key {key!r}")
    return out


def from_env(env: Mapping[str, str], rules: Mapping[str, Any], coerce: Coerce) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for var, value in env.items():
        if not var.startswith(ENV_PREFIX) or var in RESERVED_ENV:
            continue
        name = var[len(ENV_PREFIX) :].lower()
        if name not in rules:
            raise ValueError(f"env {var}: unknown key {name!r}")
        if value == "":
            continue  # unset (docker compose passes ${VAR:-} through as an empty string)
        try:
            out[name] = coerce(name, value)
        except ValueError as exc:
            raise ValueError(f"env {var}: {exc}") from None
    return out
