"""Content ids and store keys.

A content id (CID) is the 128-bit xxh3 of a chunk's identity: model fingerprint, cache layout, the
isolation pair (OrbitKV tenant, vLLM ``cache_salt``), the LoRA adapter (vLLM hashes it into its block
hashes too: one adapter's KV is not another's) and the chunk's token ids. The position is
deliberately left out: reuse at any position is the point of the store. Multimodal placeholder runs are replaced by the item's content
hash (``connector/mm_identity.py``: a hash of its processed inputs, never a client-given name), because
the placeholder ids are the same for every image.

``mm_hashes`` is a sequence of ``(offset, length, content_hash)`` triples, offsets relative to the
chunk's first token: tokens ``[offset, offset + length)`` are one item's placeholder run. Runs must be
sorted, non-overlapping and inside the chunk.

Every hashed field is tagged and length-prefixed, so no two different inputs can produce the same
byte stream by concatenation (for example tenant ``"ab"`` + fingerprint ``"c"`` vs ``"a"`` + ``"bc"``).
Keys are built from hex digests and small integers only: they never carry prompt text, and ``:`` is a
safe delimiter because no field can contain it.

Lineage (``../docs/exactness.md``): a conditioned entry is *exact* (what a full prefill of its prompt
computes) or *approximate under a policy*: KV computed over survivor, patched, orbit or blind KV. An
approximate entry's key carries its policy tag (``l<tag>``), so an exact plan never names it and a
request under another policy never reads it. Canonicals and patches are formed from exact KV only.
A canonical is ``KV(B | context)``: its key names the context (the antecedent hash of the anchor),
so two contexts never write one canonical key.

``okv2``: version 1 keys had no lineage, so nothing stored under them can be trusted as exact; they
are never read (``orbitkv store gc`` removes them).
"""

from __future__ import annotations

import dataclasses
import functools
import re
import struct
import sys
from array import array
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import xxhash

KEY_VERSION = "okv2"
KINDS = ("canonical", "conditioned", "patch", "encoder")
# Kinds addressed by their cid alone. ``encoder``: a vision encoder's output for one multimodal
# item (connector/encoder/), keyed by model, tenant, salt and the item's content; it depends on the
# item alone, so it has no context and no lineage.
CID_ONLY_KINDS = ("encoder",)
INDEX_KIND = "ante"

_HEX32 = re.compile(r"[0-9a-f]{32}")
_HEX32_RUN = re.compile(r"(?:[0-9a-f]{32})*")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


def _field(tag: bytes, data: bytes) -> bytes:
    return _field_head(tag, len(data)) + data


def _field_head(tag: bytes, nbytes: int) -> bytes:
    """A field's tag and length, for a caller that streams its ``nbytes`` of data after it."""
    return tag + _U64.pack(nbytes)


def _text(tag: bytes, value: str) -> bytes:
    if not isinstance(value, str):
        raise TypeError(f"expected str for {tag.decode()}, got {type(value).__name__}")
    return _field(tag, value.encode("utf-8"))


_VERSION_FIELD = _text(b"V", KEY_VERSION)
VERSION_FIELD = _VERSION_FIELD
_xxh3_hex = xxhash.xxh3_128_hexdigest


def is_cid(value: object) -> bool:
    return isinstance(value, str) and _HEX32.fullmatch(value) is not None


def _check_cid(value: object, what: str = "cid") -> str:
    if not is_cid(value):
        raise ValueError(f"{what} must be 32 lowercase hex chars, got {value!r}")
    return value  # type: ignore[return-value]


def token_array(token_ids: object) -> np.ndarray:
    """Token ids (a sequence, an array, a torch tensor) as one 1-D int64 array."""
    if hasattr(token_ids, "detach"):  # a torch tensor, possibly on a device
        token_ids = token_ids.detach().cpu().numpy()
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise ValueError(f"token_ids must be 1-D, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"token_ids must be integers, got {arr.dtype}")
    return arr.astype("<i8", copy=False)


def chunk_cid(
    model_fingerprint: str,
    layout: str,
    tenant: str,
    token_ids: Sequence[int] | np.ndarray,
    mm_hashes: Iterable[tuple[int, int, str]] | None = None,
    *,
    cache_salt: str = "",
    lora: str = "",
) -> str:
    """The chunk's content id: 32 hex chars of xxh3-128. See the module docstring for ``mm_hashes``.

    ``tenant`` and ``cache_salt`` are two tagged fields, both always hashed: tenant ``"x"`` with no
    salt and salt ``"x"`` with no tenant are different chunks, as are two salts under one tenant.
    ``lora`` names the LoRA adapter the KV was computed with ("" for the base model).
    """
    tokens = token_array(token_ids)
    h = _cid_prefix(model_fingerprint, layout, tenant, cache_salt, lora).copy()
    h.update(_U64.pack(len(tokens)))
    cursor = 0
    for offset, length, content_hash in sorted(mm_hashes or (), key=lambda run: run[0]):
        if offset < cursor or length <= 0 or offset + length > len(tokens):
            raise ValueError(f"bad placeholder run ({offset}, {length}) for {len(tokens)} tokens")
        h.update(_field(b"T", tokens[cursor:offset].tobytes()))
        h.update(_U64.pack(length))
        h.update(_text(b"M", content_hash))
        cursor = offset + length
    h.update(_field(b"T", tokens[cursor:].tobytes()))
    return h.hexdigest()


def prompt_cids(
    model_fingerprint: str,
    layout: str,
    tenant: str,
    token_ids: Sequence[int] | np.ndarray,
    runs: Iterable[tuple[int, int, str | None]],
    *,
    cache_salt: str = "",
    lora: str = "",
) -> list[str]:
    """The cids of one prompt's chunks, ``runs`` of ``(start, end, item_hash)``: each equal to
    ``chunk_cid`` of ``token_ids[start:end]`` with ``item_hash`` (None: text) as one placeholder
    run over the whole chunk. One pass over the prompt's bytes: the scheduler keys every prompt.
    ``token_ids`` may be ``chunking.prompt_tokens``' ``array('q')``: its bytes are the same."""
    if type(token_ids) is array and token_ids.typecode == "q" and sys.byteorder == "little":
        tokens = token_ids
        raw = memoryview(token_ids).cast("B")
    else:
        tokens = token_array(token_ids)
        raw = memoryview(np.ascontiguousarray(tokens)).cast("B")
    prefix = cid_prefix_bytes(model_fingerprint, layout, tenant, cache_salt, lora)
    pack = _U64.pack
    out: list[str] = []
    # One-shot digests of the joined fields (the same bytes chunk_cid streams): a chunk costs a
    # join and a hash, not a state copy and four updates, on the scheduler's cold caches.
    for start, end, item_hash in runs:
        if not 0 <= start < end <= len(tokens):
            raise ValueError(f"bad chunk [{start}, {end}) for {len(tokens)} tokens")
        length = pack(end - start)
        if item_hash is None:
            fields = (prefix, length, b"T", pack(8 * (end - start)), raw[8 * start : 8 * end])
        else:
            fields = (prefix, length, _EMPTY_TEXT, length, _text(b"M", item_hash), _EMPTY_TEXT)
        out.append(_xxh3_hex(b"".join(fields)))
    return out


_EMPTY_TEXT = _field(b"T", b"")


@functools.lru_cache(maxsize=64)
def cid_prefix_bytes(
    model_fingerprint: str, layout: str, tenant: str, cache_salt: str, lora: str
) -> bytes:
    """A cid's fixed fields (the same for a whole prompt), hashed first by every cid; a keyer
    that hashes them itself (``connector/chunk_keys.py``) takes them from here, and
    ``VERSION_FIELD`` for an antecedent hash."""
    return b"".join((
        _VERSION_FIELD, _text(b"F", model_fingerprint), _text(b"L", layout), _text(b"S", tenant),
        _text(b"C", cache_salt), _text(b"R", lora),
    ))


@functools.lru_cache(maxsize=64)
def _cid_prefix(model_fingerprint: str, layout: str, tenant: str, cache_salt: str, lora: str) -> Any:
    """The hash state after a cid's fixed fields, copied per chunk (the same for a whole prompt)."""
    h = xxhash.xxh3_128()
    h.update(cid_prefix_bytes(model_fingerprint, layout, tenant, cache_salt, lora))
    return h


def _joined_cids(items: Sequence[str]) -> str:
    """The cids as one string, each checked. Fixed-width cids need no separator, so a list hashes
    as one string; a plan hashes every chunk's antecedent (quadratic in chunks): one regex over the
    whole list, not one per cid."""
    try:
        joined = "".join(items)
    except TypeError:
        joined = None
    if (joined is None or (items and not (min(map(len, items)) == max(map(len, items)) == 32))
            or _HEX32_RUN.fullmatch(joined) is None):
        for c in items:
            _check_cid(c)  # names the bad one
    return joined


def _hash_cids(tag: bytes, cids: Iterable[str]) -> str:
    items = cids if isinstance(cids, (list, tuple)) else list(cids)
    joined = _joined_cids(items)
    h = xxhash.xxh3_128()
    h.update(_VERSION_FIELD)
    h.update(tag + _U64.pack(len(items)))
    h.update(joined.encode("ascii"))
    return h.hexdigest()


def antecedent_hash(cids: Iterable[str]) -> str:
    """Hash of the ordered list of CIDs before a chunk (the empty list has a hash too)."""
    return _hash_cids(b"A", cids)


def antecedent_hashes(cids: Sequence[str]) -> list[str]:
    """``antecedent_hash(cids[:i])`` for every ``i`` in ``0..len(cids)``, the list checked once."""
    raw = memoryview(_joined_cids(cids).encode("ascii"))
    pack = _U64.pack
    return [
        _xxh3_hex(b"".join((_VERSION_FIELD, b"A", pack(i), raw[: 32 * i])))
        for i in range(len(cids) + 1)
    ]


def orbit_key(cids: Iterable[str]) -> str:
    """Hash of the sorted multiset of antecedent CIDs: equal for every reordering of the same chunks."""
    return _hash_cids(b"O", sorted(cids))


EMPTY_ANTECEDENT = antecedent_hash(())


_LINEAGE = re.compile(r"l([0-9a-f]{32})")
_RANK = re.compile(r"r([1-9][0-9]{0,5})")


@dataclasses.dataclass(frozen=True, slots=True)
class EntryKey:
    """Address of one stored entry.

    ``canonical``: ``cid`` + ``antecedent`` (the antecedent hash of the context it was computed in,
    the anchor). ``conditioned``: ``cid`` + ``antecedent`` + ``lineage`` ("" for exact KV, else the
    tag of the policy whose approximate KV it was computed over). ``patch``: ``cid`` +
    ``antecedent`` (an antecedent hash or an orbit key) + ``rank`` (> 0). ``encoder``: ``cid`` only.
    """

    cid: str
    kind: str
    antecedent: str = ""
    rank: int = 0
    lineage: str = ""

    def __post_init__(self) -> None:
        _check_cid(self.cid)
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind in CID_ONLY_KINDS:
            if self.antecedent or self.rank or self.lineage:
                raise ValueError(f"a {self.kind} key has no antecedent, rank or lineage")
            return
        if not self.antecedent and self.kind != "patch":
            # The empty context (a chunk first in its prompt) has a hash like any other.
            object.__setattr__(self, "antecedent", EMPTY_ANTECEDENT)
        _check_cid(self.antecedent, "antecedent")
        if self.lineage and (self.kind != "conditioned" or not is_cid(self.lineage)):
            raise ValueError(f"only a conditioned key has a lineage tag, got {self.lineage!r}")
        if self.kind == "patch":
            if not isinstance(self.rank, int) or self.rank <= 0:
                raise ValueError(f"a patch key needs a positive rank, got {self.rank!r}")
        elif self.rank:
            raise ValueError(f"a {self.kind} key has no rank")

    @property
    def is_exact(self) -> bool:
        return not self.lineage

    def to_str(self) -> str:
        if self.kind in CID_ONLY_KINDS:
            return f"{KEY_VERSION}:{self.kind}:{self.cid}"
        base = f"{KEY_VERSION}:{self.kind}:{self.cid}:{self.antecedent}"
        if self.kind == "patch":
            return f"{base}:r{self.rank}"
        return f"{base}:l{self.lineage}" if self.lineage else base

    def __str__(self) -> str:
        return self.to_str()

    @classmethod
    def parse(cls, text: str) -> EntryKey:
        """Inverse of ``to_str``; raises ``ValueError`` on anything else."""
        parts = text.split(":") if isinstance(text, str) else []
        if len(parts) not in (3, 4, 5) or parts[0] != KEY_VERSION or parts[1] not in KINDS:
            raise ValueError(f"not an OrbitKV entry key: {text!r}")
        if parts[1] in CID_ONLY_KINDS:
            if len(parts) == 3:
                return cls(parts[2], parts[1])
            raise ValueError(f"not an OrbitKV entry key: {text!r}")
        if len(parts) == 3:
            raise ValueError(f"not an OrbitKV entry key: {text!r}")
        kind, cid, antecedent = parts[1], parts[2], parts[3]
        tail = parts[4] if len(parts) == 5 else None
        if tail is None and kind != "patch":
            return cls(cid, kind, antecedent)
        if tail is not None and kind == "patch" and (m := _RANK.fullmatch(tail)):
            return cls(cid, kind, antecedent, int(m.group(1)))
        if tail is not None and kind == "conditioned" and (m := _LINEAGE.fullmatch(tail)):
            return cls(cid, kind, antecedent, lineage=m.group(1))
        raise ValueError(f"not an OrbitKV entry key: {text!r}")


def index_key(cid: str) -> str:
    """Key of the per-CID antecedent index (the survivor-mode lookup); lives in every tier."""
    return f"{KEY_VERSION}:{INDEX_KIND}:{_check_cid(cid)}"


def key_str(key: EntryKey | str) -> str:
    return key.to_str() if isinstance(key, EntryKey) else key


# -- the key scheme: every entry key OrbitKV names is built here ------------------------------------


# What every exact conditioned key starts with (``EntryKey.to_str``): the native chunk keys
# (``connector/chunk_keys.py``) name each chunk's exact entry as this + cid + ":" + antecedent.
CONDITIONED_KEY_HEAD = f"{KEY_VERSION}:conditioned:"


# Cached: a plan, its saves and the awaited-saves check name the same chunks' keys again, and an
# agent's next prompt repeats most of them (about 40 a request; a key is validated as it is built).
@functools.lru_cache(maxsize=16384)
def conditioned_key(cid: str, antecedent: str, lineage: str = "") -> str:
    """``cid`` computed after the chunks hashed in ``antecedent``: exact KV (``lineage`` "") or KV
    computed over approximate KV under the policy tagged ``lineage``."""
    return EntryKey(cid, "conditioned", antecedent, lineage=lineage).to_str()


@functools.lru_cache(maxsize=4096)
def canonical_key(cid: str, context: str = "") -> str:
    """``KV(cid | context)``, ``context`` the antecedent hash of the anchor (see ``anchor_context``;
    "" is the empty context)."""
    return EntryKey(cid, "canonical", context).to_str()


def patch_key(cid: str, antecedent: str, rank: int) -> str:
    """The rank-``rank`` patch of ``cid`` behind ``antecedent``: an antecedent hash (this ordering's
    patch) or an ``orbit_key`` (the orbit patch of every ordering of those chunks)."""
    return EntryKey(cid, "patch", antecedent, rank).to_str()


def anchor_context(
    model_fingerprint: str,
    layout: str,
    anchor_ids: Sequence[int],
    *,
    tenant: str = "",
    cache_salt: str = "",
    lora: str = "",
) -> str:
    """The context a canonical ``KV(B | anchor)`` is keyed in: the antecedent hash of the anchor's
    chunk (of the empty context for a model without an anchor)."""
    if not anchor_ids:
        return EMPTY_ANTECEDENT
    cid = chunk_cid(
        model_fingerprint, layout, tenant, list(anchor_ids), cache_salt=cache_salt, lora=lora
    )
    return antecedent_hash([cid])


@dataclasses.dataclass(frozen=True, slots=True)
class RequestKeys:
    """The entry keys one request names for its chunks: conditioned entries exact or under its
    policy (``lineage``, "" for an exact request), canonicals in its ``canonical_context``
    (``anchor_context``), patches at ``patch_rank`` (0: it names none)."""

    lineage: str = ""
    canonical_context: str = ""
    patch_rank: int = 0

    def conditioned(self, cid: str, antecedent: str, *, is_inherited: bool = False) -> str:
        """The exact entry, or (``is_inherited``) the one computed under this request's policy."""
        return conditioned_key(cid, antecedent, self.lineage if is_inherited else "")

    def canonical(self, cid: str) -> str:
        return canonical_key(cid, self.canonical_context)

    def patch(self, cid: str, antecedent: str) -> str:
        return patch_key(cid, antecedent, self.patch_rank)

    def orbit_patch(self, cid: str, antecedent_cids: Sequence[str]) -> str:
        return patch_key(cid, orbit_key(antecedent_cids), self.patch_rank)
