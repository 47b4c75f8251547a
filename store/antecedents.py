"""The per-CID antecedent index: which antecedent lists a CID has conditioned entries for.

The survivor reuse mode needs, for a chunk B, every stored ``KV(B | A)`` whose antecedent ``A``
becomes the current one once some chunks are dropped. The value under ``keys.index_key(cid)`` is a
JSON list of antecedent lists (each a list of CIDs), oldest first, capped so the index stays small.
It is a hint: an entry it names may since have been evicted, and a lookup of it is then a miss.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from .keys import is_cid

Antecedent = tuple[str, ...]


def decode_index(value: bytes) -> list[Antecedent]:
    """Parse an index value; raises ``ValueError`` on anything malformed."""
    data = json.loads(value)
    if not isinstance(data, list):
        raise ValueError("antecedent index is not a list")
    out = []
    for item in data:
        if not isinstance(item, list) or not all(is_cid(c) for c in item):
            raise ValueError("antecedent index holds a bad antecedent")
        out.append(tuple(item))
    return out


def encode_index(antecedents: Iterable[Antecedent]) -> bytes:
    return json.dumps([list(a) for a in antecedents], separators=(",", ":")).encode()


def merge_index(
    current: Iterable[Antecedent], added: Iterable[Antecedent], max_len: int
) -> list[Antecedent]:
    """Union keeping first-seen order, newest additions last; the oldest are dropped past max_len."""
    merged = {a: None for a in current}
    for a in added:
        merged.pop(a, None)
        merged[a] = None
    return list(merged)[-max_len:]


def merger(added: Antecedent, max_len: int):
    """A read-modify-write step for ``WriteBehind``: add one antecedent to whatever is stored."""

    def merge(current: bytes | None) -> bytes:
        try:
            old = decode_index(current) if current is not None else []
        except ValueError:
            old = []  # a corrupt index is rebuilt from new writes rather than kept
        return encode_index(merge_index(old, [added], max_len))

    return merge
