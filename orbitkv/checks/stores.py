"""A live server's disk store, seen from a check: wait until the saves a request queued landed."""

from __future__ import annotations

import time
from typing import Any


def settle(disk: Any, before: set[str], min_new: int, timeout_s: float = 120.0) -> set[str]:
    """The store's keys once at least ``min_new`` appeared and none for a second (saves are
    written behind the request)."""
    deadline = time.monotonic() + timeout_s
    last, changed = None, time.monotonic()
    while True:
        keys = set(disk.iter_keys())
        now = time.monotonic()
        if keys != last:
            last, changed = keys, now
        elif len(keys - before) >= min_new and now - changed >= 1.0:
            return keys
        if now > deadline:
            raise TimeoutError(f"{len(keys - before)} new store entries after {timeout_s:.0f}s, "
                               f"expected at least {min_new}")
        time.sleep(0.2)
