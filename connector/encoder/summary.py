"""Per-request encoder counts, shared with the KV connector's per-request summary.

vLLM's scheduler finishes a request by asking the KV connector first (its summary becomes the
response's ``kv_transfer_params["orbitkv"]``), then the encoder connector. Both scheduler-side
connectors live in the scheduler's process, so the encoder half records here, per request, how
many encoder outputs it loaded and how many the encoder computed; the KV connector adds them to
its summary (``annotate``) and the encoder half forgets the request when vLLM finishes it there.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

LOADED = "num_loaded_encoder_items"
COMPUTED = "num_computed_encoder_items"

_lock = threading.Lock()
_counts: dict[str, Counter[str]] = {}


def record(req_id: str, *, is_loaded: bool) -> None:
    with _lock:
        _counts.setdefault(req_id, Counter())[LOADED if is_loaded else COMPUTED] += 1


def counts(req_id: str) -> dict[str, int]:
    with _lock:
        found = _counts.get(req_id, Counter())
        return {LOADED: found[LOADED], COMPUTED: found[COMPUTED]}


def forget(req_id: str) -> dict[str, int]:
    """The request's counts, dropped from the ledger."""
    out = counts(req_id)
    with _lock:
        _counts.pop(req_id, None)
    return out


def annotate(params: dict[str, Any] | None, req_id: str) -> dict[str, Any] | None:
    """The KV connector's finished-request params with the encoder counts added to its summary.

    ``num_loaded_encoder_items``: outputs loaded from the store (0 without the encoder
    connector); the summary's ``num_encoded_items`` already counts the encoder's runs."""
    if params is None or not isinstance(params.get("orbitkv"), dict):
        return params
    params["orbitkv"][LOADED] = counts(req_id)[LOADED]
    return params


def num_tracked_requests() -> int:
    with _lock:
        return len(_counts)
