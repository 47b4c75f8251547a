"""Real redis-server processes on free loopback ports, for tests.

    with RedisServer() as server:          # or the pytest fixtures in tests/store/conftest.py
        url = server.url                   # "redis://127.0.0.1:PORT"
        server.kill()                      # SIGKILL, to inject a fault
        server.pause(); server.resume()    # SIGSTOP / SIGCONT: a hung server (timeouts)
        server.start()                     # again on the same port

    with RedisClusterServers(num_nodes=3) as cluster:
        url = cluster.url                  # "redis+cluster://127.0.0.1:PORT" (OrbitKV's cluster scheme)

Every server runs without persistence (``--save "" --appendonly no``) in its own temp directory and
binds only 127.0.0.1. Fixtures: ``redis_server`` (function scope) and ``redis_cluster`` (module scope),
defined in ``tests/store/conftest.py``; other suites import the classes from here.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time

import pytest

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"
REDIS_CLI = shutil.which("redis-cli") or "/usr/bin/redis-cli"


def has_redis() -> bool:
    return os.path.exists(REDIS_SERVER)


def _is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(*, is_cluster: bool = False) -> int:
    """A free loopback port; for a cluster node also its bus port (port + 10000, so port <= 55535)."""
    if not is_cluster:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    for _ in range(200):
        port = random.randint(20000, 45000)
        if _is_free(port) and _is_free(port + 10000):
            return port
    raise RuntimeError("no free port pair for a cluster node")


def _ping(port: int, password: str | None = None, timeout_s: float = 0.2) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
        if password:
            s.sendall(f"AUTH {password}\r\n".encode())
            s.recv(64)
        s.sendall(b"PING\r\n")
        return s.recv(64)


class RedisServer:
    """One redis-server process; ``start`` again after ``stop``/``kill`` reuses the port."""

    def __init__(
        self,
        port: int | None = None,
        *,
        password: str | None = None,
        extra_args: tuple = (),
        is_cluster: bool = False,
    ) -> None:
        self.port = port or free_port(is_cluster=is_cluster)
        self.password = password
        self.extra_args = tuple(extra_args)
        self.dir = tempfile.mkdtemp(prefix="orbitkv-redis-")
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        if self.proc is not None and self.proc.poll() is None:
            return self
        args = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", self.dir, "--daemonize", "no", "--loglevel", "warning"]
        if self.password:
            args += ["--requirepass", self.password]
        self.proc = subprocess.Popen(
            [*args, *self.extra_args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode} on {self.port}")
            try:
                if _ping(self.port, self.password).startswith(b"+PONG"):
                    return self
            except OSError:
                pass
            time.sleep(0.02)
        self.kill()
        raise RuntimeError(f"redis-server did not answer on port {self.port}")

    def _end(self, sig: int) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def stop(self) -> None:
        self._end(signal.SIGTERM)

    def kill(self) -> None:
        self._end(signal.SIGKILL)

    def pause(self) -> None:
        """SIGSTOP: the port stays open but nothing answers (a hung server, socket timeouts)."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGCONT)

    def close(self) -> None:
        self.resume()
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


class RedisClusterServers:
    """A local Redis Cluster of ``num_nodes`` masters, no replicas."""

    def __init__(self, num_nodes: int = 3, extra_args: tuple = ()) -> None:
        self.nodes = []
        for _ in range(num_nodes):
            node = RedisServer(is_cluster=True)
            node.extra_args = ("--cluster-enabled", "yes", "--cluster-config-file",
                               os.path.join(node.dir, "nodes.conf"), "--cluster-node-timeout", "2000",
                               *extra_args)
            self.nodes.append(node)

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    def start(self, timeout_s: float = 15.0) -> RedisClusterServers:
        for node in self.nodes:
            node.start()
        addrs = [f"127.0.0.1:{n.port}" for n in self.nodes]
        subprocess.run(
            [REDIS_CLI, "--cluster", "create", *addrs, "--cluster-replicas", "0", "--cluster-yes"],
            check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=timeout_s,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            states = [self._cluster_state(n.port) for n in self.nodes]
            if all(s == "ok" for s in states):
                return self
            time.sleep(0.1)
        self.close()
        raise RuntimeError("redis cluster did not reach cluster_state:ok")

    @staticmethod
    def _cluster_state(port: int) -> str:
        out = subprocess.run([REDIS_CLI, "-p", str(port), "cluster", "info"], capture_output=True,
                             text=True, timeout=5).stdout
        for line in out.splitlines():
            if line.startswith("cluster_state:"):
                return line.split(":", 1)[1].strip()
        return ""

    def close(self) -> None:
        for node in self.nodes:
            node.close()

    def __enter__(self) -> RedisClusterServers:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def redis_server_fixture():
    """Generator for a pytest fixture: a fresh server, closed after the test."""
    if not has_redis():
        pytest.skip("redis-server is not installed")
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.close()


def redis_cluster_fixture():
    if not has_redis():
        pytest.skip("redis-server is not installed")
    cluster = RedisClusterServers(3).start()
    try:
        yield cluster
    finally:
        cluster.close()
