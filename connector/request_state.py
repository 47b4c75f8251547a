"""What the scheduler half keeps per request, and the ledger of what it actually served.

The ledger follows vLLM's recovery exactly: when loads fail, vLLM recomputes everything from the
first invalid block of the request (``Scheduler._update_requests_with_invalid_blocks``), loaded or
not, so every served token from that position on stops counting as reused. The request's own
``prefill_stats`` (what vLLM exports as ``vllm:prompt_tokens_by_source`` and the response's
``cached_tokens``) is kept in step: hole tokens are added to its external share when they are
loaded, and tokens vLLM recomputes are moved back to its computed share.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from .chunking import Chunk
from .options import RequestOptions
from .planner import APPROXIMATE_MODES, Hole, Plan


@dataclass(slots=True)
class ServedRun:
    """Tokens ``[begin, end)`` of one chunk loaded in ``mode`` from ``tier``."""

    begin: int
    end: int
    mode: str
    tier: str
    is_hole: bool

    @property
    def num_tokens(self) -> int:
        return self.end - self.begin


@dataclass(slots=True)
class ReqState:
    req_id: str
    chunks: list[Chunk]
    options: RequestOptions
    num_prompt_tokens: int
    # vLLM's Request, for its prefill_stats (None in unit tests that pass plain objects).
    request: Any = None
    block_ids: list[int] = field(default_factory=list)
    # Each chunk's start in the model's position units (chunk starts where unplaceable).
    positions: list[int] = field(default_factory=list)
    # This admission's plan; its prefix run is turned into LoadSpecs once the request is scheduled.
    plan: Plan | None = None
    pending_plan: Plan | None = None
    # Holes still to jump, in prompt order; the one being jumped in the step under construction.
    holes: list[Hole] = field(default_factory=list)
    jumping: Hole | None = None
    served: set[int] = field(default_factory=set)
    has_exact: set[int] = field(default_factory=set)
    # Chunks ending at or before this were computed before this request (vLLM's prefix cache).
    num_local_tokens: int = 0
    next_save: int = 0
    pinned: list[str] = field(default_factory=list)
    runs: list[ServedRun] = field(default_factory=list)
    num_failed_load_tokens: int = 0
    num_saved_chunks: int = 0
    num_admissions: int = 0
    # Multimodal items the vision encoder ran for (counted by the scheduler extension).
    num_encoded_items: int = 0
    # A canonicalize request: what it did ("formed", "already stored") or why it could not.
    canonicalize: dict[str, Any] | None = None

    def reused_by_mode(self) -> Counter[str]:
        out: Counter[str] = Counter()
        for run in self.runs:
            out[run.mode] += run.num_tokens
        return +out

    def record(self, begin: int, end: int, mode: str, tier: str, *, is_hole: bool) -> None:
        self.runs.append(ServedRun(begin, end, mode, tier, is_hole))
        if is_hole:
            self._shift_prefill_stats(end - begin)

    def forget_from(self, boundary: int) -> int:
        """vLLM recomputes every token from ``boundary`` on: drop those tokens from the ledger.

        Returns how many served tokens that was."""
        kept: list[ServedRun] = []
        num_lost = 0
        for run in self.runs:
            if run.end <= boundary:
                kept.append(run)
                continue
            num_lost += run.end - max(run.begin, boundary)
            if run.begin < boundary:
                kept.append(ServedRun(run.begin, boundary, run.mode, run.tier, run.is_hole))
        self.runs = kept
        self.num_failed_load_tokens += num_lost
        self._shift_prefill_stats(-num_lost)
        return num_lost

    def first_invalid_token(self, invalid_block_ids: set[int], block_size: int) -> int | None:
        """Where vLLM's recovery restarts this request: the start of its first invalid block."""
        for index, block_id in enumerate(self.block_ids):
            if block_id in invalid_block_ids:
                return index * block_size
        return None

    def reset_for_admission(self) -> None:
        """A preempted request is admitted again with nothing computed: its KV, and so what it
        was served, is gone; the new admission plans afresh."""
        self.runs = []
        self.holes = []
        self.jumping = None
        self.plan = None
        self.pending_plan = None
        self.served = set()
        self.block_ids = []

    def summary(self) -> dict[str, Any]:
        by_mode = self.reused_by_mode()
        return {
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_chunks": len(self.chunks),
            "num_reused_tokens": sum(by_mode.values()),
            "reused_tokens_by_mode": dict(by_mode),
            "num_hole_tokens": sum(r.num_tokens for r in self.runs if r.is_hole),
            "num_approximate_tokens": sum(
                r.num_tokens for r in self.runs if r.mode in APPROXIMATE_MODES
            ),
            "num_failed_load_tokens": self.num_failed_load_tokens,
            "num_saved_chunks": self.num_saved_chunks,
            "num_mm_items": sum(c.is_mm for c in self.chunks),
            "num_encoded_items": self.num_encoded_items,
            **({"canonicalize": self.canonicalize} if self.canonicalize is not None else {}),
        }

    def _shift_prefill_stats(self, num_tokens: int) -> None:
        """Move ``num_tokens`` from vLLM's computed share of this prompt to its external share
        (negative: back). vLLM records the stats at the first admission only, so only then."""
        stats = getattr(self.request, "prefill_stats", None)
        if stats is None or not num_tokens or self.num_admissions > 1:
            return
        num_tokens = max(num_tokens, -stats.num_external_cached_tokens)
        num_tokens = min(num_tokens, stats.num_computed_tokens)
        stats.num_external_cached_tokens += num_tokens
        stats.num_cached_tokens += num_tokens
        stats.num_computed_tokens -= num_tokens
