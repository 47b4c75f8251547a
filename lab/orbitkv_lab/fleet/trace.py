"""The fleet trace: agent sessions through the router, then half of them moved to the other replica.

1. **stick**: every session sends its first turns through the router with ``X-Session-ID``; each
   session must land on one replica every time (consistent_hash).
2. **move**: for the last turn, even-numbered sessions stay (through the router, so their replica's
   prefix cache serves the history) and odd-numbered ones are sent to the *other* replica (what the
   router does when the session's replica leaves the ring): that replica never saw the session, so
   its history can only come from the chunks the first replica wrote to Redis.
3. **check**: every measured last turn is repeated on the same replica with a fresh ``cache_salt``
   (no prefix cache hit, no OrbitKV hit: a full prefill); greedy outputs must be equal.

Figures: the cross-replica hit rate (moved turns' prompt tokens that OrbitKV loaded, over all their
prompt tokens, and over the prompt tokens of the turn before, which is what the first replica had
computed), and TTFT p50 of moved vs staying vs cold turns.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from typing import Any

from .sessions import Reply, Session, chat_body, percentile, send


def run_trace(
    router_url: str,
    replica_urls: Sequence[str],
    sessions: Sequence[Session],
    *,
    model: str = "model",
    max_tokens: int = 8,
    settle: Callable[[], None] | None = None,
    on_turn: Callable[[int], None] | None = None,
    quiet: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Run the trace; ``settle`` is called before the last turn (wait for Redis writes),
    ``on_turn(t)`` before each turn of phase 1 (fault injection), ``quiet`` before every request
    (wait until no replica is still busy with the last one: the replicas share the cores)."""
    num_turns = len(sessions[0].observations)
    home: dict[str, set[int | None]] = {s.session_id: set() for s in sessions}
    replies: list[dict[str, Any]] = []
    failed = 0
    history_tokens: dict[str, int] = {}

    def ask(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> Reply:
        if quiet is not None:
            quiet()
        return send(url, body, replica_urls, headers=headers)

    def record(kind: str, s: Session, turn: int, r: Reply) -> Reply:
        nonlocal failed
        failed += r.error is not None
        replies.append({"kind": kind, "session": s.session_id, "turn": turn, **r.to_json()})
        return r

    for turn in range(num_turns - 1):
        if on_turn is not None:
            on_turn(turn)
        for s in sessions:
            body = chat_body(model, s.messages(turn), max_tokens=max_tokens)
            r = record("stick", s, turn, ask(router_url, body, {"X-Session-ID": s.session_id}))
            home[s.session_id].add(r.replica)
            history_tokens[s.session_id] = r.prompt_tokens
    if settle is not None:
        settle()
    last = num_turns - 1
    stay: list[Reply] = []
    moved: list[Reply] = []
    cold: list[Reply] = []
    reusable_tokens = 0
    mismatches = []
    for i, s in enumerate(sessions):
        (replica,) = home[s.session_id] if len(home[s.session_id]) == 1 else (None,)
        body = chat_body(model, s.messages(last), max_tokens=max_tokens)
        if i % 2 == 0 or replica is None:
            r = record("stay", s, last, ask(router_url, body, {"X-Session-ID": s.session_id}))
            stay.append(r)
        else:
            target = (replica + 1) % len(replica_urls)
            r = record("moved", s, last, ask(replica_urls[target], body))
            moved.append(r)
            reusable_tokens += history_tokens[s.session_id]
        if r.replica is None:
            continue
        ref_body = chat_body(model, s.messages(last), max_tokens=max_tokens,
                             cache_salt=f"reference-{uuid.uuid4().hex}")
        ref = record("cold", s, last, ask(replica_urls[r.replica], ref_body))
        cold.append(ref)
        if ref.error is None and r.error is None and ref.text != r.text:
            mismatches.append({"session": s.session_id, "got": r.text, "want": ref.text})
    return {
        "replies": replies,
        "sessions_per_replica": _per_replica(home, len(replica_urls)),
        "is_sticky": all(len(h) == 1 and None not in h for h in home.values()),
        "num_failed_requests": failed,
        "num_output_mismatches": len(mismatches),
        "mismatches": mismatches,
        "summary": summarize(moved, stay, cold, reusable_tokens),
    }


def _per_replica(home: dict[str, set[int | None]], num_replicas: int) -> list[int]:
    counts = [0] * num_replicas
    for replicas in home.values():
        for r in replicas:
            if r is not None:
                counts[r] += 1
    return counts


def summarize(moved: Sequence[Reply], stay: Sequence[Reply], cold: Sequence[Reply],
              reusable_tokens: int) -> dict[str, Any]:
    def p50(replies: Sequence[Reply]) -> float | None:
        value = percentile([r.ttft_s for r in replies if r.error is None], 50)
        return None if value is None else round(value, 6)

    moved_prompt = sum(r.prompt_tokens for r in moved)
    moved_orbitkv = sum(r.orbitkv_tokens for r in moved)
    return {
        "num_moved": len(moved),
        "num_stay": len(stay),
        "moved_prompt_tokens": moved_prompt,
        "moved_orbitkv_tokens": moved_orbitkv,
        "moved_prefix_cache_tokens": sum(r.prefix_cache_tokens for r in moved),
        "cross_replica_hit_rate": round(moved_orbitkv / moved_prompt, 4) if moved_prompt else None,
        # Of what the first replica had computed (the turn before's prompt), the share served.
        "cross_replica_hit_rate_of_history": round(moved_orbitkv / reusable_tokens, 4) if reusable_tokens else None,
        "stay_reused_tokens": sum(r.prefix_cache_tokens + r.orbitkv_tokens for r in stay),
        "stay_prompt_tokens": sum(r.prompt_tokens for r in stay),
        "ttft_p50_moved_s": p50(moved),
        "ttft_p50_stay_s": p50(stay),
        "ttft_p50_cold_s": p50(cold),
    }
