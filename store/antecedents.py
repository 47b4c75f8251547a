"""The per-CID antecedent index: which antecedent lists a CID has conditioned entries for.

The survivor reuse mode needs, for a chunk B, every stored ``KV(B | A)`` whose antecedent ``A``
becomes the current one once some chunks are dropped. Under ``keys.index_key(cid)`` each tier keeps
the set of antecedent lists (each a tuple of CIDs), oldest first, capped at ``max_len`` so the index
stays small; adding an antecedent already there makes it the newest. It is a hint: an entry it names
may since have been evicted, and a lookup of it is then a miss.

Adding is atomic in every tier, so concurrent writers never lose each other's additions:
- memory: a JSON list (``encode_index``) updated under the backend's lock (``Backend.batch_index_add``);
- disk: the same JSON file, read-modify-written under an ``flock`` shared by every process using the
  directory, and replaced atomically (tmp + rename), so readers need no lock;
- Redis: a sorted set per CID (member: the comma-joined CIDs, score: the writer's clock in µs), added
  to with ZADD and trimmed with ZREMRANGEBYRANK, each atomic on the server, so writers on several
  nodes never read-modify-write a blob. (Clock skew between nodes only changes which of the oldest
  antecedents the cap drops.)
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from .keys import is_cid

Antecedent = tuple[str, ...]


def decode_index(value: bytes | bytearray | memoryview) -> list[Antecedent]:
    """Parse an index value; raises ``ValueError`` on anything malformed."""
    data = json.loads(bytes(value))
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
    return list(merged)[-max_len:] if max_len > 0 else []


def add_to_value(current: bytes | bytearray | memoryview | None, added: Iterable[Antecedent], max_len: int) -> bytes:
    """The JSON index value with ``added`` merged in; a corrupt value is rebuilt from the additions."""
    try:
        old = decode_index(current) if current is not None else []
    except ValueError:
        old = []
    return encode_index(merge_index(old, added, max_len))


def member(antecedent: Antecedent) -> str:
    """One antecedent as a Redis set member: CIDs joined by commas (fixed width, no commas inside)."""
    return ",".join(antecedent)


def parse_member(value: bytes | str) -> Antecedent:
    text = value.decode("ascii") if isinstance(value, bytes) else value
    antecedent = tuple(text.split(",")) if text else ()
    if not all(is_cid(c) for c in antecedent):
        raise ValueError("antecedent index holds a bad antecedent")
    return antecedent
