"""What the scheduler half keeps per request, and the ledger of what it actually served.

The ledger follows vLLM's recovery exactly: when loads fail, vLLM recomputes everything from the
first invalid block of the request (the scheduler extension tells the half where, per request:
``exact_guard.py``), loaded or not, so every served token from that position on stops counting as
reused, and every chunk from there is saved again once recomputed. The request's own
``prefill_stats`` (what vLLM exports as ``vllm:prompt_tokens_by_source`` and the response's
``cached_tokens``) is kept in step: hole tokens are added to its external share when they are
loaded, and tokens vLLM recomputes are moved back to its computed share.

Preemption: vLLM reports the prefill of the admission that produced the first token. Before that
token, a re-admission replaces the ledger and vLLM's stats alike; after it, the reported figures
stay those of that admission (``reported``) while the live state follows the new one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from orbitkv.store.keys import RequestKeys

from ..chunking import Chunk
from .options import RequestOptions
from .planner import APPROXIMATE_MODES, ChunkDecision, Hole, Plan


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
    # The plan's decision per chunk (what the store holds for it: the save path skips those).
    decisions: dict[int, ChunkDecision] = field(default_factory=dict)
    # Chunks ending at or before this were computed before this request (vLLM's prefix cache).
    num_local_tokens: int = 0
    next_save: int = 0
    pinned: list[str] = field(default_factory=list)
    runs: list[ServedRun] = field(default_factory=list)
    num_failed_load_tokens: int = 0
    num_saved_chunks: int = 0
    num_declined_saves: int = 0  # computed chunks the save admission policy did not save
    # A chunk of this request past vLLM's prefix-cache hit was served by OrbitKV or seen computed
    # before: its other computed chunks recur too (save_admission.py).
    is_recurring_lineage: bool = False
    num_admissions: int = 0
    # Multimodal items the vision encoder ran for (counted by the scheduler extension).
    num_encoded_items: int = 0
    # A canonicalize request: what it did ("formed", "already stored") or why it could not.
    canonicalize: dict[str, Any] | None = None
    # The first token whose KV is approximate in this admission (None: all exact so far).
    approx_from: int | None = None
    # The ledger's figures frozen when vLLM reported the prefill (a preemption after it).
    reported: dict[str, Any] | None = None
    # The entry keys this request names (its lineage, the anchor's context of its canonicals).
    keys: RequestKeys = field(default_factory=RequestKeys)

    def record(self, begin: int, end: int, mode: str, tier: str, *, is_hole: bool) -> None:
        self.runs.append(ServedRun(begin, end, mode, tier, is_hole))
        if is_hole:
            self._shift_prefill_stats(end - begin)

    def forget_from(self, boundary: int) -> int:
        """vLLM recomputes every token from ``boundary`` on: drop those tokens from the ledger,
        and save every chunk from there again once it is recomputed (nothing computed over a
        failed load was saved). Returns how many served tokens were dropped."""
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
        self.served = {i for i in self.served if self.chunks[i].end <= boundary}
        # What the plan found stored there is not to be trusted any more (a load just failed).
        self.decisions = {i: d for i, d in self.decisions.items() if self.chunks[i].end <= boundary}
        self.next_save = min(
            self.next_save,
            next((c.index for c in self.chunks if c.end > boundary), len(self.chunks)),
        )
        self.holes = [h for h in self.holes if h.start >= boundary]
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
        if self.reported is None and getattr(self.request, "prefill_stats", 1) is None:
            self.reported = self.figures()  # vLLM already reported this admission's prefill
        self.runs = []
        self.holes = []
        self.jumping = None
        self.plan = None
        self.pending_plan = None
        self.served = set()
        self.block_ids = []
        self.next_save = 0
        self.approx_from = None

    def figures(self) -> dict[str, Any]:
        """What was served (the ledger's side of vLLM's prefill stats), in one pass over the
        runs (it runs as each request finishes)."""
        by_mode: dict[str, int] = {}
        num_hole = num_approximate = 0
        for run in self.runs:
            num = run.end - run.begin
            if num <= 0:
                continue
            by_mode[run.mode] = by_mode.get(run.mode, 0) + num
            if run.is_hole:
                num_hole += num
            if run.mode in APPROXIMATE_MODES:
                num_approximate += num
        return {
            "num_reused_tokens": sum(by_mode.values()),
            "reused_tokens_by_mode": by_mode,
            "num_hole_tokens": num_hole,
            "num_approximate_tokens": num_approximate,
            "num_local_tokens": self.num_local_tokens,
        }

    def summary(self) -> dict[str, Any]:
        figures = dict(self.reported or self.figures())
        num_local = figures.pop("num_local_tokens")
        served = figures["num_reused_tokens"]
        return {
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_chunks": len(self.chunks),
            **figures,
            "num_prefix_cache_tokens": min(num_local, self.num_prompt_tokens - served),
            # Lineage: the policy this request accepted approximate KV under ("" = exact only),
            # and the first token whose KV is approximate (null: every token is exact).
            "policy": self.options.policy.tag,
            "approximate_from": self.approx_from,
            "num_failed_load_tokens": self.num_failed_load_tokens,
            "num_saved_chunks": self.num_saved_chunks,
            "num_declined_saves": self.num_declined_saves,
            "num_mm_items": sum(c.is_mm for c in self.chunks),
            "num_encoded_items": self.num_encoded_items,
            **({"canonicalize": self.canonicalize} if self.canonicalize is not None else {}),
            **({"refused": self.options.refusal} if self.options.refusal else {}),
        }

    def count_finished(self, stats: Any, summary: dict[str, Any], token_nbytes: int) -> None:
        """The finished request's figures into ``stats`` (an ``OrbitKVStats``), as vLLM reported
        its prefill (``summary``): one ledger, confirmed."""
        for mode, num in summary["reused_tokens_by_mode"].items():
            stats.add(f"loaded_tokens.{mode}", num)
            stats.add("loaded_bytes", num * token_nbytes)
        if self.reported is None:
            chunks_by_mode: dict[str, int] = {}
            tokens_by_tier: dict[str, int] = {}
            for run in self.runs:
                chunks_by_mode[run.mode] = chunks_by_mode.get(run.mode, 0) + 1
                tokens_by_tier[run.tier] = tokens_by_tier.get(run.tier, 0) + run.end - run.begin
            for mode, num in chunks_by_mode.items():
                stats.add(f"hit_chunks.{mode}", num)
            for tier, num in tokens_by_tier.items():
                stats.add(f"hit_tokens.{tier}", num)
        served = summary["num_reused_tokens"]
        local = summary["num_prefix_cache_tokens"]
        stats.add("prompt_tokens.orbitkv", served)
        stats.add("prompt_tokens.prefix_cache", local)
        stats.add("prompt_tokens.computed", self.num_prompt_tokens - served - local)
        stats.add("hole_tokens", summary["num_hole_tokens"])
        stats.add("approximate_tokens", summary["num_approximate_tokens"])
        if self.options.refusal:
            stats.add("refused_requests", 1)

    def restart_prefill_stats(self, num_local_tokens: int, num_external_tokens: int) -> None:
        """A re-admission before vLLM reported the prefill: vLLM keeps the first admission's
        stats; make them this admission's, as the ledger is."""
        stats = getattr(self.request, "prefill_stats", None)
        if stats is not None:
            stats.set(self.num_prompt_tokens, num_local_tokens, num_external_tokens)

    def _shift_prefill_stats(self, num_tokens: int) -> None:
        """Move ``num_tokens`` from vLLM's computed share of this prompt to its external share
        (negative: back), while vLLM has not reported them yet."""
        stats = getattr(self.request, "prefill_stats", None)
        if stats is None or not num_tokens:
            return
        num_tokens = max(num_tokens, -stats.num_external_cached_tokens)
        num_tokens = min(num_tokens, stats.num_computed_tokens)
        stats.num_external_cached_tokens += num_tokens
        stats.num_cached_tokens += num_tokens
        stats.num_computed_tokens -= num_tokens
