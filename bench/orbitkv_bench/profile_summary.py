"""``python -m orbitkv_bench.profile_summary PROFILE.txt [--top N]``: the top functions of a py-spy
profile (``py-spy record --format raw --threads``, collapsed stacks) as text.

Per thread: its samples; then the functions by own (self) samples and by inclusive samples, and
OrbitKV's entry points (the outermost frame in ``connector/``, ``store/`` or ``kernels/``) by
inclusive samples, so OrbitKV's share of the engine's time can be read next to vLLM's.
``--within NAME`` keeps the samples of threads other than the main thread (OrbitKV's writers) and
the main thread's samples under a frame whose function is NAME (``execute_model`` for a worker,
``EngineCore.step`` for the engine core): the serving phase, without start-up and idle polling.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

_OWN = re.compile(r"\((?:.*/)?(connector|store|kernels)/[^()]*\)$")


def parse(text: str, within: str | None = None) -> list[tuple[list[str], int]]:
    stacks = []
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not (stack and count.isdigit()):
            continue
        frames = stack.split(";")
        is_main = "MainThread" in frames[0]
        if within is not None and is_main and not any(f.split(" (")[0].endswith(within) for f in frames):
            continue
        stacks.append((frames, int(count)))
    return stacks


def _thread(frames: list[str]) -> str:
    first = frames[0]
    return first if first.startswith(("thread", "process", '"')) or "thread (" in first else "all"


def summarize(stacks: list[tuple[list[str], int]], top: int = 25) -> str:
    total = sum(n for _, n in stacks)
    threads: Counter[str] = Counter()
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    entry: Counter[str] = Counter()
    for frames, n in stacks:
        threads[_thread(frames)] += n
        own[frames[-1]] += n
        for f in set(frames):
            inclusive[f] += n
        outer = next((f for f in frames if _OWN.search(f)), None)
        if outer is not None:
            entry[outer] += n
    lines = [f"samples: {total}", "", "threads:"]
    lines += [f"  {n:7d} {100 * n / total:5.1f}%  {t}" for t, n in threads.most_common(top)]
    orbitkv = sum(entry.values())
    lines += ["", f"OrbitKV entry points (inclusive; all together {orbitkv} = {100 * orbitkv / max(total, 1):.1f}%):"]
    lines += [f"  {n:7d} {100 * n / total:5.1f}%  {f}" for f, n in entry.most_common(top)]
    lines += ["", "functions by own samples:"]
    lines += [f"  {n:7d} {100 * n / total:5.1f}%  {f}" for f, n in own.most_common(top)]
    lines += ["", "functions by inclusive samples:"]
    lines += [f"  {n:7d} {100 * n / total:5.1f}%  {f}" for f, n in inclusive.most_common(top)]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="profile_summary", description=__doc__.split("\n\n")[0])
    p.add_argument("profile", type=Path)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--within", help="keep the main thread's samples under this function only")
    args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    stacks = parse(args.profile.read_text(errors="replace"), args.within)
    sys.stdout.write(summarize(stacks, args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
