"""Where a step's connector time goes: seconds per part, reported as ``seconds.<part>`` stats and
exported as ``vllm:orbitkv_seconds_total{part}``.

Scheduler half: ``chunk`` (a new request's chunks: content ids of its text and images, made
once; ``mm_hash``, inside it, hashing the inputs of items not seen before), ``plan`` (match and plan a request), ``alloc`` (after vLLM allocated its blocks),
``meta`` (the step's loads and saves), ``output`` (the workers' report), ``finish`` (the request's
summary), ``stats`` (either half: the step's counters for vLLM, with the store's fault poll); the scheduler extension (``vllm_ext/hole_scheduler.py``) adds ``guard`` (the exact guard
around vLLM's prefix-cache lookup and after each step) and ``holes`` (jumps and caps). Worker half: ``fetch`` (the batched store read), ``check`` (verifying the entries against
the plan), ``layer_load`` (relocate, patch and scatter, summed over layers), ``save_gather`` (copying
saved chunks out of the paged cache, over layers, on the forward's path), ``save_submit`` (handing
them to the writer), ``save_wait`` (a step's start waiting for the last step's copy where it runs
between steps, ``worker/saving.py``); ``save_copy``: that copy's own time, on its thread;
``save_writer``: the writer thread's CPU seconds building and storing entries (off the forward
pass, on the same cores); ``hooks``: the rest of the worker's step hooks (``handle_preemptions``,
``start_load_kv``, ``wait_for_save``, ``build_connector_worker_meta``), their time beyond the parts
above. Either side, ``encoder``: the encoder connector's hooks
(``encoder/connector.py``), in the same process's ``PartSeconds`` of its side
(``runtime.Shared``).
With one request at a time, a ``/metrics`` delta is that request's cost (``bench agent``'s floor row).
"""

from __future__ import annotations

import time

# Parts not on the step's path: a copy on its own thread, and the hashing ``chunk`` includes.
_OFF_PATH = frozenset({"save_copy", "mm_hash"})


class PartSeconds:
    """Seconds per part since the last ``take``; ``on_path_s``: every on-path part's seconds
    since the start (never taken), what ``add_rest`` subtracts."""

    __slots__ = ("_seconds", "on_path_s")

    def __init__(self) -> None:
        self._seconds: dict[str, float] = {}
        self.on_path_s = 0.0

    def timed(self, part: str) -> _Timed:
        """``with seconds.timed(part):`` adds the block's seconds to ``part``. The connector's
        per-request hooks use two clock reads instead: the first of a step runs on cold caches,
        where this costs about 15 us more (and a ``contextlib`` manager 40)."""
        return _Timed(self, part)

    def add(self, part: str, seconds: float) -> None:
        self._seconds[part] = self._seconds.get(part, 0.0) + seconds
        if part not in _OFF_PATH:
            self.on_path_s += seconds

    def add_rest(self, part: str, started: float, on_path_before: float) -> None:
        """Add to ``part`` the time since ``started`` (a ``perf_counter``) that no on-path part
        counted since ``on_path_before`` (``on_path_s`` then): a hook timed whole, its named
        parts inside it counted once."""
        rest = time.perf_counter() - started - (self.on_path_s - on_path_before)
        if rest > 0:
            self.add(part, rest)

    def is_only(self, part: str) -> bool:
        """Only ``part`` has seconds since the last ``take`` (or none has)."""
        seconds = self._seconds
        return not seconds or (len(seconds) == 1 and part in seconds)

    def take_into(self, data: dict[str, float]) -> None:
        """``take``, added into a stats payload (``seconds.<part>``)."""
        taken, self._seconds = self._seconds, {}
        for part, s in taken.items():
            name = _NAMES.get(part)
            if name is None:
                name = _NAMES[part] = f"seconds.{part}"
            data[name] = data.get(name, 0.0) + s

    def take(self) -> dict[str, float]:
        taken, self._seconds = self._seconds, {}
        return {f"seconds.{part}": s for part, s in taken.items()}


# Part -> its stats name, made once a part (every step reports several).
_NAMES: dict[str, str] = {}


class _Timed:
    __slots__ = ("_seconds", "_part", "_started")

    def __init__(self, seconds: PartSeconds, part: str) -> None:
        self._seconds, self._part, self._started = seconds, part, 0.0

    def __enter__(self) -> None:
        self._started = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self._seconds.add(self._part, time.perf_counter() - self._started)
