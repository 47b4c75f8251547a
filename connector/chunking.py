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

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

# (model_fingerprint, layout, tenant, token_ids, mm_hashes, *, cache_salt, lora) -> cid;
# store.keys.chunk_cid by default.
CidFn = Callable[..., str]
# cids -> hash; store.keys.antecedent_hash by default.
AntecedentFn = Callable[[Sequence[str]], str]


@dataclass(frozen=True, slots=True)
class MMSpan:
    """One multimodal item in the prompt: its placeholder span and content hash."""

    offset: int
    length: int
    identifier: str
    modality: str = "image"


@dataclass(frozen=True, slots=True)
class Span:
    """A chunk's extent before it is keyed. ``mm`` is set for a multimodal item's span."""

    start: int
    length: int
    mm: MMSpan | None = None
    is_anchor: bool = False

    @property
    def end(self) -> int:
        return self.start + self.length


@dataclass(frozen=True, slots=True)
class Chunk:
    """A keyed chunk. ``antecedent`` is the ordered cids of every chunk before it in the prompt."""

    index: int
    start: int
    length: int
    cid: str
    antecedent: tuple[str, ...]
    antecedent_hash: str
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
) -> list[MMSpan]:
    """vLLM ``request.mm_features`` -> spans, sorted by offset.

    Each item is named by its content (``mm_identity.content_id``), not by vLLM's identifier,
    which may be a client's uuid, unless ``is_client_trusted``. An item with no identity raises
    ``UnkeyableItem``: the prompt is then not cached."""
    from .mm_identity import identifiers

    features = list(mm_features or ())
    names = identifiers(
        features, is_client_trusted=is_client_trusted, metadata_fields=metadata_fields
    )
    if any(name is None for name in names):
        raise UnkeyableItem("a multimodal item has no content identity (no processed inputs)")
    spans = [
        MMSpan(
            offset=int(f.mm_position.offset),
            length=int(f.mm_position.length),
            identifier=str(name),
            modality=str(getattr(f, "modality", "image")),
        )
        for f, name in zip(features, names, strict=True)
    ]
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
    token_ids: Sequence[int] | None = None,
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
    cuts = {b for b in boundaries if 0 < b < num_tokens}
    if token_ids is not None:
        cuts |= _content_cut_points(token_ids, anchor_len, mm_spans, chunk_size)
        cuts |= {i + 1 for i, t in enumerate(token_ids) if t in line_end_ids and 0 < i + 1 < num_tokens}
    spans: list[Span] = []
    if anchor_len:
        spans.append(Span(0, anchor_len, is_anchor=True))
    pos = anchor_len
    for mm in sorted(mm_spans, key=lambda s: s.offset):
        if mm.length <= 0:
            continue
        if mm.offset < pos or mm.offset + mm.length > num_tokens:
            raise ValueError(
                f"multimodal span [{mm.offset}, {mm.offset + mm.length}) overlaps the previous "
                f"chunk (ends at {pos}) or runs past the prompt ({num_tokens} tokens)"
            )
        spans.extend(_text_spans(pos, mm.offset, chunk_size, cuts))
        spans.append(Span(mm.offset, mm.length, mm=mm))
        pos = mm.offset + mm.length
    spans.extend(_text_spans(pos, num_tokens, chunk_size, cuts))
    return spans


def _content_cut_points(
    token_ids: Sequence[int], anchor_len: int, mm_spans: Sequence[MMSpan], chunk_size: int
) -> set[int]:
    """Content-defined cuts in every text stretch; ``_text_spans`` still caps runs at chunk_size."""
    from .cdc import WINDOW, content_cuts, window_hashes

    min_len = max(1, chunk_size // 4)
    hashes = window_hashes(token_ids, window=min(WINDOW, min_len))
    out: set[int] = set()
    pos = anchor_len
    for start, end in [(m.offset, m.offset + m.length) for m in sorted(mm_spans, key=lambda m: m.offset)] + [
        (len(token_ids), len(token_ids))
    ]:
        if start > pos:
            out.update(
                content_cuts(
                    hashes, pos, start, min_len=min_len, max_len=chunk_size, avg_gap=min_len
                )
            )
        pos = max(pos, end)
    return out


def _text_spans(start: int, end: int, chunk_size: int, cuts: set[int]) -> list[Span]:
    out: list[Span] = []
    pos = start
    for cut in sorted(c for c in cuts if start < c < end) + [end]:
        while pos < cut:
            length = min(chunk_size, cut - pos)
            out.append(Span(pos, length))
            pos += length
    return out


def key_spans(
    spans: Sequence[Span],
    token_ids: Sequence[int],
    ctx: KeyContext,
    *,
    has_anchor_ids: bool = False,
    cid_fn: CidFn | None = None,
    antecedent_fn: AntecedentFn | None = None,
) -> list[Chunk]:
    """Give each span its cid and antecedent. Placeholder tokens are keyed by the item's hash.
    ``has_anchor_ids``: the model has an anchor (a prompt without it has no canonical slot)."""
    if cid_fn is None or antecedent_fn is None:
        from orbitkv.store import keys

        cid_fn = cid_fn or keys.chunk_cid
        antecedent_fn = antecedent_fn or keys.antecedent_hash
    has_anchor = bool(spans) and spans[0].is_anchor
    canonical_index = 1 if has_anchor else (-1 if has_anchor_ids else 0)
    chunks: list[Chunk] = []
    cids: list[str] = []
    for i, span in enumerate(spans):
        ids = list(token_ids[span.start : span.end])
        mm_hashes = _mm_hashes(span) if span.mm is not None else None
        cid = cid_fn(
            ctx.model_fingerprint, ctx.layout, ctx.tenant, ids, mm_hashes,
            cache_salt=ctx.cache_salt, lora=ctx.lora,
        )
        antecedent = tuple(cids)
        chunks.append(
            Chunk(
                index=i,
                start=span.start,
                length=span.length,
                cid=cid,
                antecedent=antecedent,
                antecedent_hash=antecedent_fn(antecedent),
                mm_identifier=span.mm.identifier if span.mm is not None else None,
                is_anchor=span.is_anchor,
                is_canonical_slot=(i == canonical_index and not span.is_anchor),
                modality=span.mm.modality if span.mm is not None else "text",
            )
        )
        cids.append(cid)
    return chunks


def _mm_hashes(span: Span) -> list[tuple[int, int, str]]:
    """The whole span is one placeholder run: ``(offset, length, content_hash)``, chunk-relative.

    The run covers the item's framing tokens too (e.g. Idefics3's ``<fake_token_around_image>``):
    they are fixed per model, so hashing them as part of the item loses nothing.
    """
    assert span.mm is not None
    return [(0, span.length, span.mm.identifier)]


def chunk_prompt(
    token_ids: Sequence[int],
    mm_spans: Sequence[MMSpan],
    chunk_size: int,
    ctx: KeyContext,
    *,
    anchor_ids: Sequence[int] = (),
    boundaries: Iterable[int] = (),
    text_chunking: str = "content",
    line_end_ids: frozenset[int] = frozenset(),
    cid_fn: CidFn | None = None,
    antecedent_fn: AntecedentFn | None = None,
) -> list[Chunk]:
    """Split and key a prompt. The anchor is split off only when the prompt starts with it."""
    if text_chunking not in TEXT_CHUNKING:
        raise ValueError(f"text_chunking must be one of {TEXT_CHUNKING}, got {text_chunking!r}")
    anchor_len = len(anchor_ids) if _starts_with(token_ids, anchor_ids) else 0
    spans = split_spans(
        len(token_ids),
        mm_spans,
        chunk_size,
        anchor_len=anchor_len,
        boundaries=boundaries,
        token_ids=token_ids if text_chunking == "content" else None,
        line_end_ids=line_end_ids,
    )
    return key_spans(
        spans, token_ids, ctx, has_anchor_ids=bool(anchor_ids), cid_fn=cid_fn,
        antecedent_fn=antecedent_fn,
    )


def _starts_with(token_ids: Sequence[int], prefix: Sequence[int]) -> bool:
    return (
        bool(prefix)
        and len(token_ids) > len(prefix)
        and list(token_ids[: len(prefix)]) == list(prefix)
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
