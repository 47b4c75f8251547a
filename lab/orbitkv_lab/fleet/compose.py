"""Read a docker-compose file the way ``docker compose`` does, without a Docker engine.

``load_compose(path, env)`` gives every service of the file with compose's variable interpolation
applied (``$VAR``, ``${VAR}``, ``${VAR:-default}``, ``${VAR-default}``, ``${VAR:?error}``,
``${VAR?error}``, ``${VAR:+alt}``, ``${VAR+alt}``, nested defaults, ``$$`` for a literal ``$``),
YAML anchors and merge keys resolved, and the fields the local runner needs normalized. ``env`` is
what compose would interpolate from: ``compose_env`` builds it as compose does, the ``.env`` file
beside the compose file overridden by the caller's environment.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class ComposeError(ValueError):
    """A compose file this module cannot read, or a required variable that is not set."""


def interpolate(text: str, env: Mapping[str, str]) -> str:
    """Compose's ``${...}`` interpolation of one string."""
    out, i = [], 0
    while i < len(text):
        ch = text[i]
        if ch != "$":
            out.append(ch)
            i += 1
            continue
        nxt = text[i + 1 : i + 2]
        if nxt == "$":
            out.append("$")
            i += 2
        elif nxt == "{":
            value, i = _braced(text, i + 2, env)
            out.append(value)
        elif (m := _NAME.match(text, i + 1)) is not None:
            out.append(env.get(m.group(0), ""))
            i = m.end()
        else:
            out.append("$")
            i += 1
    return "".join(out)


def _braced(text: str, start: int, env: Mapping[str, str]) -> tuple[str, int]:
    """``${...}`` from just after the brace; returns the value and the index after ``}``."""
    m = _NAME.match(text, start)
    if m is None:
        raise ComposeError(f"bad variable reference in {text!r}")
    name, i = m.group(0), m.end()
    op = ""
    for candidate in (":-", ":?", ":+", "-", "?", "+"):
        if text.startswith(candidate, i):
            op, i = candidate, i + len(candidate)
            break
    # The operand runs to the matching brace; nested ${...} inside it count.
    depth, j = 1, i
    while j < len(text):
        if text.startswith("${", j):
            depth += 1
            j += 2
            continue
        if text[j] == "}":
            depth -= 1
            if depth == 0:
                break
        j += 1
    if depth:
        raise ComposeError(f"unclosed ${{ in {text!r}")
    operand, end = text[i:j], j + 1
    if not op and operand:
        raise ComposeError(f"bad variable reference in {text!r}")
    value = env.get(name)
    is_set = value is not None
    is_nonempty = bool(value)
    is_present = is_nonempty if op.startswith(":") else is_set
    kind = op[-1:] if op else ""
    if kind == "-":
        return (value if is_present else interpolate(operand, env)), end
    if kind == "?":
        if not is_present:
            raise ComposeError(f"required variable {name} is missing: {interpolate(operand, env)}")
        return value, end
    if kind == "+":
        return (interpolate(operand, env) if is_present else ""), end
    return (value or ""), end


def _walk(node: Any, env: Mapping[str, str]) -> Any:
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, list):
        return [_walk(v, env) for v in node]
    if isinstance(node, dict):
        return {k: _walk(v, env) for k, v in node.items()}
    return node


@dataclass(frozen=True)
class Mount:
    source: str  # a host path (resolved against the compose file's folder) or a named volume
    target: str
    is_read_only: bool
    is_named: bool


@dataclass(frozen=True)
class Service:
    name: str
    argv: tuple[str, ...]  # entrypoint + command, as the container runs it
    environment: dict[str, str]
    mounts: tuple[Mount, ...]
    exposed_ports: tuple[int, ...]
    profiles: tuple[str, ...]
    aliases: tuple[str, ...]
    depends_on: dict[str, dict[str, Any]]
    healthcheck: dict[str, Any] | None
    raw: dict[str, Any] = field(repr=False, default_factory=dict)

    def is_active(self, profiles: set[str]) -> bool:
        return not self.profiles or bool(profiles & set(self.profiles))


def compose_env(compose_path: str | os.PathLike[str], overrides: Mapping[str, str] | None = None,
                env_file: str | os.PathLike[str] | None = None) -> dict[str, str]:
    """The interpolation environment: ``env_file`` (default ``.env`` beside the file, if any),
    then ``overrides`` on top (compose: the shell's environment wins over ``.env``)."""
    from dotenv import dotenv_values

    path = Path(env_file) if env_file is not None else Path(compose_path).parent / ".env"
    values: dict[str, str] = {}
    if path.is_file():
        values = {k: v or "" for k, v in dotenv_values(path).items()}
    values.update(overrides or {})
    return values


def _as_argv(value: Any, where: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return shlex.split(value)
    if isinstance(value, list) and all(isinstance(v, (str, int, float)) for v in value):
        return [str(v) for v in value]
    raise ComposeError(f"{where}: expected a string or a list of strings")


def _environment(value: Any, where: str) -> dict[str, str]:
    if value is None:
        return {}
    if isinstance(value, dict):
        return {str(k): "" if v is None else str(v) for k, v in value.items()}
    if isinstance(value, list):
        out = {}
        for item in value:
            key, _, val = str(item).partition("=")
            out[key] = val
        return out
    raise ComposeError(f"{where}: expected a mapping or a list")


def _mounts(value: Any, base: Path, where: str) -> tuple[Mount, ...]:
    out = []
    for item in value or ():
        if not isinstance(item, str):
            raise ComposeError(f"{where}: only the short volume syntax is supported, got {item!r}")
        parts = item.split(":")
        if len(parts) not in (2, 3):
            raise ComposeError(f"{where}: bad volume {item!r}")
        source, target = parts[0], parts[1]
        is_named = not source.startswith((".", "/", "~"))
        if not is_named:
            source = str((base / Path(source).expanduser()).resolve())
        out.append(Mount(source, target, len(parts) == 3 and "ro" in parts[2].split(","), is_named))
    return tuple(out)


def _depends_on(value: Any) -> dict[str, dict[str, Any]]:
    if isinstance(value, list):
        return {name: {"condition": "service_started"} for name in value}
    return {name: dict(spec or {}) for name, spec in (value or {}).items()}


def load_compose(path: str | os.PathLike[str], env: Mapping[str, str]) -> dict[str, Service]:
    """Every service in the file, interpolated with ``env``; raises ``ComposeError`` on a missing
    required variable or a construct the local runner does not read."""
    path = Path(path)
    doc = yaml.safe_load(path.read_text())
    if not isinstance(doc, dict) or not isinstance(doc.get("services"), dict):
        raise ComposeError(f"{path}: no services")
    services = {}
    for name, spec in doc["services"].items():
        spec = _walk(spec, env)
        where = f"{path}: services.{name}"
        networks = spec.get("networks") or {}
        aliases = []
        if isinstance(networks, dict):
            for net in networks.values():
                aliases += list((net or {}).get("aliases") or [])
        services[name] = Service(
            name=name,
            argv=tuple(_as_argv(spec.get("entrypoint"), f"{where}.entrypoint")
                       + _as_argv(spec.get("command"), f"{where}.command")),
            environment=_environment(spec.get("environment"), f"{where}.environment"),
            mounts=_mounts(spec.get("volumes"), path.parent, f"{where}.volumes"),
            exposed_ports=tuple(int(str(p).split("/")[0]) for p in spec.get("expose") or ()),
            profiles=tuple(spec.get("profiles") or ()),
            aliases=tuple(aliases),
            depends_on=_depends_on(spec.get("depends_on")),
            healthcheck=spec.get("healthcheck"),
            raw=spec,
        )
    return services
