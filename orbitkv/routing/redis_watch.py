"""Redis's own removals (``maxmemory`` evictions, TTL expiries) as tier events.

A replica learns of them through Redis keyspace notifications on its own key prefix only: it
subscribes to ``__keyspace@*__:<prefix>*`` (flags ``K``, ``e``, ``x``), whose channel names carry the
key and whose messages name the event. Redis ACLs grant channels by pattern, so a deployment's
user may be allowed exactly its prefix's channel (``deploy/docker-compose.yml``, redis-acl) and
never hears another tenant's key names; the ``__keyevent`` channels would carry every tenant's keys.
Every replica of a deployment receives every notification, and only the one that announced the
entry stored announces it gone (``TierEvents.on_shared_lost``): the shared tier stays announced
once. Single-node Redis only. The watcher adds the flags it needs where the server allows
``CONFIG SET``; where it does not (an ACL user, a managed Redis), the server must be started with
them (compose passes ``--notify-keyspace-events Kex``), or the removals stay unannounced (a router
then routes to a replica that misses, and the request recomputes: never a wrong answer).
"""

from __future__ import annotations

import logging
from typing import Any

import redis

logger = logging.getLogger(__name__)
REMOVAL_EVENTS = frozenset({"evicted", "expired"})
NEEDED_FLAGS = "Kex"
_CHANNEL_HEAD = "__keyspace@"


def channel_pattern(key_prefix: str) -> str:
    """The keyspace channels of the keys under ``key_prefix``, in every database (the prefix's own
    glob characters escaped)."""
    escaped = "".join("\\" + c if c in "*?[]\\" else c for c in key_prefix)
    return f"{_CHANNEL_HEAD}*__:{escaped}*"


class RedisRemovalWatcher:
    def __init__(self, url: str, key_prefix: str, events: Any, tier: str = "redis") -> None:
        self._prefix = key_prefix
        self._events = events
        self._tier = tier
        self._client = redis.Redis.from_url(url, socket_connect_timeout=1.0)
        self._ensure_flags()
        self._pubsub = self._client.pubsub(ignore_subscribe_messages=True)
        self._pubsub.psubscribe(**{channel_pattern(key_prefix): self._on_message})
        self._thread = self._pubsub.run_in_thread(sleep_time=0.2, daemon=True)

    def _ensure_flags(self) -> None:
        try:
            flags = self._client.config_get("notify-keyspace-events").get(
                "notify-keyspace-events", ""
            )
            if "A" in flags and "K" in flags:
                return
            missing = "".join(f for f in NEEDED_FLAGS if f not in flags)
            if missing:
                self._client.config_set("notify-keyspace-events", flags + missing)
        except redis.exceptions.NoPermissionError:
            logger.info("OrbitKV: this Redis user may not CONFIG the server: it must be started with "
                        "--notify-keyspace-events %s for Redis's own evictions to be announced",
                        NEEDED_FLAGS)
        except redis.RedisError as exc:
            logger.warning("OrbitKV: cannot enable Redis keyspace notifications (%s): Redis's own "
                           "evictions and expiries are not announced", exc)

    def _on_message(self, message: dict) -> None:
        event, channel = (_text(message.get("data")), _text(message.get("channel")))
        if event not in REMOVAL_EVENTS or not channel.startswith(_CHANNEL_HEAD):
            return
        _, _, key = channel.partition("__:")
        if key.startswith(self._prefix):
            self._events.on_shared_lost(self._tier, [key[len(self._prefix):]])

    def close(self) -> None:
        self._thread.stop()
        self._thread.join(timeout=2)
        self._pubsub.close()
        self._client.close()


def _text(value: object) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value if isinstance(value, str) else ""


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
