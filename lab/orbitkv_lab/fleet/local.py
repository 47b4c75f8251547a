"""Run a compose file's services as local processes, with their own commands and config files.

There is no Docker engine on the machines that test this project, so the fleet of
``deploy/docker-compose.yml`` is proven by running each service's own entrypoint + command here,
translated only where a container and a host differ:

- addresses: ``service:port`` (or a network alias) becomes ``127.0.0.1:<free port>``; a service's
  own exposed port and ``0.0.0.0`` become its local port and ``127.0.0.1``: everything listens on
  loopback only;
- paths: a bind mount's container path becomes the host path it mounts (``./config/...`` stays the
  very file the container reads); a named volume becomes a folder under the fleet's work dir;
- executables: the venv's console scripts first (``orbitkv``, ``vllm-router``), then ``PATH``.

Health is the service's own healthcheck command, translated the same way; a service without one
that others wait on with ``service_completed_successfully`` runs to completion.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from .compose import Service

LOOPBACK = "127.0.0.1"
PortAllocator = Callable[[str, int], int]


_TAKEN: set[int] = set()


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(service: str = "", port: int = 0) -> int:
    """A free loopback port below the kernel's ephemeral range: the fleet's processes (vLLM's
    engines among them) bind ephemeral ports of their own while the others start, and one of
    those must not land on a port handed out here before its service binds it."""
    import random
    import socket

    low = min(_ephemeral_low(), 65536) - 1
    for _ in range(500):
        candidate = random.randint(20000, max(20001, low))
        if candidate in _TAKEN:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((LOOPBACK, candidate))
            except OSError:
                continue
        _TAKEN.add(candidate)
        return candidate
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


@dataclass
class Translator:
    """Maps container addresses and paths of the active services onto this host."""

    services: Mapping[str, Service]
    workdir: Path
    allocate: PortAllocator = free_port

    def __post_init__(self) -> None:
        self.ports: dict[tuple[str, int], int] = {}
        self.names: dict[str, str] = {}  # service name or alias -> service name
        for svc in self.services.values():
            for alias in (svc.name, *svc.aliases):
                if alias in self.names and self.names[alias] != svc.name:
                    raise ValueError(f"{alias!r} names both {self.names[alias]} and {svc.name}")
                self.names[alias] = svc.name
            for port in svc.exposed_ports:
                self.ports[(svc.name, port)] = self.allocate(svc.name, port)

    def port(self, name: str, container_port: int) -> int:
        return self.ports[(self.names[name], container_port)]

    def url(self, name: str, container_port: int, scheme: str = "http") -> str:
        return f"{scheme}://{LOOPBACK}:{self.port(name, container_port)}"

    def volume_dir(self, service: str, volume: str) -> Path:
        path = self.workdir / "volumes" / volume
        path.mkdir(parents=True, exist_ok=True)
        return path

    def text(self, svc: Service, value: str) -> str:
        """One argument, environment value or shell line of ``svc``, translated."""
        names = "|".join(sorted((re.escape(n) for n in self.names), key=len, reverse=True))

        def address(m: re.Match) -> str:
            name, port = m.group(1), int(m.group(2))
            if (self.names.get(name), port) in self.ports:
                return f"{LOOPBACK}:{self.port(name, port)}"
            return m.group(0)

        if names:
            value = re.sub(rf"(?<![\w.-])({names}):(\d+)(?![\w])", address, value)

        def own(m: re.Match) -> str:
            port = int(m.group(2))
            return f"{LOOPBACK}:{self.ports[(svc.name, port)]}" if (svc.name, port) in self.ports else m.group(0)

        value = re.sub(r"(?<![\w.-])(127\.0\.0\.1|localhost|0\.0\.0\.0):(\d+)(?![\w])", own, value)
        # A ZMQ bind on every interface (vLLM's event publisher binds only a "*" endpoint, and
        # connects to any other): the port is translated, the "*" stays.
        value = re.sub(r"(?<=tcp://)\*:(\d+)(?![\w])", lambda m: f"*:{self.ports[(svc.name, int(m.group(1)))]}"
                       if (svc.name, int(m.group(1))) in self.ports else m.group(0), value)
        for port in svc.exposed_ports:
            value = re.sub(rf"(?<![\w.:/-]){port}(?![\w.:/-])", str(self.ports[(svc.name, port)]), value)
        value = re.sub(r"(?<![\w.])0\.0\.0\.0(?![\w.])", LOOPBACK, value)
        for mount in sorted(svc.mounts, key=lambda m: len(m.target), reverse=True):
            source = str(self.volume_dir(svc.name, mount.source)) if mount.is_named else mount.source
            value = re.sub(rf"(?<![\w./-]){re.escape(mount.target)}(?=/|$|[\s:'\"])", source, value)
        return value

    def argv(self, svc: Service, argv: Iterable[str] | None = None) -> list[str]:
        out = [self.text(svc, a) for a in (svc.argv if argv is None else argv)]
        if out:
            out[0] = executable(out[0])
        return out

    def environment(self, svc: Service, base: Mapping[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ if base is None else base)
        env.update({k: self.text(svc, v) for k, v in svc.environment.items()})
        return env

    def healthcheck_argv(self, svc: Service) -> list[str] | None:
        test = (svc.healthcheck or {}).get("test")
        if not test or test == ["NONE"]:
            return None
        if isinstance(test, str):
            return ["sh", "-c", self.text(svc, test)]
        if test[0] == "CMD-SHELL":
            return ["sh", "-c", self.text(svc, " ".join(test[1:]))]
        if test[0] == "CMD":
            return self.argv(svc, test[1:])
        raise ValueError(f"{svc.name}: unsupported healthcheck {test!r}")


def executable(name: str) -> str:
    if "/" in name:
        return name
    venv_bin = Path(sys.executable).parent / name
    if venv_bin.exists():
        return str(venv_bin)
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"{name!r} is not installed here (needed by a compose service)")
    return found


@dataclass
class Process:
    """One service as a process group; its stdout and stderr go to ``log_path``."""

    service: Service
    argv: list[str]
    env: dict[str, str]
    cwd: Path
    log_path: Path
    proc: subprocess.Popen | None = None

    def start(self) -> Process:
        self.cwd.mkdir(parents=True, exist_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv, env=self.env, cwd=self.cwd, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        return self

    @property
    def is_running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, num_lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])
        except OSError:
            return ""

    def stop(self, sig: int = signal.SIGINT, timeout_s: float = 30.0) -> None:
        """``sig`` to the service's main process (vLLM's API server shuts its engine down on
        SIGINT), then SIGKILL to whatever is left of its process group."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(sig)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)

    def kill(self) -> None:
        self.stop(signal.SIGKILL, timeout_s=5.0)
