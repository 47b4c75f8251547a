"""Plain settings of the tiered store, and their mapping from ``OrbitKVConfig``.

``StoreSettings`` is what ``TieredStore`` is built from; ``StoreSettings.from_config`` reads an
``OrbitKVConfig`` by attribute name (``CONFIG_ATTRIBUTES``), so this module does not import the
config module and a missing optional attribute falls back to the default here.
"""

from __future__ import annotations

import dataclasses
from typing import Any
from urllib.parse import unquote, urlsplit

GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class StoreSettings:
    is_memory: bool = True
    memory_nbytes: int = 5 * GIB
    disk_dir: str | None = None
    disk_nbytes: int = 0
    is_disk_fsync: bool = False
    redis_url: str | None = None
    redis_ttl_s: float | None = None
    redis_socket_timeout_s: float = 1.0
    redis_lookup_timeout_s: float = 0.1
    redis_connect_timeout_s: float = 0.5
    redis_backoff_s: float = 0.5
    redis_max_backoff_s: float = 5.0
    redis_max_connections: int = 32
    redis_key_prefix: str = ""
    # The deployment's secret: Redis entries are signed and checked with it (store/signing.py).
    signing_key: bytes | None = dataclasses.field(default=None, repr=False)
    num_writer_threads: int = 2
    write_queue_depth: int = 1024
    write_queue_max_nbytes: int | None = 256 << 20
    redis_min_nbytes_per_s: float = float(25 << 20)
    max_write_batch: int = 16
    max_antecedents_per_cid: int = 32
    refresh_interval_s: float = 30.0

    @classmethod
    def from_config(cls, cfg: Any) -> StoreSettings:
        """Read an ``OrbitKVConfig`` (LMCache keys + ``orbitkv`` keys); see ``CONFIG_ATTRIBUTES``."""
        policy = str(_get(cfg, "cache_policy", "LRU")).upper()
        if policy != "LRU":
            raise ValueError(f"cache_policy {policy!r} is not supported by the OrbitKV store (LRU only)")
        default = cls()
        return cls(
            is_memory=bool(_get(cfg, "local_cpu", True)),
            memory_nbytes=_gb(_get(cfg, "max_local_cpu_size", 5.0)),
            disk_dir=disk_path(_get(cfg, "local_disk", None)),
            disk_nbytes=_gb(_get(cfg, "max_local_disk_size", 0.0)),
            is_disk_fsync=bool(_get(cfg, "disk_fsync", default.is_disk_fsync)),
            redis_url=_get(cfg, "remote_url", None) or None,
            redis_ttl_s=_get(cfg, "remote_ttl_s", default.redis_ttl_s),  # 0: no TTL
            redis_socket_timeout_s=float(_get(cfg, "remote_timeout_s", default.redis_socket_timeout_s)),
            redis_lookup_timeout_s=float(
                _get(cfg, "remote_lookup_timeout_s", default.redis_lookup_timeout_s)
            ),
            redis_connect_timeout_s=float(
                _get(cfg, "remote_connect_timeout_s", default.redis_connect_timeout_s)
            ),
            redis_backoff_s=float(_get(cfg, "remote_backoff_s", default.redis_backoff_s)),
            # The config's derived prefix (with the tenant) where it has one.
            redis_key_prefix=str(
                _get(cfg, "redis_key_prefix", None)
                or _get(cfg, "remote_key_prefix", default.redis_key_prefix)
            ),
            signing_key=_get(cfg, "entry_signing_key", None),
            num_writer_threads=int(_get(cfg, "disk_writer_threads", default.num_writer_threads)),
            write_queue_depth=int(_get(cfg, "write_queue_depth", default.write_queue_depth)),
            write_queue_max_nbytes=int(
                _get(cfg, "write_queue_max_nbytes", default.write_queue_max_nbytes)
            ),
            redis_min_nbytes_per_s=float(
                _get(cfg, "remote_min_nbytes_per_s", default.redis_min_nbytes_per_s)
            ),
            max_antecedents_per_cid=int(
                _get(cfg, "store_max_antecedents", default.max_antecedents_per_cid)
            ),
            refresh_interval_s=float(
                _get(cfg, "tier_refresh_interval_s", default.refresh_interval_s)
            ),
        )


# Attribute names from_config reads (LMCache's first, then OrbitKV's own).
CONFIG_ATTRIBUTES = (
    "local_cpu",
    "max_local_cpu_size",
    "local_disk",
    "max_local_disk_size",
    "remote_url",
    "cache_policy",
    "disk_fsync",
    "remote_ttl_s",
    "remote_timeout_s",
    "remote_lookup_timeout_s",
    "remote_connect_timeout_s",
    "remote_backoff_s",
    "remote_key_prefix",
    "redis_key_prefix",
    "entry_signing_key",
    "disk_writer_threads",
    "write_queue_depth",
    "write_queue_max_nbytes",
    "remote_min_nbytes_per_s",
    "store_max_antecedents",
    "tier_refresh_interval_s",
)


def _get(cfg: Any, name: str, default: Any) -> Any:
    # A config may nest OrbitKV's own keys under ``orbitkv`` or prefix them; accept both spellings.
    for candidate in (name, f"orbitkv_{name}"):
        value = getattr(cfg, candidate, None)
        if value is not None:
            return value
    return default


def _gb(value: Any) -> int:
    return int(float(value) * GIB)


def disk_path(local_disk: str | None) -> str | None:
    """LMCache's ``local_disk`` (``file:///abs/dir`` or a plain path) as a directory path."""
    if not local_disk:
        return None
    parts = urlsplit(local_disk)
    if parts.scheme == "file":
        return unquote(parts.path)
    if parts.scheme:
        raise ValueError(f"local_disk must be a file:// url or a path, got {local_disk!r}")
    return local_disk
