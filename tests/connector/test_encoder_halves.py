"""The encoder-cache connector's pure parts and halves, driven by hand with real stores, no engine."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from halves_testlib import held_writer  # noqa: E402
from orbitkv.connector import runtime  # noqa: E402
from orbitkv.connector.encoder import summary  # noqa: E402
from orbitkv.connector.encoder.entries import (  # noqa: E402
    encoder_cid,
    encoder_key,
    make_encoder_entry,
    output_of,
)
from orbitkv.connector.encoder.metadata import OrbitKVECMetadata  # noqa: E402
from orbitkv.connector.encoder.scheduler import ECSchedulerHalf  # noqa: E402
from orbitkv.connector.encoder.worker import ECWorkerHalf, to_host  # noqa: E402
from orbitkv.connector.scheduler.options import RequestRules
from orbitkv.store.keys import EntryKey, chunk_cid  # noqa: E402
from orbitkv.store.tiered import TieredStore  # noqa: E402

from orbitkv.config import OrbitKVConfig

FP = "f" * 32
NUM_EMBEDS = 6
HIDDEN = 8


def _output(seed: int, num_embeds: int = NUM_EMBEDS) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_embeds, HIDDEN, generator=g).to(torch.bfloat16)


def _feature(mm_hash: str, offset: int, data=None, modality: str = "image"):
    from vllm.multimodal.inputs import PlaceholderRange

    # Two framing tokens around the embeddings, as an image placeholder has.
    position = PlaceholderRange(
        offset=offset,
        length=NUM_EMBEDS + 2,
        is_embed=torch.tensor([False] + [True] * NUM_EMBEDS + [False]),
    )
    return SimpleNamespace(identifier=mm_hash, modality=modality, mm_position=position, data=data)


def _request(req_id: str, features, params=None, cache_salt=None):
    return SimpleNamespace(
        request_id=req_id, mm_features=features, kv_transfer_params=params, cache_salt=cache_salt
    )


@pytest.fixture
def store():
    with TieredStore(memory_nbytes=1 << 24) as s:
        yield s


def _half(store, config: dict | None = None, **kw) -> ECSchedulerHalf:
    kw.setdefault("is_load_enabled", True)
    kw.setdefault("is_save_enabled", True)
    # Items here carry no inputs and are keyed by name: the mechanics, not the identity
    # (test_mm_identity.py checks that untrusted names never become keys).
    kw.setdefault("is_client_trusted", True)
    return ECSchedulerHalf(store, FP, RequestRules(OrbitKVConfig(**(config or {}))), **kw)


def _store_output(store, mm_hash: str, output: torch.Tensor, tenant: str = "", salt: str = "") -> str:
    key = encoder_key(FP, tenant, salt, mm_hash)
    store.put(key, make_encoder_entry(output, FP))
    return key


# -- keys and entries -----------------------------------------------------------------------------


def test_encoder_keys_separate_models_tenants_salts_and_items():
    base = ("a" * 32, "t", "s", "img-1")
    variants = [
        base,
        ("b" * 32, "t", "s", "img-1"),
        ("a" * 32, "u", "s", "img-1"),
        ("a" * 32, "t", "", "img-1"),
        ("a" * 32, "t", "s", "img-2"),
        ("a" * 32, "ts", "", "img-1"),  # tenant+salt concatenations must not collide
    ]
    cids = [encoder_cid(*v) for v in variants]
    assert len(set(cids)) == len(cids)
    assert encoder_cid(*base) == encoder_cid(*base)
    key = encoder_key(*base)
    assert key == f"okv2:encoder:{cids[0]}" and EntryKey.parse(key) == EntryKey(cids[0], "encoder")
    # Never a KV chunk's cid, even for the same fields.
    assert cids[0] != chunk_cid("a" * 32, "encoder", "t", [1, 2], cache_salt="s")
    with pytest.raises(ValueError, match="no antecedent"):
        EntryKey(cids[0], "encoder", "c" * 32)
    with pytest.raises(ValueError, match="mm_hash"):
        encoder_cid(FP, "", "", "")


def test_encoder_entry_round_trips_through_the_tiers_and_checks_size(tmp_path):
    output = _output(1)
    key = encoder_key(FP, "", "", "img")
    with TieredStore(memory_nbytes=1 << 24, disk_dir=str(tmp_path), disk_nbytes=1 << 24) as s:
        s.put(key, make_encoder_entry(output, FP))
        assert s.flush()
        s.memory.batch_delete([key])  # read from the disk tier, verified
        (entry,) = s.get([key], expect_fingerprint=FP)
        assert entry.meta.kind == "encoder" and entry.meta.num_tokens == NUM_EMBEDS
        assert torch.equal(output_of(entry, NUM_EMBEDS), output)
        assert output_of(entry, NUM_EMBEDS + 1) is None  # another size is a miss
        assert s.get([key], expect_fingerprint="0" * 32) == [None]  # another model's: a miss
    assert output_of(None, NUM_EMBEDS) is None
    with pytest.raises(ValueError, match="embeddings"):
        make_encoder_entry(torch.zeros(0, HIDDEN), FP)


# -- scheduler half -------------------------------------------------------------------------------


def test_scheduler_half_loads_what_the_store_verified_and_saves_the_rest(store):
    half = _half(store)
    stored = _output(2)
    _store_output(store, "img-a", stored)
    req = _request("r1", [_feature("img-a", 3), _feature("img-b", 20)])
    assert not half.has_cache_item("img-a")  # no request context yet: never a guess
    assert half.ensure_cache_available(req, 0)
    assert half.has_cache_item("img-a") and not half.has_cache_item("img-b")
    half.update_state_after_alloc(req, 0)
    half.update_state_after_alloc(req, 1)
    meta = half.build_connector_meta(None)
    ((load,),) = [meta.loads]
    assert load.mm_hash == "img-a" and torch.equal(load.output, stored)
    assert meta.saves == {"img-b": [encoder_key(FP, "", "", "img-b")]}
    # The step's state is gone: the next step asks again.
    assert half.build_connector_meta(None) == OrbitKVECMetadata()
    assert not half.has_cache_item("img-a")
    stats = half.take_stats().data
    assert stats["items.loaded"] == 1 and stats["items.computed"] == 1
    assert stats["loaded_bytes"] == stored.numel() * 2 and len(stats["fetch_latency_s"]) == 1
    assert summary.counts("r1") == {summary.LOADED: 1, summary.COMPUTED: 1}
    assert half.request_finished(req) == (
        False,
        {"orbitkv": {summary.LOADED: 1, summary.COMPUTED: 1}},
    )
    assert half.num_tracked_requests == 0 and summary.counts("r1")[summary.LOADED] == 0


def test_scheduler_half_skips_items_already_computed(store):
    half = _half(store)
    _store_output(store, "img-a", _output(3))
    req = _request("r2", [_feature("img-a", 3)])
    half.ensure_cache_available(req, 3 + NUM_EMBEDS + 2)  # the item's KV is in place already
    assert not half.has_cache_item("img-a")
    half.request_finished(req)


def test_a_request_past_its_items_is_answered_without_looking_at_them(store):
    """vLLM asks every running request with items every step, decode included: once computed
    past its last item the answer is True at once (no item is recorded for the step)."""
    half = _half(store)
    _store_output(store, "img-b", _output(5))
    req = _request("r5", [_feature("img-a", 3), _feature("img-b", 20)])
    assert half.ensure_cache_available(req, 0)  # the request's keys are made at the first ask
    half.build_connector_meta(None)
    end = 20 + NUM_EMBEDS + 2  # the last placeholder's end (framing tokens included)
    assert half.ensure_cache_available(req, end)  # decoding: past both items
    assert not half.has_cache_item("img-b")  # not recorded for this step
    assert half.ensure_cache_available(req, end - 1)  # short of the last item's end
    assert half.has_cache_item("img-b")
    half.request_finished(req)


def test_scheduler_half_names_an_item_once_per_request(store, monkeypatch):
    """vLLM asks ``ensure_cache_available`` every step a request waits or prefills: the item's
    key (and whether it has an input to encode) is made at the first ask, not at every one."""
    from orbitkv.connector.encoder import scheduler as ec_scheduler

    calls = []
    real = ec_scheduler.encoder_key
    monkeypatch.setattr(ec_scheduler, "encoder_key", lambda *a: calls.append(a) or real(*a))
    half = _half(store)
    _store_output(store, "img-a", _output(4))
    req = _request("r3", [_feature("img-a", 3), _feature("img-b", 20)])
    for _ in range(3):
        assert half.ensure_cache_available(req, 0)
        assert half.has_cache_item("img-a") and not half.has_cache_item("img-b")
        half.build_connector_meta(None)
    assert len(calls) == 2  # one a item
    other = _request("r4", [_feature("img-a", 3)], cache_salt="s")  # its own key
    half.ensure_cache_available(other, 0)
    assert not half.has_cache_item("img-a")  # stored without the salt
    assert len(calls) == 3 and calls[-1][2] == "s"
    half.request_finished(req)
    half.request_finished(other)


def test_scheduler_half_keys_only_the_items_vllm_asks_for(store, monkeypatch):
    """A new request's items are recorded at ``ensure_cache_available``, before vLLM's prefix
    cache lookup; an item that lookup then covers is never asked for, and never keyed."""
    from orbitkv.connector.encoder import scheduler as ec_scheduler

    calls = []
    real = ec_scheduler.encoder_key
    monkeypatch.setattr(ec_scheduler, "encoder_key", lambda *a: calls.append(a) or real(*a))
    half = _half(store)
    _store_output(store, "img-c", _output(6))
    req = _request("r6", [_feature("img-a", 3), _feature("img-b", 20), _feature("img-c", 40)])
    assert half.ensure_cache_available(req, 0)
    assert calls == []
    assert half.has_cache_item("img-c")  # the one item vLLM would encode
    half.update_state_after_alloc(req, 2)
    meta = half.build_connector_meta(None)
    assert [load.mm_hash for load in meta.loads] == ["img-c"]
    assert [c[3] for c in calls] == ["img-c"]
    half.request_finished(req)


def test_scheduler_half_follows_request_options_tenant_and_salt(store):
    half = _half(store, {"request_tenants": ["alice", "bob", "carol"]})
    _store_output(store, "img", _output(4), tenant="alice")
    features = [_feature("img", 0)]
    cases = [
        ({"orbitkv": {"tenant": "alice"}}, None, True),
        ({"orbitkv": {"tenant": "bob"}}, None, False),
        # A tenant the deployment does not allow is refused: no load (nor save) under any tenant.
        ({"orbitkv": {"tenant": "mallory"}}, None, False),
        ({"orbitkv": {"tenant": "alice"}}, "salt", False),
        ({"orbitkv": {"tenant": "alice", "load": False}}, None, False),
        (None, None, False),  # the configured tenant ("")
    ]
    for i, (params, salt, want) in enumerate(cases):
        req = _request(f"t{i}", features, params, salt)
        half.ensure_cache_available(req, 0)
        assert half.has_cache_item("img") is want, (params, salt)
        half.update_state_after_alloc(req, 0)
        meta = half.build_connector_meta(None)
        assert bool(meta.loads) is want
        half.request_finished(req)
    # A request that saves nothing gets no save; one that loads nothing still saves.
    req = _request("t-nosave", features, {"orbitkv": {"tenant": "carol", "save": False}})
    half.ensure_cache_available(req, 0)
    half.update_state_after_alloc(req, 0)
    assert half.build_connector_meta(None).saves == {}
    half.request_finished(req)


def test_scheduler_half_turned_off_neither_loads_nor_saves(store):
    half = _half(store, is_load_enabled=False, is_save_enabled=False)
    _store_output(store, "img", _output(5))
    req = _request("off", [_feature("img", 0)])
    half.ensure_cache_available(req, 0)
    assert not half.has_cache_item("img")
    half.update_state_after_alloc(req, 0)
    assert half.build_connector_meta(None) == OrbitKVECMetadata()
    half.request_finished(req)


def _flip(buf: bytes, at: int) -> bytes:
    return buf[:at] + bytes([buf[at] ^ 0xFF]) + buf[at + 1 :]


@pytest.mark.parametrize("fault", ["corrupt", "truncated", "other_model", "wrong_size", "wrong_kind"])
def test_scheduler_half_answers_bad_entries_with_the_encoder(store, fault):
    half = _half(store)
    key = _store_output(store, "img", _output(6))
    raw = bytes(store.get_bytes([key])[0])
    bad = {
        "corrupt": lambda: store.put_bytes([(key, _flip(raw, len(raw) - 3))]),
        "truncated": lambda: store.put_bytes([(key, raw[:-8])]),
        "other_model": lambda: store.put(key, make_encoder_entry(_output(6), "0" * 32)),
        "wrong_size": lambda: store.put(key, make_encoder_entry(_output(6, NUM_EMBEDS - 1), FP)),
        "wrong_kind": lambda: store.put_bytes([(key, _canonical_bytes())]),
    }
    bad[fault]()
    req = _request("bad", [_feature("img", 0)])
    half.ensure_cache_available(req, 0)
    assert not half.has_cache_item("img")
    half.update_state_after_alloc(req, 0)
    meta = half.build_connector_meta(None)
    assert meta.loads == [] and meta.saves == {"img": [key]}  # computed, and stored again
    assert half.take_stats().data["unreadable_entries"] == 1
    half.request_finished(req)


def _canonical_bytes() -> bytes:
    from orbitkv.store.entry import encode, make_entry

    entry = make_entry("canonical", {"k.0": torch.zeros(NUM_EMBEDS, 2, 4)}, model_fingerprint=FP, layout="mha")
    return encode(entry)


def test_scheduler_half_fails_a_request_it_cannot_encode_or_load(store):
    """A metadata-only embedding item (what an EC consumer lets a client send) has no encoder
    input: without a stored output the request is reported unavailable, once; with one, served."""
    half = _half(store, metadata_fields=lambda modality: {"image_grid_thw"})
    grid = SimpleNamespace(data=torch.tensor([1, 2, 2]))
    metadata_only = {"image_grid_thw": grid}
    with_pixels = {"image_grid_thw": grid, "pixel_values": SimpleNamespace(data=torch.zeros(4))}
    req = _request("m1", [_feature("img-m", 0, data=metadata_only)])
    assert half.ensure_cache_available(_request("m0", [_feature("img-m", 0, data=with_pixels)]), 0)
    assert not half.ensure_cache_available(req, 0)
    assert half.take_unavailable_requests() == {"m1"} and half.take_unavailable_requests() == set()
    half.build_connector_meta(None)
    _store_output(store, "img-m", _output(7))
    assert half.ensure_cache_available(req, 0) and half.has_cache_item("img-m")
    for r in ("m0", "m1"):
        half.request_finished(SimpleNamespace(request_id=r))


def test_scheduler_half_store_errors_are_misses(store):
    class Broken:
        def lookup(self, keys):
            raise RuntimeError("boom")

    half = ECSchedulerHalf(Broken(), FP, RequestRules(OrbitKVConfig()), is_load_enabled=True, is_save_enabled=True,
                          is_client_trusted=True)
    req = _request("broken", [_feature("img", 0)])
    half.ensure_cache_available(req, 0)
    assert not half.has_cache_item("img")
    half.request_finished(req)


# -- worker half ----------------------------------------------------------------------------------


@pytest.fixture
def shared(store):
    writer = runtime.SaveWriter(store, max_queue=1)
    yield runtime.Shared(store, writer)
    writer.close()


def test_worker_half_saves_off_the_forward_and_loads_into_the_cache(shared, store):
    worker = ECWorkerHalf(shared, FP, torch.device("cpu"), is_saver=True)
    output = _output(8)
    keys = [encoder_key(FP, "a", "", "img"), encoder_key(FP, "b", "", "img")]
    cache = {"img": output}
    worker.save_caches(cache, "img", OrbitKVECMetadata(saves={"img": keys}))
    worker.save_caches(cache, "img", OrbitKVECMetadata())  # nothing asked for: nothing saved
    worker.save_caches(cache, "img", None)
    shared.writer.flush()
    for entry in store.get(keys, expect_fingerprint=FP):
        assert torch.equal(output_of(entry, NUM_EMBEDS), output)
    assert shared.writer.nbytes_by_kind["encoder"] > 0
    # Loads: the scheduler's verified tensors go into vLLM's cache; what is there stays.
    mine = _output(9)
    cache = {"kept": mine}
    worker.start_load_caches(cache, OrbitKVECMetadata(loads=_loads({"new": output, "kept": output})))
    assert torch.equal(cache["new"], output) and cache["kept"] is mine


def _loads(outputs):
    from orbitkv.connector.encoder.metadata import EncoderLoad

    return [EncoderLoad(h, t) for h, t in outputs.items()]


def test_worker_counters_reach_the_scheduler_half(shared, store):
    worker = ECWorkerHalf(shared, FP, torch.device("cpu"), is_saver=True)
    # Hold the writer's thread and fill its one-slot queue: the next save is dropped, not waited on.
    with held_writer(shared.writer):
        shared.writer.submit(frozenset(), lambda: [])
        key = encoder_key(FP, "", "", "img")
        worker.save_caches({"img": _output(10)}, "img", OrbitKVECMetadata(saves={"img": [key]}))
    shared.writer.flush()
    assert store.get([key]) == [None]
    worker.save_caches({"img": _output(10)}, "img", OrbitKVECMetadata(saves={"img": [key]}))
    meta = worker.build_worker_meta()
    assert meta.counters == {"dropped_saves": 1, "saved_items": 1}
    assert worker.build_worker_meta() is None
    half = _half(store)
    half.update_connector_output(SimpleNamespace(ec_connector_worker_meta=meta))
    assert half.take_stats().data == {"dropped_saves": 1, "saved_items": 1}


def test_only_the_first_rank_saves(shared, store):
    worker = ECWorkerHalf(shared, FP, torch.device("cpu"), is_saver=False)
    key = encoder_key(FP, "", "", "img")
    worker.save_caches({"img": _output(11)}, "img", OrbitKVECMetadata(saves={"img": [key]}))
    shared.writer.flush()
    assert store.get([key]) == [None]


def test_a_cpu_output_is_handed_to_the_writer_without_a_copy(shared, store):
    """On the CPU the writer holds the cached output itself (no copy on the forward's path); the
    entry it writes is its own copy of the bytes, taken after vLLM dropped the output."""
    output = _output(12)
    host, wait = to_host(output)
    wait()
    assert host.data_ptr() == output.data_ptr()
    ptr = host.data_ptr()
    tracked = output.float().requires_grad_()  # outside inference mode: handed on detached
    held, _ = to_host(tracked)
    assert not held.requires_grad and held.data_ptr() == tracked.data_ptr()
    del host
    worker = ECWorkerHalf(shared, FP, torch.device("cpu"), is_saver=True)
    key = encoder_key(FP, "", "", "img")
    cache = {"img": output}
    expected = output.clone()
    worker.save_caches(cache, "img", OrbitKVECMetadata(saves={"img": [key]}))
    del cache["img"], output  # vLLM frees the item: the queued save still holds its tensor
    assert shared.writer.flush()
    stored = output_of(store.get([key], expect_fingerprint=FP)[0], expected.shape[0])
    assert stored is not None and torch.equal(stored, expected)
    assert stored.data_ptr() != ptr


@pytest.mark.gpu
def test_host_copy_from_cuda_waits_for_the_copy():
    output = _output(13).cuda() * 3
    host, wait = to_host(output)
    assert host.is_pinned()
    wait()
    assert torch.equal(host, output.cpu())
