"""Decide how each chunk of a prompt can be served, and how many tokens vLLM may skip.

Modes, best first (design.md, "Reuse modes"):
  exact     conditioned entry for (cid, this antecedent), exact lineage
  inherited conditioned entry for (cid, this antecedent) computed over approximate KV under this
            request's policy (``lineage``): approximate, and only ever served under that policy
  survivor  conditioned entry whose stored antecedent, with some chunks removed, is this one
  transfer  conditioned entry behind the closest other stored antecedent sharing chunks with this
            one (``relocation.py``): the inserted chunks' influence is missing, off by default
  patched   canonical + a patch for (cid, this antecedent)
  orbit     canonical + the orbit patch for (cid, the antecedent's sorted multiset): the mean
            of the patches of the orderings of that set seen so far (a reorder); of a set seen
            in one order, that order's own patch
  recompute canonical relocated, its first tokens computed fresh by vLLM (selective recompute,
            ``recompute.py``): the rest of the chunk is loaded as a hole behind them (off by default)
  blind     canonical only (off by default)
  miss      vLLM computes it

vLLM loads only a run that extends its computed prefix and needs one prompt token left to compute,
so the served run starts at ``num_computed_tokens`` and ends at the first miss, capped at
``num_tokens - 1``. A run may start or end inside a chunk: a prefix of a chunk's KV is valid on its
own because attention is causal.

Behind the first miss, with ``min_hole_tokens`` > 0, every further run of servable whole chunks is
a *hole* (``Hole``): vLLM computes the fresh spans between holes and the scheduler extension
(``vllm_ext/hole_scheduler.py``) jumps each hole, whose KV the worker loads before that step's forward. A
hole ends at or before ``num_tokens - 1`` (the last prompt token must be computed) and never cuts a
chunk, so it covers whole multimodal placeholder spans.

Every key is the request's ``store.keys.RequestKeys``: its lineage (which conditioned entries it may
name), the context its canonicals are looked up in (the antecedent hash of the anchor: the same
chunk after another context is another key) and the rank of its patches.

Pure: the store is reached only through the batched, read-only ``StoreView``. At most three round
trips per call: exact/canonical/patch keys, stored antecedent lists, survivor, transfer and
reordering keys.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from orbitkv.store.keys import RequestKeys, antecedent_hash

from ..chunking import Chunk, chunk_at
from .recompute import num_recomputed
from .relocation import reordering_candidates, survivor_candidates, transfer_candidates

EXACT = "exact"
INHERITED = "inherited"
SURVIVOR = "survivor"
TRANSFER = "transfer"
PATCHED = "patched"
ORBIT = "orbit"
BLIND = "blind"
RECOMPUTE = "recompute"
MISS = "miss"
# The modes a request (or the config) can name; ``inherited`` comes with any approximate policy.
ALL_MODES = (EXACT, SURVIVOR, TRANSFER, PATCHED, ORBIT, BLIND, RECOMPUTE)
# KV that differs from a re-prefill of this prompt beyond rounding: a relocated survivor still
# carries the removed chunks' influence, a transferred entry also lacks the inserted ones', patched and
# blind loads rebuild the conditioning, a recomputed chunk's loaded tokens lack it (its fresh ones
# attend to them), an inherited entry was computed over such KV.
APPROXIMATE_MODES = frozenset({INHERITED, SURVIVOR, TRANSFER, PATCHED, ORBIT, BLIND, RECOMPUTE})
# Served from a conditioned entry stored behind another antecedent, relocated.
RELOCATED_MODES = frozenset({SURVIVOR, TRANSFER})
PATCH_MODES = frozenset({PATCHED, ORBIT})
# Not a mode: a mode filter's allowance for a chunk that may be served ``transfer`` only from a
# stored antecedent ending with the same chunk as its own (``transfer_attached_modalities``).
TRANSFER_ATTACHED = "transfer@attached"
DEFAULT_MODES = frozenset({EXACT, SURVIVOR, PATCHED, ORBIT})
EXACT_ONLY = frozenset({EXACT})
# An exact request's keys: no policy, no patches, canonicals in the empty context.
EXACT_KEYS = RequestKeys()


class StoreView(Protocol):
    """The read-only part of ``store.tiered.TieredStore`` the planner needs."""

    def lookup(self, keys: list[str]) -> list[str | None]: ...

    def batch_antecedents(self, cids: list[str]) -> list[list[tuple[str, ...]]]: ...


# A chunk -> the modes allowed for it (e.g. blind for text only); None: the request's modes.
ModeFilter = Callable[[Chunk], frozenset[str]]


@dataclass(slots=True)
class ChunkDecision:
    """How one chunk can be served. ``key`` is the entry to load (the canonical for patched and
    blind), ``patch_key`` the patch entry, ``tier`` where the lookup found ``key``. Never changed
    once made; not ``frozen``, which costs several times as much to make (``chunking.Chunk``),
    one a chunk for every request planned."""

    index: int
    mode: str
    key: str | None = None
    patch_key: str | None = None
    tier: str | None = None
    # Stored antecedent of the entry served in survivor or transfer mode (logging, the summary).
    source_antecedent: tuple[str, ...] | None = None
    # The store holds this chunk's exact conditioned entry (even when the exact mode is off), its
    # conditioned entry under this request's policy, its canonical: the save path skips those.
    has_exact_entry: bool = False
    has_inherited_entry: bool = False
    has_canonical: bool = False


# LoadItem, Hole and Plan are never changed once made, yet not ``frozen``: the planner makes them
# for every request it plans, on cold caches, and a frozen dataclass sets each field through
# ``object.__setattr__`` (``chunking.Chunk``).
@dataclass(slots=True)
class LoadItem:
    """Load tokens ``[begin, end)`` of chunk ``chunk_index`` (absolute positions) from ``key``."""

    chunk_index: int
    chunk_start: int
    begin: int
    end: int
    mode: str
    key: str
    patch_key: str | None = None

    @property
    def num_tokens(self) -> int:
        return self.end - self.begin


@dataclass(slots=True)
class Hole:
    """Tokens ``[start, end)``: whole chunks behind fresh tokens, loaded instead of computed."""

    start: int
    end: int
    loads: tuple[LoadItem, ...]

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass(slots=True)
class Plan:
    num_computed_tokens: int
    num_external_tokens: int
    loads: tuple[LoadItem, ...]
    # Decisions for every chunk at or after the one holding num_computed_tokens.
    decisions: tuple[ChunkDecision, ...]
    holes: tuple[Hole, ...] = ()

    def decision(self, chunk_index: int) -> ChunkDecision | None:
        for d in self.decisions:
            if d.index == chunk_index:
                return d
        return None

    @property
    def items(self) -> tuple[LoadItem, ...]:
        """Every load: the prefix run, then the holes'."""
        return (*self.loads, *(i for h in self.holes for i in h.loads))

    @property
    def first_approximate_token(self) -> int | None:
        """The first token this plan serves approximately (None: the plan is exact)."""
        return min((i.begin for i in self.items if i.mode in APPROXIMATE_MODES), default=None)


def plan_request(
    chunks: Sequence[Chunk],
    view: StoreView,
    *,
    num_computed_tokens: int,
    num_tokens: int,
    modes: frozenset[str] | set[str] = DEFAULT_MODES,
    min_hole_tokens: int = 0,
    mode_filter: ModeFilter | None = None,
    keys: RequestKeys = EXACT_KEYS,
    recompute_fraction: float = 0.0,
) -> Plan:
    """Plan the load for a request whose first ``num_computed_tokens`` vLLM already has.

    ``keys``: the entries the request may name. Its ``patch_rank`` is the rank patches are formed
    at (part of a patch's key; 0 turns the patched and orbit modes off), its ``lineage`` the
    request's policy tag ("" for an exact request: only exact entries are named), its
    ``canonical_context`` where canonicals are looked up. ``min_hole_tokens``: 0 plans no holes;
    else the shortest hole worth a separate forward step. ``mode_filter`` narrows the modes per
    chunk. ``recompute_fraction``: the share of a ``recompute`` chunk's tokens vLLM computes (its
    first ones, ``recompute.py``; the rest is a hole behind them); 0, or no holes, turns the mode
    off.
    """
    modes = frozenset(modes)
    if keys.patch_rank <= 0:
        modes = modes - PATCH_MODES
    if recompute_fraction <= 0 or min_hole_tokens <= 0:
        modes = modes - {RECOMPUTE}
    if not keys.lineage:
        modes = modes & {EXACT}
    elif modes & APPROXIMATE_MODES:
        modes = modes | {INHERITED}
    prompt_end = chunks[-1].end if chunks else 0
    limit = min(prompt_end, num_tokens - 1)
    first = chunk_at(chunks, num_computed_tokens)
    todo = list(chunks[first:])
    if not todo or num_computed_tokens >= limit:
        return Plan(num_computed_tokens, 0, (), ())

    decisions = _decide(todo, view, modes, keys, limit, mode_filter)
    loads: list[LoadItem] = []
    pos = num_computed_tokens
    num_run = 0
    for chunk, d in zip(todo, decisions, strict=True):
        if pos >= limit or d.mode == MISS or d.key is None:
            break
        fresh = num_recomputed(chunk.length, recompute_fraction) if d.mode == RECOMPUTE else 0
        if pos < chunk.start + fresh:
            break  # its first tokens are computed: the rest is a hole
        end = min(chunk.end, limit)
        loads.append(LoadItem(chunk.index, chunk.start, pos, end, d.mode, d.key, d.patch_key))
        pos = end
        num_run += 1
    holes = (
        find_holes(todo[num_run:], decisions[num_run:], limit, min_hole_tokens, recompute_fraction)
        if min_hole_tokens > 0
        else ()
    )
    return Plan(
        num_computed_tokens, pos - num_computed_tokens, tuple(loads), tuple(decisions), holes
    )


def find_holes(
    chunks: Sequence[Chunk],
    decisions: Sequence[ChunkDecision],
    limit: int,
    min_tokens: int,
    recompute_fraction: float = 0.0,
) -> tuple[Hole, ...]:
    """Maximal runs of servable whole chunks ending at or before ``limit``, skipping the first
    chunk (a hole must sit behind at least one computed token) and runs under ``min_tokens``. A
    ``recompute`` chunk's first tokens are computed: its rest starts a new run (the first chunk's
    too, its fresh tokens are in front of it)."""
    holes: list[Hole] = []
    run: list[LoadItem] = []

    def close() -> None:
        if run and run[-1].end - run[0].begin >= min_tokens:
            holes.append(Hole(run[0].begin, run[-1].end, tuple(run)))
        run.clear()

    for i, (chunk, d) in enumerate(zip(chunks, decisions, strict=True)):
        fresh = num_recomputed(chunk.length, recompute_fraction) if d.mode == RECOMPUTE else 0
        servable = (
            (i > 0 or fresh > 0) and d.mode != MISS and d.key is not None and chunk.end <= limit
            and fresh < chunk.length
        )
        if not servable or fresh:
            close()
        if not servable:
            continue
        run.append(LoadItem(
            chunk.index, chunk.start, chunk.start + fresh, chunk.end, d.mode, d.key, d.patch_key
        ))
    close()
    return tuple(holes)


def _decide(
    todo: list[Chunk],
    view: StoreView,
    modes: frozenset[str],
    keys: RequestKeys,
    limit: int,
    mode_filter: ModeFilter | None,
) -> list[ChunkDecision]:
    if modes == EXACT_ONLY and mode_filter is None:
        return _decide_exact(todo, view, keys)
    allowed = [_allowed(modes, mode_filter(c)) if mode_filter else modes for c in todo]
    n = len(todo)
    # One batched lookup: the exact entry of every chunk (its status matters even when the mode
    # is off: the save path skips chunks the store holds), the entry under this request's
    # policy, the canonical where it could be served or saved, and per allowed mode its keys.
    wanted: list[tuple[int, str, str]] = []
    for i, c in enumerate(todo):
        wanted.append((i, EXACT, c.exact_key))
        if INHERITED in allowed[i]:
            wanted.append((i, INHERITED, keys.conditioned(c.cid, c.antecedent_hash, is_inherited=True)))
        if allowed[i] & {PATCHED, ORBIT, BLIND, RECOMPUTE} or c.is_canonical_slot:
            wanted.append((i, "canonical", keys.canonical(c.cid)))
        if PATCHED in allowed[i]:
            wanted.append((i, PATCHED, keys.patch(c.cid, c.antecedent_hash)))
        if ORBIT in allowed[i] and c.antecedent:
            wanted.append((i, ORBIT, keys.orbit_patch(c.cid, c.antecedent)))
    tiers = view.lookup([k for _, _, k in wanted])
    found: list[dict[str, tuple[str, str]]] = [{} for _ in range(n)]
    for (i, what, key), tier in zip(wanted, tiers, strict=True):
        if tier is not None:
            found[i][what] = (key, tier)

    decisions: list[ChunkDecision | None] = [None] * n
    for i, c in enumerate(todo):
        for mode in (EXACT, INHERITED):
            if decisions[i] is None and mode in allowed[i] and mode in found[i]:
                key, tier = found[i][mode]
                decisions[i] = ChunkDecision(c.index, mode, key, tier=tier)

    relocated, reordered = _relocated(todo, decisions, found, view, keys, limit, allowed)
    for i, hit in reordered.items():
        found[i].setdefault(ORBIT, hit)
    out: list[ChunkDecision] = []
    for i, c in enumerate(todo):
        d = decisions[i]
        if d is None and i in relocated and relocated[i].mode == SURVIVOR:
            d = relocated[i]
        canon = found[i].get("canonical")
        for mode in (PATCHED, ORBIT):
            if d is None and canon and mode in found[i] and mode in allowed[i]:
                d = ChunkDecision(c.index, mode, canon[0], found[i][mode][0], canon[1])
        # A patch formed for this antecedent (or its orbit) beats an entry that misses the
        # inserted chunks' influence; that entry beats the canonical alone.
        d = d or relocated.get(i)
        # Its first tokens computed in context: closer to a prefill than the canonical alone. Text
        # only: a hole must not cut an image's placeholder span (the encoder would run for it).
        if d is None and RECOMPUTE in allowed[i] and canon and not c.is_mm:
            d = ChunkDecision(c.index, RECOMPUTE, canon[0], tier=canon[1])
        if d is None and BLIND in allowed[i] and canon:
            d = ChunkDecision(c.index, BLIND, canon[0], tier=canon[1])
        d = d or ChunkDecision(c.index, MISS)
        # Built directly: dataclasses.replace introspects the fields on every call, per chunk.
        out.append(ChunkDecision(
            d.index, d.mode, d.key, d.patch_key, d.tier, d.source_antecedent,
            has_exact_entry=EXACT in found[i],
            has_inherited_entry=INHERITED in found[i],
            has_canonical=canon is not None,
        ))
    return out


def _decide_exact(todo: list[Chunk], view: StoreView, keys: RequestKeys) -> list[ChunkDecision]:
    """``_decide`` for a request served exact KV only (every request unless it names a policy):
    the same decisions from one lookup of the exact entries and the canonical slot's canonical,
    without the per-mode bookkeeping of the general case (the scheduler plans every request)."""
    wanted = [c.exact_key for c in todo]
    slots = [i for i, c in enumerate(todo) if c.is_canonical_slot]
    tiers = view.lookup(wanted + [keys.canonical(todo[i].cid) for i in slots])
    exact_tiers, canonical_tiers = tiers[: len(todo)], tiers[len(todo):]
    has_canonical = {i for i, tier in zip(slots, canonical_tiers, strict=True) if tier is not None}
    return [
        ChunkDecision(c.index, EXACT, wanted[i], tier=tier, has_exact_entry=True,
                      has_canonical=i in has_canonical)
        if tier is not None
        else ChunkDecision(c.index, MISS, has_canonical=i in has_canonical)
        for i, (c, tier) in enumerate(zip(todo, exact_tiers, strict=True))
    ]


def _allowed(modes: frozenset[str], narrowed: frozenset[str]) -> frozenset[str]:
    out = modes & narrowed | (modes & {INHERITED})
    return out | {TRANSFER_ATTACHED} if TRANSFER in modes and TRANSFER_ATTACHED in narrowed else out


def _relocated(
    todo: list[Chunk],
    decided: list[ChunkDecision | None],
    found: list[dict[str, tuple[str, str]]],
    view: StoreView,
    keys: RequestKeys,
    limit: int,
    allowed: list[frozenset[str]],
) -> tuple[dict[int, ChunkDecision], dict[int, tuple[str, str]]]:
    """Per undecided chunk, the best conditioned entry stored behind another antecedent (a
    survivor if one is stored and allowed, else a transfer), and, where the orbit mode found no
    orbit entry, another ordering's own patch (the orbit of a set seen in one order): one read of
    the antecedent index and one batched lookup, only for chunks that need them."""

    def wants_reordering(i: int) -> bool:
        has = found[i]
        return ORBIT in allowed[i] and "canonical" in has and not has.keys() & {PATCHED, ORBIT}

    want = [
        i
        for i, c in enumerate(todo)
        if decided[i] is None and c.start < limit
        and (RELOCATED_MODES & allowed[i] or TRANSFER_ATTACHED in allowed[i] or wants_reordering(i))
    ]
    if not want:
        return {}, {}
    stored = view.batch_antecedents([todo[i].cid for i in want])
    # Each candidate antecedent, best first: its exact entry, then one computed under this policy.
    probes: list[tuple[int, str, tuple[str, ...], str]] = []
    for i, lists in zip(want, stored, strict=True):
        current, cid = todo[i].antecedent, todo[i].cid
        sources = []
        if SURVIVOR in allowed[i]:
            sources.append((SURVIVOR, survivor_candidates(current, lists)))
        if TRANSFER in allowed[i]:
            sources.append((TRANSFER, transfer_candidates(current, lists)))
        elif TRANSFER_ATTACHED in allowed[i] and current:
            attached = [s for s in lists if tuple(s[-1:]) == current[-1:]]
            sources.append((TRANSFER, transfer_candidates(current, attached)))
        for mode, candidates in sources:
            for cand in candidates:
                ante = antecedent_hash(cand)
                probes.append((i, mode, cand, keys.conditioned(cid, ante)))
                probes.append((i, mode, cand, keys.conditioned(cid, ante, is_inherited=True)))
        if wants_reordering(i):
            for cand in reordering_candidates(current, lists):
                probes.append((i, ORBIT, cand, keys.patch(cid, antecedent_hash(cand))))
    if not probes:
        return {}, {}
    tiers = view.lookup([p[3] for p in probes])
    relocated: dict[int, ChunkDecision] = {}
    reordered: dict[int, tuple[str, str]] = {}
    for (i, mode, cand, key), tier in zip(probes, tiers, strict=True):
        if tier is None:
            continue
        if mode == ORBIT:
            reordered.setdefault(i, (key, tier))
        elif i not in relocated:
            relocated[i] = ChunkDecision(todo[i].index, mode, key, tier=tier, source_antecedent=cand)
    return relocated, reordered
