"""What a tiered store is made of and what it holds to: its tiers built from ``StoreSettings``, the
check that a key agrees with the entry put under it, and which entries the survivor index lists."""

from __future__ import annotations

from .base import Backend
from .disk import DiskBackend
from .entry_format import Entry, EntryMeta
from .keys import CID_ONLY_KINDS, EntryKey, antecedent_hash
from .memory import MemoryBackend
from .redis_backend import RedisBackend
from .settings import StoreSettings
from .signing import SignedBackend

AnyKey = EntryKey | str


def check_key_matches(key: AnyKey, entry: Entry) -> None:
    """A key that disagrees with its entry would serve wrong KV later (an approximate entry under
    an exact key above all): refuse it now. Keys that are not OrbitKV's are not checked."""
    if isinstance(key, str):
        try:
            key = EntryKey.parse(key)
        except ValueError:
            return
    meta = entry.meta
    if key.kind != meta.kind:
        raise ValueError(f"key kind {key.kind!r} but entry kind {meta.kind!r}")
    if key.kind not in CID_ONLY_KINDS and key.antecedent != meta.antecedent_hash:
        raise ValueError("key antecedent does not match the entry's antecedent hash")
    if key.lineage != meta.lineage:
        raise ValueError(f"key lineage {key.lineage!r} but entry lineage {meta.lineage!r}")
    if key.kind == "patch" and key.rank != meta.rank:
        raise ValueError(f"key rank {key.rank} but entry rank {meta.rank}")


def build_tiers(s: StoreSettings) -> list[Backend]:
    tiers: list[Backend] = []
    if s.is_memory:
        tiers.append(MemoryBackend(s.memory_nbytes))
    if s.disk_dir:
        tiers.append(DiskBackend(s.disk_dir, s.disk_nbytes, is_fsync=s.is_disk_fsync))
    if s.redis_url:
        redis_tier: Backend = RedisBackend(
            s.redis_url,
            ttl_s=s.redis_ttl_s,
            socket_timeout_s=s.redis_socket_timeout_s,
            lookup_timeout_s=s.redis_lookup_timeout_s,
            connect_timeout_s=s.redis_connect_timeout_s,
            backoff_s=s.redis_backoff_s,
            max_backoff_s=s.redis_max_backoff_s,
            max_connections=s.redis_max_connections,
            key_prefix=s.redis_key_prefix,
            min_nbytes_per_s=s.redis_min_nbytes_per_s,
        )
        # A shared tier: with a deployment secret, what others wrote there is a miss.
        tiers.append(redis_tier if s.signing_key is None else SignedBackend(redis_tier, s.signing_key))
    return tiers


def is_indexed(meta: EntryMeta) -> bool:
    """An entry whose antecedent the survivor index lists: a conditioned entry, or a patch for
    its own ordering (it may stand in for one: ``patch_replaces_conditioned``), not an orbit's."""
    if meta.kind == "conditioned":
        return True
    return meta.kind == "patch" and meta.antecedent_hash == antecedent_hash(tuple(meta.antecedent))
