"""Signed entries in a shared tier: a keyed BLAKE3 tag per value, so a forged or foreign one is a miss.

Entries carry checksums (xxh3), which catch corruption but not an adversary: anyone who can write
to a shared Redis can write an entry whose checksums hold, and every replica would serve it as
exact. With a deployment secret (``entry_signing_key_file``) every value written to Redis ends in
a trailer, ``MAGIC`` + a 32-byte keyed BLAKE3 tag (BLAKE3's MAC mode, key derived from the
secret) over the store key and the entry's bytes. BLAKE3 on several threads for large entries:
the tag is checked on every Redis read, and a chunk is tens of MiB. The key is in the tag, so a signed entry copied under another key is refused too.

A value read back is served only when its trailer is there and its tag matches: an unsigned value
(written before signing was turned on, or by a deployment without the key), a truncated one and a
forged one are misses. They are not deleted: a value nobody can authenticate is not this
deployment's to remove (another deployment sharing the keys may own it), and it ages out by its
TTL. The tag covers every byte, so a reader verifies the whole value it fetched; the local tiers
(memory, disk) hold what was verified, unsigned, as before.

``SignedBackend`` wraps the Redis tier with the batched interface of every backend.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterator, Sequence

from . import antecedents
from .base import Backend

MAGIC = b"OKVSIG1\0"
TAG_NBYTES = 32
TRAILER_NBYTES = len(MAGIC) + TAG_NBYTES
_KEY_CONTEXT = "orbitkv 2026 entry signing key v1"
# Values at least this large are hashed on several threads (BLAKE3's advice: only big inputs gain).
_THREADED_NBYTES = 1 << 20


class Signer:
    """Signs and verifies values with one deployment secret."""

    def __init__(self, secret: bytes) -> None:
        if len(secret) < 16:
            raise ValueError("an entry signing key must be at least 16 bytes")
        from blake3 import blake3

        # BLAKE3's keyed mode takes a 32-byte key: derive one from a secret of any length.
        self._key = blake3(secret, derive_key_context=_KEY_CONTEXT).digest()

    def tag(self, name: str, data: bytes | memoryview) -> bytes:
        from blake3 import blake3

        is_large = memoryview(data).nbytes >= _THREADED_NBYTES
        h = blake3(key=self._key, max_threads=blake3.AUTO if is_large else 1)
        encoded = name.encode("utf-8")
        h.update(len(encoded).to_bytes(8, "little"))
        h.update(encoded)
        h.update(data)
        return h.digest(TAG_NBYTES)

    def sign(self, name: str, data: bytes | memoryview) -> bytes:
        return b"".join([data, MAGIC, self.tag(name, data)])

    def open(self, name: str, value: bytes | memoryview) -> memoryview | None:
        """The entry's bytes (a view of ``value``) if ``value`` carries a valid tag, else None."""
        view = memoryview(value)
        if view.nbytes < TRAILER_NBYTES or view[-TRAILER_NBYTES:-TAG_NBYTES] != MAGIC:
            return None
        data = view[:-TRAILER_NBYTES]
        if not hmac.compare_digest(bytes(view[-TAG_NBYTES:]), self.tag(name, data)):
            return None
        return data


class SignedBackend(Backend):
    """A tier whose values are signed on write and verified on read; an unverified value is a
    miss (counted as ``unverified``), never deleted."""

    # batch_get's values are read-only views of bytes fetched for this call alone.
    is_private_buffers = True

    def __init__(self, inner: Backend, secret: bytes) -> None:
        super().__init__()
        self.inner = inner
        self.name = inner.name
        self.counters = inner.counters
        self.counters.add("unverified", 0)
        self._signer = Signer(secret)

    # The inner tier announces what it stores and drops (routing/tier_events.py): a listener set on
    # this wrapper is the inner tier's.
    @property
    def listener(self):
        return self.inner.listener

    @listener.setter
    def listener(self, fn) -> None:
        self.inner.listener = fn

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        return self.inner.batch_exists(keys)

    def batch_get(self, keys: Sequence[str]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for key, value in zip(keys, self.inner.batch_get(keys), strict=True):
            data = None if value is None else self._signer.open(key, value)
            if value is not None and data is None:
                self.counters.add("unverified")
            out.append(data)  # a view of the fetched bytes: immutable, as bytes
        return out

    def batch_put(self, items: Sequence[tuple[str, bytes]]) -> None:
        self.inner.batch_put([(key, self._signer.sign(key, value)) for key, value in items])

    def batch_delete(self, keys: Sequence[str]) -> None:
        self.inner.batch_delete(keys)

    def batch_touch(self, keys: Sequence[str]) -> list[bool]:
        return self.inner.batch_touch(keys)

    def iter_keys(self) -> Iterator[str]:
        return self.inner.iter_keys()

    def batch_index_add(self, items: Sequence[tuple[str, antecedents.Antecedent]], max_len: int) -> None:
        # The survivor index only proposes candidates; each is still read and verified.
        self.inner.batch_index_add(items, max_len)

    def batch_index_get(self, keys: Sequence[str]) -> list[list[antecedents.Antecedent] | None]:
        return self.inner.batch_index_get(keys)

    def stats(self) -> dict[str, float]:
        return self.inner.stats()

    def close(self) -> None:
        self.inner.close()

    def __getattr__(self, name: str):
        # Tier-specific attributes (the Redis breaker's state, its key prefix) stay readable; no
        # other way to read values (an inner batch_get_buffers, get_view) may skip the check.
        if name.startswith(("batch_", "get_")):
            raise AttributeError(name)
        return getattr(self.__dict__["inner"], name)
