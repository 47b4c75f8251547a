"""``LocalFleet``: the active services of a compose file as local processes, started as compose
starts them (dependency order, each level together, waiting on ``depends_on`` conditions).

    fleet = LocalFleet("deploy/docker-compose.yml", profiles={"cpu", "redis"}, env=env, workdir=tmp)
    with fleet:
        fleet.up()                                   # redis, vllm-cpu-0 + vllm-cpu-1, router
        router = fleet.url("router", 8000)
        fleet.kill("redis"); fleet.restart("vllm-cpu-1")
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

from .compose import Service, load_compose
from .local import PortAllocator, Process, Translator, free_port

HEALTH_POLL_S = 0.5


class FleetError(RuntimeError):
    """A service that exited, or did not become healthy in time; the message has its log's tail."""


class LocalFleet:
    def __init__(
        self,
        compose_path: str | os.PathLike[str],
        *,
        profiles: Iterable[str],
        env: Mapping[str, str],
        workdir: str | os.PathLike[str],
        allocate: PortAllocator = free_port,
        base_env: Mapping[str, str] | None = None,
    ) -> None:
        self.profiles = set(profiles)
        every = load_compose(compose_path, env)
        self.services: dict[str, Service] = {n: s for n, s in every.items() if s.is_active(self.profiles)}
        self.workdir = Path(workdir)
        self.translator = Translator(self.services, self.workdir, allocate)
        self.base_env = dict(os.environ if base_env is None else base_env)
        self.processes: dict[str, Process] = {}

    # -- addresses -------------------------------------------------------------------------------

    def url(self, name: str, container_port: int, scheme: str = "http") -> str:
        return self.translator.url(name, container_port, scheme)

    def port(self, name: str, container_port: int) -> int:
        return self.translator.port(name, container_port)

    def log_path(self, name: str) -> Path:
        return self.workdir / "logs" / f"{name}.log"

    # -- one service -----------------------------------------------------------------------------

    def process(self, name: str) -> Process:
        svc = self.services[name]
        t = self.translator
        return Process(svc, t.argv(svc), t.environment(svc, self.base_env),
                       self.workdir / "run" / name, self.log_path(name))

    def start(self, name: str) -> Process:
        current = self.processes.get(name)
        if current is not None and current.is_running:
            return current
        self.processes[name] = self.process(name).start()
        return self.processes[name]

    def wait_healthy(self, name: str, timeout_s: float = 600.0) -> None:
        proc = self.processes[name]
        check = self.translator.healthcheck_argv(proc.service)
        if check is None:
            return
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not proc.is_running:
                raise FleetError(f"{name} exited before it was healthy; {proc.log_path}:\n{proc.log_tail()}")
            try:
                if subprocess.run(check, env=proc.env, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL, timeout=10).returncode == 0:
                    return
            except subprocess.TimeoutExpired:
                pass
            time.sleep(HEALTH_POLL_S)
        raise FleetError(f"{name} not healthy after {timeout_s:.0f}s; {proc.log_path}:\n{proc.log_tail()}")

    def wait_completed(self, name: str, timeout_s: float = 120.0) -> None:
        proc = self.processes[name]
        assert proc.proc is not None
        try:
            rc = proc.proc.wait(timeout_s)
        except subprocess.TimeoutExpired as exc:
            raise FleetError(f"{name} still running after {timeout_s:.0f}s:\n{proc.log_tail()}") from exc
        if rc != 0:
            raise FleetError(f"{name} exited with {rc}; {proc.log_path}:\n{proc.log_tail()}")

    def stop(self, name: str) -> None:
        proc = self.processes.get(name)
        if proc is not None:
            proc.stop()

    def kill(self, name: str) -> None:
        """SIGKILL: a crash, not a shutdown."""
        proc = self.processes.get(name)
        if proc is not None:
            proc.kill()

    def restart(self, name: str, timeout_s: float = 600.0) -> None:
        self.stop(name)
        self.start(name)
        self.wait_healthy(name, timeout_s)

    # -- the whole fleet ---------------------------------------------------------------------------

    def levels(self, names: Iterable[str] | None = None) -> list[list[str]]:
        """Services grouped by dependency depth (compose starts each group together)."""
        wanted = set(self.services if names is None else names)
        depth: dict[str, int] = {}

        def visit(name: str, path: tuple[str, ...]) -> int:
            if name in path:
                raise ValueError(f"dependency cycle: {' -> '.join(path + (name,))}")
            if name not in depth:
                deps = [d for d in self.services[name].depends_on if d in self.services]
                depth[name] = 1 + max((visit(d, path + (name,)) for d in deps), default=-1)
            return depth[name]

        for name in sorted(wanted):
            visit(name, ())
        for name, svc in self.services.items():
            for dep, spec in svc.depends_on.items():
                if dep not in self.services and name in depth and spec.get("required", True):
                    raise ValueError(f"{name} depends on {dep}, which no active profile starts")
        by_level: dict[int, list[str]] = {}
        for name, d in depth.items():
            by_level.setdefault(d, []).append(name)
        return [sorted(by_level[d]) for d in sorted(by_level)]

    def up(self, names: Iterable[str] | None = None, timeout_s: float = 600.0) -> None:
        """Start ``names`` (default: every active service) and what they depend on."""
        one_shot = {dep for svc in self.services.values() for dep, spec in svc.depends_on.items()
                    if spec.get("condition") == "service_completed_successfully"}
        for level in self.levels(names):
            for name in level:
                self.start(name)
            for name in level:
                if name in one_shot:
                    self.wait_completed(name, timeout_s)
                else:
                    self.wait_healthy(name, timeout_s)

    def logs(self) -> dict[str, str]:
        out = {}
        for name in self.services:
            path = self.log_path(name)
            if path.exists():
                out[name] = path.read_text(errors="replace")
        return out

    def close(self) -> None:
        for name in reversed(list(self.processes)):
            self.processes[name].stop()

    def __enter__(self) -> LocalFleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
