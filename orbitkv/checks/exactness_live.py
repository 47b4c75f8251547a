"""The live half of ``orbitkv check exactness``: the mix sent to an OrbitKV server and a reference
server, each request compared (``exactness.py`` has the whole check).

The OrbitKV server keeps vLLM's prefix cache across requests (that is where approximate blocks
could leak) except before the ``corrupt`` requests, which must reach OrbitKV's loads; its store is
a disk tier only, so entries corrupted or cut on disk are what it reads.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from typing import Any

from orbitkv.checks.exactness_mix import CHUNK, LORA_NAME, Ask
from orbitkv.checks.gpu_compare import (
    first_choice,
    max_diff,
    prompt_logprobs,
    served_summary,
    token_logprobs,
)
from orbitkv.checks.stores import settle
from orbitkv.serving.http_client import http_post_json

SERVED_NAME = "orbitkv-check"
MAX_TOKENS = 8


def send_all(
    asks: list[Ask], model_dir: Path, adapter: Path, config: dict[str, Any], store_dir: Path,
    log_dir: Path, *, log: Any = print,
) -> list[dict[str, Any]]:
    from orbitkv.serving.http_client import reset_prefix_cache
    from orbitkv.store.disk import DiskBackend

    disk = DiskBackend(store_dir, None)  # this process lists, reads and breaks entries only
    rows: list[dict[str, Any]] = []
    keys_by_prompt: dict[tuple[int, ...], set[str]] = {}
    with ExitStack() as stack:
        orbit = stack.enter_context(_server("orbitkv", model_dir, adapter, config, log_dir))
        ref = stack.enter_context(_server("reference", model_dir, adapter, None, log_dir))
        for ask in asks:
            log(f"check exactness: {ask.name}")
            before = set(disk.iter_keys())
            if ask.corrupt:
                _break_entries(disk, keys_by_prompt.get(ask.ids, set()), ask.corrupt)
            if ask.kind == "corrupt":
                reset_prefix_cache(orbit.base_url)  # the request must reach OrbitKV's loads
            got = _complete(orbit.base_url, ask, with_params=True)
            want = _complete(ref.base_url, ask, with_params=False)
            rows.append(_row(ask, got, want))
            if not ask.is_prompt_logprobs and rows[-1]["served"]["num_saved_chunks"]:
                after = settle(disk, before, 0)  # quiet: saves may rewrite stored keys
                keys_by_prompt.setdefault(ask.ids, set()).update(after - before)
    return rows


def _server(name: str, model_dir: Path, adapter: Path, config: dict[str, Any] | None, log_dir: Path):
    from orbitkv.serving.server_process import (
        VLLMServer,
        free_port,
        running,
        server_command,
        system_args,
        vllm_env,
    )

    args = ["--load-format", "auto", "--dtype", "bfloat16", "--max-model-len", "1024",
            "--block-size", str(CHUNK), "--max-num-seqs", "2", "--served-model-name", SERVED_NAME,
            "--enforce-eager", "--disable-uvicorn-access-log", "--enable-lora", "--max-lora-rank",
            "8", "--lora-modules", f"{LORA_NAME}={adapter}"]
    args += system_args("orbitkv" if config is not None else "none", config)
    env = vllm_env(1, {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"})
    port = free_port()
    return running(VLLMServer(server_command(str(model_dir), port, args), port,
                              log_dir / f"{name}.log", env=env, startup_timeout_s=900.0))


def _complete(base_url: str, ask: Ask, *, with_params: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": ask.lora or SERVED_NAME, "prompt": list(ask.ids), "temperature": 0.0,
        "return_token_ids": True,
    }
    if ask.is_prompt_logprobs:
        body.update(max_tokens=1, prompt_logprobs=0)
    else:
        body.update(max_tokens=MAX_TOKENS, logprobs=1)
    if ask.cache_salt:
        body["cache_salt"] = ask.cache_salt
    if with_params and ask.params:
        body["kv_transfer_params"] = {"orbitkv": dict(ask.params)}
    status, data = http_post_json(base_url, "/v1/completions", body, timeout=300.0)
    if status != 200:
        raise RuntimeError(f"HTTP {status} from {base_url}/v1/completions: {str(data)[:2000]}")
    return data


def _row(ask: Ask, got: dict[str, Any], want: dict[str, Any]) -> dict[str, Any]:
    summary = (got.get("kv_transfer_params") or {}).get("orbitkv") or {}
    served = {
        **served_summary(got),
        "num_prefix_cache_tokens": int(summary.get("num_prefix_cache_tokens", 0)),
        "num_approximate_tokens": int(summary.get("num_approximate_tokens", 0)),
        "approximate_from": summary.get("approximate_from"),
        "policy": summary.get("policy", ""),
        "num_saved_chunks": int(summary.get("num_saved_chunks", 0)),
        "refused": summary.get("refused"),
    }
    if ask.is_prompt_logprobs:
        (ours, _), (ref, _) = prompt_logprobs(got), prompt_logprobs(want)
        diff = max_diff(ours, ref)
        compared = {"max_abs_prompt_logprob_diff": diff, "num_positions": len(ours)}
    else:
        choice, ref_choice = first_choice(got), first_choice(want)
        diff = max_diff(token_logprobs(got), token_logprobs(want))
        compared = {"tokens": choice.get("token_ids"), "reference_tokens": ref_choice.get("token_ids"),
                    "max_abs_logprob_diff": diff}
        if choice.get("token_ids") != ref_choice.get("token_ids"):
            diff = None
    is_equal = diff == 0.0
    expected = []
    if ask.expect_refused:
        expected.append(bool(served["refused"]) and served["num_reused_tokens"] == 0)
    if ask.expect_nothing_served:
        expected.append(served["num_reused_tokens"] == 0 and served["num_hole_tokens"] == 0)
    if not ask.is_opted_in:
        expected.append(not served["policy"] and served["approximate_from"] is None)
    return {
        "name": ask.name, "kind": ask.kind, "is_opted_in": ask.is_opted_in,
        "num_prompt_tokens": len(ask.ids), "served": served, **compared,
        # Served exact KV only: it must answer as a full prefill does.
        "is_exact": served["approximate_from"] is None and served["num_approximate_tokens"] == 0,
        "is_equal": is_equal, "is_expected": all(expected),
    }


def _break_entries(disk: Any, keys: set[str], targets: tuple[tuple[int, str], ...]) -> None:
    """Corrupt (flip a byte of the last tensor) or cut (truncate) the exact conditioned entries of
    these chunks of a prompt, on disk: a later load reads them and fails its checks."""
    import os

    from orbitkv.store.entry import read_meta
    from orbitkv.store.entry_format import CorruptEntry

    by_chunk: dict[int, list[str]] = {}
    for key, value in zip(sorted(keys), disk.batch_get(sorted(keys)), strict=True):
        if value is None or ":conditioned:" not in key or ":l" in key.split(":", 4)[-1]:
            continue
        try:
            meta = read_meta(value)
        except CorruptEntry:
            continue  # an earlier ask broke it and no recompute has rewritten it yet: still broken
        by_chunk.setdefault(meta.start_pos // CHUNK, []).append(key)
    for index, how in targets:
        for key in by_chunk.get(index, []):
            path = disk.path_of(key)
            size = os.path.getsize(path)
            with open(path, "r+b") as f:
                if how == "cut":
                    f.truncate(size // 2)
                else:
                    f.seek(size - 1)
                    last = f.read(1)
                    f.seek(size - 1)
                    f.write(bytes([last[0] ^ 0xFF]))
