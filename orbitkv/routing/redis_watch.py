"""Redis's own removals (``maxmemory`` evictions, TTL expiries) as tier events.

A replica learns of them through Redis keyspace notifications (``evicted`` and ``expired`` key
events; the watcher adds the ``E``, ``e`` and ``x`` flags to ``notify-keyspace-events``, keeping
the server's others). Every replica receives every notification, and only the one that announced
the entry stored announces it gone (``TierEvents.on_shared_lost``): the shared tier stays announced
once. Single-node Redis only; where the server refuses ``CONFIG SET`` (a managed Redis), set the
flags there, or the removals stay unannounced (a router then routes to a replica that misses, and
the request recomputes: never a wrong answer).
"""

from __future__ import annotations

import logging
from typing import Any

import redis

logger = logging.getLogger(__name__)
EVENT_CHANNELS = ("__keyevent@*__:evicted", "__keyevent@*__:expired")
NEEDED_FLAGS = "Eex"


class RedisRemovalWatcher:
    def __init__(self, url: str, key_prefix: str, events: Any, tier: str = "redis") -> None:
        self._prefix = key_prefix
        self._events = events
        self._tier = tier
        self._client = redis.Redis.from_url(url, socket_connect_timeout=1.0)
        self._ensure_flags()
        self._pubsub = self._client.pubsub(ignore_subscribe_messages=True)
        self._pubsub.psubscribe(**{ch: self._on_message for ch in EVENT_CHANNELS})
        self._thread = self._pubsub.run_in_thread(sleep_time=0.2, daemon=True)

    def _ensure_flags(self) -> None:
        try:
            flags = self._client.config_get("notify-keyspace-events").get(
                "notify-keyspace-events", ""
            )
            if "A" in flags and "E" in flags:
                return
            missing = "".join(f for f in NEEDED_FLAGS if f not in flags)
            if missing:
                self._client.config_set("notify-keyspace-events", flags + missing)
        except redis.RedisError as exc:
            logger.warning("OrbitKV: cannot enable Redis keyspace notifications (%s): Redis's own "
                           "evictions and expiries are not announced", exc)

    def _on_message(self, message: dict) -> None:
        key = message.get("data")
        if isinstance(key, bytes):
            key = key.decode("utf-8", "replace")
        if isinstance(key, str) and key.startswith(self._prefix):
            self._events.on_shared_lost(self._tier, [key[len(self._prefix):]])

    def close(self) -> None:
        self._thread.stop()
        self._thread.join(timeout=2)
        self._pubsub.close()
        self._client.close()


def start(store: Any, events: Any) -> RedisRemovalWatcher | None:
    """A watcher on the store's single-node Redis tier, if it has one (None otherwise or on
    failure: the rest of the events still flow)."""
    for tier in store.tiers:
        if tier.name == "redis" and not getattr(tier, "is_cluster", True):
            try:
                return RedisRemovalWatcher(tier.url, tier.key_prefix, events, tier.name)
            except redis.RedisError as exc:
                logger.warning("OrbitKV: no Redis eviction events (%s)", exc)
    return None
