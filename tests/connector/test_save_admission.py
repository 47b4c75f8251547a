"""The save admission policy (``save_admission``): what a computed chunk must show before it is
saved, in vLLM's own scheduler with OrbitKV's half (``scheduler_testlib.py``), and the policy alone."""

from __future__ import annotations

import pytest
from orbitkv.connector.scheduler.save_admission import SaveAdmission
from orbitkv.store.keys import conditioned_key
from scheduler_testlib import SchedulerRig


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from orbitkv.models.make_model import make_model

    return make_model(tmp_path_factory.mktemp("model") / "qwen2", "qwen2")


def _tokens(seed: int, n: int) -> list[int]:
    return [10 + (seed * 53 + 7 * i) % 900 for i in range(n)]


def _run(
    rig: SchedulerRig, req_id: str, prompt: list[int], params: dict | None = None
) -> list[str]:
    """Run one request to its end; the conditioned keys its steps asked the worker to save."""
    rig.add(req_id, prompt, params=params)
    saved = []
    for _ in range(50):
        if not rig.scheduler.has_requests():
            return saved
        out = rig.step()
        meta = out.kv_connector_metadata
        saved += [s.keys["conditioned"] for s in meta.saves if "conditioned" in s.keys]
    raise AssertionError("request unfinished")


def test_recurring_saves_a_chunk_once_it_is_computed_again(model_dir):
    rig = SchedulerRig(model_dir, extra_config={"save_admission": "recurring", "save_canonical": False})
    try:
        prompt = _tokens(1, 4 * 16 + 5)
        assert _run(rig, "first", prompt) == []
        first = rig.summary("first")
        assert first["num_saved_chunks"] == 0 and first["num_declined_saves"] == 5
        keys = [conditioned_key(c.cid, c.antecedent_hash) for c in rig.chunks(prompt)]
        # vLLM's prefix cache holds the prompt's full blocks: only the last chunk (in a partial
        # block) is computed again, and only it is saved.
        assert _run(rig, "cached", prompt) == keys[-1:]
        # Once vLLM lost the rest, the same chunks computed again are what a copy pays for (no
        # worker runs here: the tail's save above stored nothing, so it is asked for again).
        assert rig.scheduler.reset_prefix_cache()
        assert sorted(_run(rig, "again", prompt)) == sorted(keys)
        assert rig.summary("again")["num_declined_saves"] == 0
    finally:
        rig.close()


def test_all_saves_every_computed_chunk_on_first_sight(model_dir):
    rig = SchedulerRig(model_dir, extra_config={"save_admission": "all", "save_canonical": False})
    try:
        prompt = _tokens(2, 3 * 16 + 1)
        assert len(_run(rig, "first", prompt)) == len(rig.chunks(prompt))
    finally:
        rig.close()


def test_a_session_coming_back_saves_its_new_turn_but_not_its_question(model_dir):
    """A prompt that extends an earlier one vLLM no longer holds: the chunks seen before are saved,
    and so are the new ones after them (the lineage recurs), except the prompt's last chunk."""
    rig = SchedulerRig(model_dir, extra_config={"save_admission": "recurring", "save_canonical": False})
    try:
        turn1 = _tokens(3, 4 * 16)
        assert _run(rig, "t1", turn1 + _tokens(4, 16)) == []
        assert rig.scheduler.reset_prefix_cache()
        turn2 = turn1 + _tokens(5, 2 * 16) + _tokens(6, 16)
        keys = [conditioned_key(c.cid, c.antecedent_hash) for c in rig.chunks(turn2)]
        assert len(keys) == 7
        assert sorted(_run(rig, "t2", turn2)) == sorted(keys[:6])
        assert rig.summary("t2")["num_declined_saves"] == 1
    finally:
        rig.close()


def test_a_partial_block_served_past_vllms_hit_is_not_a_recurring_lineage(model_dir):
    """A prompt whose 4 blocks vLLM holds, then a 5-token item OrbitKV serves (the partial block
    vLLM's prefix cache never holds: a chat template's turn marker before fresh content on every
    request), then fresh text: the fresh chunks are not saved, as on a request OrbitKV served
    nothing for. Served chunks reaching a whole block past the hit still are a lineage vLLM lost
    (the test above), short ones included."""
    rig = SchedulerRig(model_dir, extra_config={"save_admission": "recurring", "save_canonical": False})
    try:
        head, marker = _tokens(7, 4 * 16), _tokens(8, 5)
        fresh, question = _tokens(9, 2 * 16), _tokens(10, 16)
        prompt = head + marker + fresh + question
        params = {"orbitkv": {"chunk_boundaries": [64, 69, 85, 101]}}
        _run(rig, "warm", head + _tokens(11, 16))  # vLLM's prefix cache now holds head's blocks
        chunks = rig.chunks(prompt, params=params)
        (served,) = [c.index for c in chunks if (c.start, c.end) == (64, 69)]
        rig.store_chunks(prompt, [served], params=params)
        rig.add("new", prompt, params=params)
        saved = []
        while rig.scheduler.has_requests():
            meta = rig.step().kv_connector_metadata
            saved += [s.keys["conditioned"] for s in meta.saves if "conditioned" in s.keys]
        summary = rig.summary("new")
        assert summary["reused_tokens_by_mode"] == {"exact": 5}
        assert saved == [] and summary["num_declined_saves"] == 3
    finally:
        rig.close()


def test_a_partial_block_computed_again_past_vllms_hit_is_not_a_recurring_lineage(model_dir):
    """The same as above without a store: the 5-token marker after vLLM's hit was computed before
    behind the same text (seen), as on every request of an agent's trace, and is computed again.
    It is saved (it recurs), the fresh chunks behind it are not: a chunk seen again is a lineage
    vLLM lost only where it reaches a whole block past vLLM's hit (the session test above)."""
    rig = SchedulerRig(model_dir, extra_config={"save_admission": "recurring", "save_canonical": False})
    try:
        head, marker = _tokens(15, 4 * 16), _tokens(16, 5)
        fresh, question = _tokens(17, 2 * 16), _tokens(18, 16)
        warm = head + marker + _tokens(19, 16)
        assert _run(rig, "warm", warm, {"orbitkv": {"chunk_boundaries": [64, 69]}}) == []
        params = {"orbitkv": {"chunk_boundaries": [64, 69, 101]}}
        prompt = head + marker + fresh + question
        chunks = rig.chunks(prompt, params=params)
        (mark,) = [c for c in chunks if (c.start, c.end) == (64, 69)]
        assert _run(rig, "new", prompt, params) == [conditioned_key(mark.cid, mark.antecedent_hash)]
        summary = rig.summary("new")
        assert summary["num_prefix_cache_tokens"] == 64
        assert summary["num_declined_saves"] == len(chunks) - 5  # fresh text, question
    finally:
        rig.close()


def test_short_chunks_served_over_a_whole_block_past_vllms_hit_are_a_recurring_lineage(model_dir):
    """A session's history in 8-token items (shorter than vLLM's 16-token blocks), stored, vLLM's
    prefix cache emptied: OrbitKV serves them, so the new items after them are saved; the
    question is not."""
    rig = SchedulerRig(model_dir, extra_config={"save_admission": "recurring", "save_canonical": False})
    try:
        history, new, question = _tokens(12, 4 * 16), _tokens(13, 2 * 16), _tokens(14, 16)
        prompt = history + new + question
        params = {"orbitkv": {"chunk_boundaries": [*range(8, 64, 8), 64, 80, 96]}}
        chunks = rig.chunks(prompt, params=params)
        served = [c.index for c in chunks if c.end <= 64]
        assert all(c.length == 8 for c in chunks if c.index in served)
        rig.store_chunks(prompt, served, params=params)
        assert rig.scheduler.reset_prefix_cache()
        rig.add("back", prompt, params=params)
        saved = []
        while rig.scheduler.has_requests():
            meta = rig.step().kv_connector_metadata
            saved += [s.keys["conditioned"] for s in meta.saves if "conditioned" in s.keys]
        assert rig.summary("back")["reused_tokens_by_mode"] == {"exact": 64}
        fresh = [conditioned_key(c.cid, c.antecedent_hash) for c in chunks if c.start >= 64]
        assert sorted(saved) == sorted(fresh[:-1])  # the new items, not the question
    finally:
        rig.close()


def test_the_policy_remembers_a_bounded_number_of_keys():
    policy = SaveAdmission("recurring", max_keys=2)
    assert not policy.remember("k1") and policy.remember("k1")
    policy.remember("k2")
    policy.remember("k3")  # k1 forgotten: at most 2 keys remembered
    assert not policy.remember("k1")
    assert policy.admit(True) and not policy.admit(False) and policy.admit(True)
    assert policy.take_counts() == (2, 1) and policy.take_counts() == (0, 0)
    assert SaveAdmission("all", max_keys=1).admit(False)
    with pytest.raises(ValueError, match="save_admission"):
        SaveAdmission("often", max_keys=1)
