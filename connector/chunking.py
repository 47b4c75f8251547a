"""Split a request's prompt into chunks, the unit of reuse, and give each its content key.

A chunk is either one multimodal item's placeholder span or a run of at most ``chunk_size`` text
tokens. Text is cut within each text stretch (the tokens between two items, or between the prompt
start and the first item), in one of two ways:

- ``content`` (the default): after every line end (a token that ends with a newline), and inside
  long lines at content-defined points (``cdc.py``). Both depend only on the text itself, so the
  same line gives the same chunk whatever precedes or follows it: an observation that was followed
  by a tool result and is now followed by the next image still matches, and so does text that
  moved;
- ``fixed``: runs of ``chunk_size`` from the stretch start (LMCache's way): moved text matches only
  when it starts a stretch and its length is a multiple of ``chunk_size``.

Item boundaries always cut; callers can add cut points (``boundaries``), e.g. where a client knows
a document or turn ends.

All functions here are pure: the scheduler calls them on every ``get_num_new_matched_tokens``.
"""

from __future__ import annotations

import bisect
import functools
import sys
from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from orbitkv.store.keys import token_array

from .cdc import text_cuts
from .chunk_keys import chunk_keys, layout_keys
from .mm_identity import identifiers


@dataclass(slots=True)
class MMSpan:
    """One multimodal item in the prompt: its placeholder span and content hash."""

    offset: int
    length: int
    identifier: str
    modality: str = "image"


@dataclass(slots=True)
class Span:
    """A chunk's extent before it is keyed. ``mm`` is set for a multimodal item's span."""

    start: int
    length: int
    mm: MMSpan | None = None
    is_anchor: bool = False

    @property
    def end(self) -> int:
        return self.start + self.length


@dataclass(slots=True)
class Chunk:
    """A keyed chunk. ``antecedent`` is the ordered cids of every chunk before it in the prompt.

    Never changed once made (a request's chunks are shared through the scheduler's memo), yet not
    ``frozen``: a frozen dataclass sets each field through ``object.__setattr__``, five times the
    cost (39 against 7.5 us for a prompt's 18 chunks), and the scheduler makes them for every
    prompt on the engine's critical path. The same holds for ``Span`` and ``MMSpan``."""

    index: int
    start: int
    length: int
    cid: str
    antecedent: tuple[str, ...]
    antecedent_hash: str
    # Its exact conditioned entry (``keys.conditioned_key(cid, antecedent_hash)``), named by the
    # keying's native call: the planner and the save path name it for every chunk they look at.
    exact_key: str
    mm_identifier: str | None = None
    is_anchor: bool = False
    # Right after the anchor (or first in its prompt when the model has no anchor): its KV is the
    # canonical KV(B|anchor). A prompt that does not start with the anchor has no canonical slot:
    # its first chunk's KV is KV(B|nothing), another context.
    is_canonical_slot: bool = False
    modality: str = "text"

    @property
    def end(self) -> int:
        return self.start + self.length

    @property
    def is_mm(self) -> bool:
        return self.mm_identifier is not None


@dataclass(frozen=True, slots=True)
class KeyContext:
    """What besides the tokens goes into a cid: the model, the cache layout, the isolation pair and
    the LoRA adapter.

    ``tenant`` is OrbitKV's namespace (config or per request), ``cache_salt`` vLLM's per-request
    salt; each is its own hashed field, so different salts under one tenant never share a chunk.
    """

    model_fingerprint: str
    layout: str
    tenant: str = ""
    cache_salt: str = ""
    # The LoRA adapter (name and path; "" for the base model): vLLM's block hash has it too.
    lora: str = ""


class UnkeyableItem(ValueError):
    """A multimodal item the scheduler holds no inputs of (``mm_identity``), so no key: the
    prompt is served by vLLM alone."""


def mm_spans_from_features(
    mm_features: Iterable[Any] | None,
    *,
    is_client_trusted: bool = False,
    metadata_fields: Callable[[str], set[str]] | None = None,
    seconds: Any = None,
    vouched: frozenset[str] = frozenset(),
) -> list[MMSpan]:
    """vLLM ``request.mm_features`` -> spans, sorted by offset.

    Each item is named by its content (``mm_identity.content_id``), not by vLLM's identifier,
    which may be a client's uuid, unless ``is_client_trusted``; an item whose hash vLLM made from
    content (``vouched``, ``vllm_ext/mm_hashes.py``) by that hash. An item with no identity raises
    ``UnkeyableItem``: the prompt is then not cached. ``seconds`` (a ``timing.PartSeconds``):
    where hashing new items' inputs counts (``mm_hash``)."""
    if not mm_features:
        return []  # a text prompt: vLLM's list is empty
    features = mm_features if type(mm_features) is list else list(mm_features)
    names = identifiers(
        features, is_client_trusted=is_client_trusted, metadata_fields=metadata_fields,
        seconds=seconds, vouched=vouched,
    )
    spans = []
    is_sorted = True
    last = -1
    for f, name in zip(features, names, strict=True):
        if name is None:
            raise UnkeyableItem("a multimodal item has no content identity (no processed inputs)")
        position = f.mm_position
        offset = int(position.offset)
        is_sorted = is_sorted and offset >= last
        last = offset
        spans.append(
            MMSpan(offset, int(position.length), str(name), str(getattr(f, "modality", "image")))
        )
    if not is_sorted:  # vLLM lists items in prompt order; a caller's list may not be
        spans.sort(key=lambda s: s.offset)
    return spans


TEXT_CHUNKING = ("content", "fixed")


def split_spans(
    num_tokens: int,
    mm_spans: Sequence[MMSpan],
    chunk_size: int,
    *,
    anchor_len: int = 0,
    boundaries: Iterable[int] = (),
    token_ids: Sequence[int] | np.ndarray | None = None,
    line_end_ids: frozenset[int] = frozenset(),
) -> list[Span]:
    """Cut ``[0, num_tokens)`` into spans: anchor, one per item, text runs of <= chunk_size.

    ``anchor_len`` leading tokens form their own span (the anchor), never merged with text.
    With ``token_ids`` text is cut at content-defined points, else in fixed runs (module docstring).
    Items that overlap each other or the anchor, or run past the prompt, raise ``ValueError``:
    vLLM never produces them, so they mean a caller bug.
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if not 0 <= anchor_len <= num_tokens:
        raise ValueError(f"anchor_len {anchor_len} outside [0, {num_tokens}]")
    ordered = sorted(mm_spans, key=lambda s: s.offset)
    cuts = _cut_points(num_tokens, ordered, chunk_size, anchor_len, boundaries, token_ids,
                       line_end_ids)
    spans: list[Span] = []
    if anchor_len:
        spans.append(Span(0, anchor_len, is_anchor=True))
    pos = anchor_len
    for mm in ordered:
        if mm.length <= 0:
            continue
        if mm.offset < pos or mm.offset + mm.length > num_tokens:
            raise ValueError(
                f"multimodal span [{mm.offset}, {mm.offset + mm.length}) overlaps the previous "
                f"chunk (ends at {pos}) or runs past the prompt ({num_tokens} tokens)"
            )
        _text_spans(spans, pos, mm.offset, chunk_size, cuts)
        spans.append(Span(mm.offset, mm.length, mm=mm))
        pos = mm.offset + mm.length
    _text_spans(spans, pos, num_tokens, chunk_size, cuts)
    return spans


def _cut_points(
    num_tokens: int, items: Sequence[MMSpan], chunk_size: int, anchor_len: int,
    boundaries: Iterable[int], token_ids: Sequence[int] | np.ndarray | None,
    line_end_ids: frozenset[int],
) -> list[int]:
    """Every cut inside the prompt, sorted: the caller's, content-defined ones, line ends."""
    cuts = [int(b) for b in boundaries if 0 < b < num_tokens]
    if token_ids is None:
        return sorted(set(cuts))
    tokens = token_ids if type(token_ids) is array else np.ascontiguousarray(token_ids, np.int64)
    # ``_text_spans`` still caps runs at chunk_size; a cut after every line end.
    found = text_cuts(
        tokens, _text_stretches(anchor_len, items, num_tokens),
        min_len=max(1, chunk_size // 4), max_len=chunk_size,
        line_end_table=_line_end_table(line_end_ids) if line_end_ids else None,
    )
    return sorted(set(cuts).union(found)) if cuts else found


@functools.lru_cache(maxsize=16)
def _line_end_table(line_end_ids: frozenset[int]) -> bytes:
    """``table[t + 1]``: token ``t`` ends a line; one lookup per token, for a tokenizer's hundreds
    of line-end ids as for one. Its first and last entries are 0."""
    table = bytearray(max(max(line_end_ids), -1) + 3)
    for i in line_end_ids:
        if i >= 0:
            table[i + 1] = 1
    return bytes(table)


def _text_stretches(
    anchor_len: int, items: Sequence[MMSpan], num_tokens: int
) -> list[tuple[int, int]]:
    """The text between the anchor and the items (sorted by offset), each ``(start, end)``."""
    out: list[tuple[int, int]] = []
    pos = anchor_len
    for start, end in [(m.offset, m.offset + m.length) for m in items] + [(num_tokens, num_tokens)]:
        if start > pos:
            out.append((pos, start))
        pos = max(pos, end)
    return out


def _text_spans(out: list[Span], start: int, end: int, chunk_size: int, cuts: list[int]) -> None:
    """Append the text runs of ``[start, end)``: cut at ``cuts`` (sorted), at most chunk_size."""
    pos = start
    first = bisect.bisect_right(cuts, start)
    last = bisect.bisect_left(cuts, end, first)
    for cut in [*cuts[first:last], end]:
        while pos < cut:
            length = min(chunk_size, cut - pos)
            out.append(Span(pos, length))
            pos += length


def key_spans(
    spans: Sequence[Span],
    token_ids: Sequence[int] | np.ndarray,
    ctx: KeyContext,
    *,
    has_anchor_ids: bool = False,
) -> list[Chunk]:
    """Give each span its cid and antecedent. Placeholder tokens are keyed by the item's hash
    (the whole span is one placeholder run: its framing tokens, e.g. Idefics3's
    ``<fake_token_around_image>``, are fixed per model, so hashing them with the item loses
    nothing). ``has_anchor_ids``: the model has an anchor (a prompt without it has no canonical
    slot)."""
    cids, antecedent_of, exact_keys = chunk_keys(
        ctx.model_fingerprint, ctx.layout, ctx.tenant, token_ids,
        [(s.start, s.end, s.mm.identifier if s.mm is not None else None) for s in spans],
        cache_salt=ctx.cache_salt, lora=ctx.lora,
    )
    has_anchor = bool(spans) and spans[0].is_anchor
    canonical_index = 1 if has_anchor else (-1 if has_anchor_ids else 0)
    all_cids = tuple(cids)
    # Positional: keywords cost about twice as much per chunk (``Chunk``'s docstring).
    return [
        Chunk(
            i, span.start, span.length, cids[i], all_cids[:i], antecedent_of[i], exact_keys[i],
            None if span.mm is None else span.mm.identifier, span.is_anchor,
            i == canonical_index and not span.is_anchor,
            "text" if span.mm is None else span.mm.modality,
        )
        for i, span in enumerate(spans)
    ]


def chunk_prompt(
    token_ids: Sequence[int] | np.ndarray,
    mm_spans: Sequence[MMSpan],
    chunk_size: int,
    ctx: KeyContext,
    *,
    anchor_ids: Sequence[int] = (),
    boundaries: Iterable[int] = (),
    text_chunking: str = "content",
    line_end_ids: frozenset[int] = frozenset(),
) -> list[Chunk]:
    """Split and key a prompt. The anchor is split off only when the prompt starts with it.
    ``split_spans`` and ``key_spans`` are the definition; vLLM's list of tokens (or an
    ``array('q')``) is laid out and keyed in one native call where the extension module
    runs (``chunk_keys.layout_keys``; the two Python passes cost about 140 us a prompt on the
    scheduler's cold caches)."""
    if text_chunking not in TEXT_CHUNKING:
        raise ValueError(f"text_chunking must be one of {TEXT_CHUNKING}, got {text_chunking!r}")
    # vLLM's list goes to the native call as it is (converted there); other forms as an array.
    is_list = type(token_ids) is list
    tokens = token_ids if is_list else prompt_tokens(token_ids)
    anchor_len = len(anchor_ids) if _starts_with(tokens, anchor_ids) else 0
    is_content = text_chunking == "content"
    if is_list or type(tokens) is array:
        laid_out = layout_keys(
            ctx.model_fingerprint, ctx.layout, ctx.tenant, tokens,
            [(m.offset, m.length, m.identifier) for m in mm_spans],
            boundaries if type(boundaries) in (list, tuple) else list(boundaries),
            anchor_len=anchor_len, chunk_size=chunk_size, is_content=is_content,
            line_end_table=_line_end_table(line_end_ids) if is_content and line_end_ids else b"",
            cache_salt=ctx.cache_salt, lora=ctx.lora,
        )
        if laid_out is not None:
            return _chunks(mm_spans, *laid_out, has_anchor_ids=bool(anchor_ids))
    if is_list:
        tokens = prompt_tokens(token_ids)
    spans = split_spans(
        len(tokens),
        mm_spans,
        chunk_size,
        anchor_len=anchor_len,
        boundaries=boundaries,
        token_ids=tokens if is_content else None,
        line_end_ids=line_end_ids,
    )
    return key_spans(spans, tokens, ctx, has_anchor_ids=bool(anchor_ids))


def _chunks(
    mm_spans: Sequence[MMSpan], spans: list[tuple[int, int, int]], cids: list[str],
    antecedents: list[str], exact_keys: list[str], *, has_anchor_ids: bool,
) -> list[Chunk]:
    """``key_spans``' chunks from ``chunk_keys.layout_keys``' spans and keys."""
    has_anchor = bool(spans) and spans[0][2] == -2
    canonical_index = 1 if has_anchor else (-1 if has_anchor_ids else 0)
    all_cids = tuple(cids)
    return [
        Chunk(
            i, start, length, cids[i], all_cids[:i], antecedents[i], exact_keys[i],
            None if kind < 0 else mm_spans[kind].identifier, kind == -2,
            i == canonical_index and kind != -2,
            "text" if kind < 0 else mm_spans[kind].modality,
        )
        for i, (start, length, kind) in enumerate(spans)
    ]


def prompt_tokens(token_ids: Sequence[int] | np.ndarray) -> np.ndarray | array:
    """The prompt's ids as one int64 buffer: vLLM's list as an ``array('q')`` (one C loop; numpy's
    conversion of a list costs about twice as much on the scheduler's cold caches), anything
    else as ``keys.token_array``'s numpy array. Both index, slice and ``tolist`` alike."""
    if type(token_ids) is list and sys.byteorder == "little":
        try:
            return array("q", token_ids)
        except (TypeError, OverflowError):
            pass  # token_array names what is wrong
    return token_array(token_ids)


def _starts_with(tokens: np.ndarray | array | list[int], prefix: Sequence[int]) -> bool:
    return (
        bool(prefix)
        and len(tokens) > len(prefix)
        and list(tokens[: len(prefix)]) == list(prefix)
    )


def chunk_at(chunks: Sequence[Chunk], pos: int) -> int:
    """Index of the chunk holding token ``pos``, or ``len(chunks)`` when pos is past the end."""
    lo, hi = 0, len(chunks)
    while lo < hi:
        mid = (lo + hi) // 2
        if chunks[mid].end <= pos:
            lo = mid + 1
        else:
            hi = mid
    return lo
