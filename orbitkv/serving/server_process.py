"""A vLLM OpenAI server as a subprocess (its HTTP calls: ``http_client.py``).

Shared by ``orbitkv serve``, ``orbitkv demo`` and ``orbitkv bench agent``. Three systems:

- ``orbitkv``: vLLM's prefix cache (APC) plus the OrbitKV connector (``--kv-transfer-config``);
- ``apc``: vLLM's prefix cache alone;
- ``none``: no cache at all (``--no-enable-prefix-caching``).

vLLM 0.32's OpenAI server returns the connector's ``kv_transfer_params`` only on non-streaming
responses (``chat_completion_full_generator``); streamed chunks never carry it. ``timed_chat``
(``http_client.py``) therefore has two ways of timing a request:

- non-streaming (default, ``max_tokens=1``): the response *is* the first token, so the client's
  latency is the time to first token, and the response carries ``usage`` and
  ``kv_transfer_params`` (OrbitKV's reuse by mode) and vLLM's own per-request
  ``metrics.time_to_first_token_ms``;
- streaming: time to the first chunk with content; ``usage`` comes in the last chunk, and there is
  no ``kv_transfer_params`` (the by-mode split is then unknown; ``/metrics`` still splits the
  reused tokens into vLLM's prefix cache vs the connector).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orbitkv.serving.http_client import http_get

SYSTEMS = ("orbitkv", "orbitkv_patched", "apc", "none")
SYSTEM_TITLES = {"orbitkv": "OrbitKV", "orbitkv_patched": "OrbitKV window", "apc": "vLLM APC",
                 "none": "no cache"}
# Servers with OrbitKV; "orbitkv_patched" is one whose client also registers each new image (a
# canonicalize request) so patches can be formed for it; `bench agent` runs "orbitkv" exact-only
# and "orbitkv_patched" with approximate reuse in the agent's session (the window policy).
ORBITKV_SYSTEMS = ("orbitkv", "orbitkv_patched")
CONNECTOR = {
    "kv_connector": "OrbitKVConnector",
    "kv_connector_module_path": "orbitkv.connector",
    "kv_role": "kv_both",
    # A failed load is recomputed by vLLM, never served wrong.
    "kv_load_failure_policy": "recompute",
}


# The scheduler extension that serves cached chunks behind fresh tokens (connector/vllm_ext/hole_scheduler.py);
# a plain string, so that building a command does not import vLLM.
SCHEDULER_CLS = "orbitkv.connector.vllm_ext.hole_scheduler.OrbitKVScheduler"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def kv_transfer_config(extra_config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The ``--kv-transfer-config`` value that loads OrbitKV (``extra_config``: OrbitKVConfig keys)."""
    cfg = dict(CONNECTOR)
    if extra_config:
        cfg["kv_connector_extra_config"] = dict(extra_config)
    return cfg


# Keys whose value may carry a secret (the Redis password), with the variable that takes them to
# vLLM instead of its command line: every user sees a process's arguments (``ps``), only its owner
# its environment. The variable outranks a config file, as the key did.
SECRET_KEYS = {"remote_url": "ORBITKV_REMOTE_URL"}


def split_secrets(
    extra_config: Mapping[str, Any] | None,
) -> tuple[dict[str, Any], dict[str, str]]:
    """``extra_config`` without the keys that may carry a secret, and those keys as the variables
    of ``SECRET_KEYS`` for vLLM's environment (a null value, which unsets the key, stays)."""
    extra = dict(extra_config or {})
    env: dict[str, str] = {}
    section = extra.get("orbitkv")
    for name, var in SECRET_KEYS.items():
        for key in (name, "orbitkv_" + name):
            if isinstance(extra.get(key), str) and extra[key]:
                env[var] = extra.pop(key)
        if isinstance(section, Mapping) and isinstance(section.get(name), str) and section[name]:
            section = {k: v for k, v in section.items() if k != name}
            env[var] = extra["orbitkv"][name]
            extra["orbitkv"] = section
    return extra, env


def has_arg(args: Sequence[str], *names: str) -> bool:
    """Whether a ``--flag`` or ``--flag=value`` is among ``args``."""
    return any(a == n or a.startswith(n + "=") for a in args for n in names)


def system_args(system: str, extra_config: Mapping[str, Any] | None = None) -> list[str]:
    """vLLM CLI flags that make a server one of ``SYSTEMS``."""
    if system in ORBITKV_SYSTEMS:
        return [
            "--enable-prefix-caching",
            "--kv-transfer-config", json.dumps(kv_transfer_config(extra_config)),
            "--scheduler-cls", SCHEDULER_CLS,
        ]
    if system == "apc":
        return ["--enable-prefix-caching"]
    if system == "none":
        return ["--no-enable-prefix-caching"]
    raise ValueError(f"unknown system {system!r}; choose one of {', '.join(SYSTEMS)}")


def server_command(model: str, port: int, args: Sequence[str] = (), host: str = "127.0.0.1") -> list[str]:
    """``python -m vllm.entrypoints.openai.api_server`` with the model, address and ``args``."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
    cmd += ["--host", host, "--port", str(port)]
    return cmd + list(args)


@dataclass
class VLLMServer:
    """One server subprocess; ``start()`` waits for ``/health``, ``stop()`` ends its process group."""

    cmd: list[str]
    port: int
    log_path: Path
    env: dict[str, str] | None = None
    host: str = "127.0.0.1"
    startup_timeout_s: float = 600.0
    proc: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> VLLMServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")
        env = dict(os.environ if self.env is None else self.env)
        self.proc = subprocess.Popen(
            self.cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        log.close()
        try:
            return self._wait_healthy()
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self) -> VLLMServer:
        assert self.proc is not None
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"vLLM server exited with code {self.proc.returncode} before it was ready; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            with contextlib.suppress(OSError, http.client.HTTPException):
                if http_get(self.base_url, "/health", timeout=2.0)[0] == 200:
                    return self
            time.sleep(0.5)
        raise TimeoutError(f"vLLM server not healthy after {self.startup_timeout_s:.0f}s; log {self.log_path}:\n{self.log_tail()}")

    def log_tail(self, num_lines: int = 30) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-num_lines:])

    def stop(self, timeout_s: float = 30.0) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            # SIGINT to the API server: it shuts its engine core down itself (a SIGINT to the
            # whole group kills the engine first and the server logs an EngineDeadError).
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        # Engine children that outlived the API server: its process group (start_new_session).
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def vllm_env(kv_cache_gb: float | None = 1.0, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    if kv_cache_gb is not None:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(kv_cache_gb)) if float(kv_cache_gb).is_integer() else str(kv_cache_gb))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.update(extra or {})
    return env


# -- HTTP ----------------------------------------------------------------------------------------


@contextlib.contextmanager
def running(server: VLLMServer) -> Iterator[VLLMServer]:
    server.start()
    try:
        yield server
    finally:
        server.stop()


def model_server(
    model_dir: str | Path,
    system: str,
    log_path: str | Path,
    *,
    extra_config: Mapping[str, Any] | None = None,
    max_images: int = 4,
    max_model_len: int = 4096,
    block_size: int = 32,
    served_name: str | None = None,
    dev_mode: bool = False,
    kv_cache_gb: int = 1,
    extra_args: Sequence[str] = (),
    startup_timeout_s: float = 600.0,
    mm_processor_kwargs: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    is_logging_iterations: bool = False,
    load_format: str = "dummy",
) -> VLLMServer:
    """A server for a local ``make_model`` directory as one of ``SYSTEMS``, with the per-request
    usage details and timing metrics the drivers read. ``load_format``: ``dummy`` (random weights,
    for timing only) or ``auto`` (the directory's seeded safetensors: outputs can be compared).
    ``env``: set over the inherited environment (a bench's CPU binding, the same for every arm);
    ``is_logging_iterations``: vLLM logs each engine step (tokens, encoder inputs)."""
    port = free_port()
    extra_config, secret_env = split_secrets(extra_config)
    args = [
        "--load-format", load_format,
        "--dtype", "bfloat16",
        "--max-model-len", str(max_model_len),
        "--block-size", str(block_size),
        "--enforce-eager",
        "--max-num-seqs", "2",
        "--limit-mm-per-prompt", json.dumps({"image": max_images}),
        "--enable-prompt-tokens-details",
        "--enable-per-request-metrics",
        "--disable-uvicorn-access-log",
    ]
    if served_name:
        args += ["--served-model-name", served_name]
    if mm_processor_kwargs:
        args += ["--mm-processor-kwargs", json.dumps(dict(mm_processor_kwargs))]
    if is_logging_iterations:
        args.append("--enable-logging-iteration-details")
    args += system_args(system, extra_config) + list(extra_args)
    if system in ORBITKV_SYSTEMS:
        from orbitkv.serving.encoder_cache import ec_args

        args += ec_args(str(model_dir), extra_config)  # the encoder outputs in the store too
    extra_env = {"VLLM_SERVER_DEV_MODE": "1"} if dev_mode else {}
    extra_env.update(env or {})
    extra_env.update(secret_env)
    return VLLMServer(server_command(str(model_dir), port, args), port, Path(log_path),
                      env=vllm_env(kv_cache_gb, extra_env), startup_timeout_s=startup_timeout_s)
