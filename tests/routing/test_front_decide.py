"""The routing front's decision: holdings against the work already queued on each replica, with
rankings from a real scorer fed by a real store's tier events over vLLM's wire format."""

from __future__ import annotations

import threading

import pytest
from events_testlib import BS, canonical_key, cid_of, entry, wire
from orbitkv.store.tiered import TieredStore

from orbitkv.routing.front import InFlight, RoutingFront, decide
from orbitkv.routing.scorer import ChunkSetScorer
from orbitkv.routing.tier_events import TierEvents

X = list(range(1000, 1040))  # 40 tokens, held by replica "a" in memory
Q = list(range(5000, 5008))  # the question: held nowhere


@pytest.fixture()
def ranking():
    scorer = ChunkSetScorer(BS)
    store = TieredStore(memory_nbytes=1 << 20)
    events = TierEvents(BS)
    events.attach(store)
    try:
        events.describe_chunk(cid_of(X), X)
        store.put_many([(canonical_key(cid_of(X)), entry("canonical", len(X)))])
        store.flush()
        scorer.apply_batch("a", wire(events.take()))
        yield scorer.score_tokens(["a", "b"], X + Q)
    finally:
        events.detach(store)
        store.close()


def test_an_idle_fleet_goes_by_holdings(ranking):
    assert ranking[0].replica == "a" and ranking[0].score > 0 and ranking[1].score == 0
    assert decide(ranking, len(X + Q), {}, load_weight=1.0) == ("a", "scored")
    assert decide(ranking, len(X + Q), {"b": 10_000}, load_weight=1.0) == ("a", "scored")


def test_a_busy_holder_loses_to_an_idle_replica_by_the_work_queued_ahead(ranking):
    saved = ranking[0].score  # the tokens "a"'s memory tier saves this prompt, tier-weighted
    n = len(X + Q)
    # Queued work on "a" below what it saves: "a" still; above: "b"; equal: a tie, the router.
    assert decide(ranking, n, {"a": int(saved) - 1}, load_weight=1.0) == ("a", "scored")
    assert decide(ranking, n, {"a": int(saved) + 1}, load_weight=1.0) == ("b", "scored")
    assert decide(ranking, n, {"a": 2 * int(saved) + 2}, load_weight=0.5) == ("b", "scored")
    assert decide(ranking, n, {"a": saved}, load_weight=1.0) == (None, "tie")
    # Load alone never routes: with nothing held anywhere the router's default policy decides.
    nothing = [type(s)(s.replica, 0.0, {}) for s in ranking]
    assert decide(nothing, n, {"a": 100}, load_weight=1.0) == (None, "no_holdings")
    assert decide(ranking, n, {"a": 10_000}, load_weight=0.0) == ("a", "scored")


def test_in_flight_tokens_add_up_across_threads_and_return_to_zero():
    flight = InFlight()
    threads = [threading.Thread(target=lambda: [flight.begin("a", 3) or flight.end("a", 3)
                                                for _ in range(500)]) for _ in range(4)]
    flight.begin("b", 7)
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert flight.snapshot() == {"b": 7}
    flight.end("b", 7)
    assert flight.snapshot() == {}


def test_a_negative_load_weight_is_refused():
    with pytest.raises(ValueError, match="load_weight"):
        RoutingFront(ChunkSetScorer(BS), ["a"], "http://router", "chunk_set", load_weight=-1)
