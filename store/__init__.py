"""OrbitKV store: content-addressed, tiered (memory -> disk -> Redis) KV chunk store."""

from .base import Backend
from .entry import CorruptEntry, Entry, EntryMeta, EntryReader, decode, encode, make_entry
from .keys import EntryKey, antecedent_hash, chunk_cid, orbit_key
from .settings import StoreSettings
from .tiered import TieredStore

__all__ = [
    "Backend",
    "CorruptEntry",
    "Entry",
    "EntryKey",
    "EntryMeta",
    "EntryReader",
    "StoreSettings",
    "TieredStore",
    "antecedent_hash",
    "chunk_cid",
    "decode",
    "encode",
    "make_entry",
    "orbit_key",
]
