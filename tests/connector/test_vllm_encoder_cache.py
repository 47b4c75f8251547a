"""The encoder-cache connector in a real vLLM CPU engine: SmolVLM (seeded weights) with the OrbitKV
KV connector, its scheduler extension and ``OrbitKVECConnector``, on memory + a real redis-server.

An image whose KV must be computed again (behind new text, after a reorder: exact reuse only, so
every output here must equal a full prefill) takes its encoder output from the store: the model
runner is handed no pixels for it (counted at the model runner, independently of OrbitKV), and
tokens, logprobs and the KV of every layer equal a run with both connectors off for the request.
A corrupt, foreign, wrong-sized or missing entry, another tenant's or salt's entry, or a down
Redis runs the encoder instead, with the same answer.

vLLM keeps encoder outputs of finished requests in its own encoder cache: every run here empties
it first, so what a request does not compute can only come from the store.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from connector_vllm_testlib import OFF, assert_informative, flush, summary
from connector_vllm_testlib import engine as start_engine
from PIL import Image
from redis_server import RedisServer, has_redis

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.redis,
    pytest.mark.skipif(not has_redis(), reason="needs redis-server"),
]

MAX_TOKENS = 8
EXACT = {"orbitkv": {"modes": ["exact"]}}
TEMPLATE = "<|im_start|>System: {}<end_of_utterance>\nUser:{}Describe it.<end_of_utterance>\nAssistant:"


def _image(seed: int) -> Image.Image:
    pixels = np.random.RandomState(seed).rand(64, 64, 3) * 255
    return Image.fromarray(pixels.astype("uint8"))


def _request(system: str, images: list, **extra) -> dict:
    text = TEMPLATE.format(system, "<image>" * len(images))
    data = {"multi_modal_data": {"image": images}} if images else {}
    return {"prompt": text, **data, **extra}


def _params(tenant: str | None = None, **options) -> dict:
    opts = {"modes": ["exact"], **options}
    if tenant is not None:
        opts["tenant"] = tenant
    return {"orbitkv": opts}


@pytest.fixture(scope="module")
def redis():
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def engine(tmp_path_factory, redis):
    from vllm.config import ECTransferConfig

    from orbitkv.models.make_model import make_model
    from orbitkv.serving.encoder_cache import ec_transfer_config

    model_dir = make_model(tmp_path_factory.mktemp("model") / "smolvlm", "smolvlm")
    # The tenants the tests pick per request are the deployment's to allow.
    extra = {"remote_url": redis.url, "orbitkv_remote_timeout_s": 0.5,
             "orbitkv_request_tenants": ["alice", "bob"]}
    with start_engine(
        model_dir,
        extra_config=extra,
        load_format="auto",
        limit_mm_per_prompt={"image": 3},
        disable_log_stats=False,
        ec_transfer_config=ECTransferConfig(**ec_transfer_config()),
    ) as eng:
        _names(eng)
        yield eng


class Encoded:
    """The items the model runner encodes (their mm_hashes), read at the model runner."""

    def __init__(self, engine) -> None:
        self.runner = engine.model_runner
        self.hashes: list[str] = []

    def __enter__(self) -> Encoded:
        batch = self.runner._batch_mm_inputs_from_scheduler

        def spy(scheduler_output):
            mm_hashes, mm_kwargs, *rest = batch(scheduler_output)
            self.hashes.extend(mm_hashes)
            return (mm_hashes, mm_kwargs, *rest)

        self.runner._batch_mm_inputs_from_scheduler = spy
        return self

    def __exit__(self, *exc) -> None:
        del self.runner._batch_mm_inputs_from_scheduler


def _run(engine, request: dict, params: dict | None):
    """One greedy request with vLLM's encoder cache emptied first: (output, blocks, encoded)."""
    engine.core.reset_encoder_cache()
    with Encoded(engine) as encoded:
        out, blocks = engine.run(request, params, max_tokens=MAX_TOKENS)
    return out, blocks, encoded.hashes


def _ec(engine):
    return engine.core.scheduler.ec_connector


def _key(engine, mm_hash: str, tenant: str = "", salt: str = "") -> str:
    """The store key of the item vLLM calls ``mm_hash``: the store names it by its content
    (connector/mm_identity.py), as the scheduler found it (``_names``)."""
    from orbitkv.connector.encoder.entries import encoder_key

    name = _names(engine)[mm_hash]
    return encoder_key(_ec(engine).scheduler.model_fingerprint, tenant, salt, name)


def _names(engine) -> dict[str, str]:
    """vLLM identifier -> store identity of every item the EC scheduler keyed (a test spy)."""
    half = _ec(engine).scheduler
    if "_item_key" not in vars(half):
        names: dict[str, str] = {}
        inner = half._item_key

        def spy(request, feature):
            item = inner(request, feature)
            if item is not None:
                names[feature.identifier] = getattr(item, "name", feature.identifier)
            return item

        half._item_key = spy
        half.names = names
    return half.names


def _logprobs(out) -> list[float]:
    completion = out.outputs[0]
    return [lp[t].logprob for lp, t in zip(completion.logprobs, completion.token_ids, strict=True)]


def _assert_same_answer(got, ref) -> None:
    assert got.outputs[0].token_ids == ref.outputs[0].token_ids
    assert _logprobs(got) == _logprobs(ref)


def _saved(engine, system: str, images: list) -> list[str]:
    """Run once with everything saved; the images' mm_hashes, in prompt order."""
    out, _, encoded = _run(engine, _request(system, images), None)
    assert summary(out)["num_encoded_items"] == len(images) == len(encoded)
    flush(engine)
    return encoded


def test_reordered_images_load_their_encoder_outputs(engine):
    """``[sys, A, B]`` then ``[sys, B, A]`` with exact reuse only: both images' KV is computed
    again (new antecedents), from encoder outputs loaded from the store."""
    a, b = _image(1), _image(2)
    hashes = _saved(engine, "you compare two pictures.", [a, b])
    reordered = _request("you compare two pictures.", [b, a])
    ref, ref_blocks, ref_encoded = _run(engine, reordered, OFF)
    assert_informative(ref)
    assert sorted(ref_encoded) == sorted(hashes)  # connectors off: the encoder ran for both
    n = len(ref.prompt_token_ids)
    want = [engine.kv(ref_blocks, 0, n - 1, layer) for layer in range(4)]
    engine.poison(ref_blocks)

    got, blocks, encoded = _run(engine, reordered, EXACT)
    assert encoded == []  # no pixels reached the model runner
    s = summary(got)
    assert s["num_encoded_items"] == 0 and s["num_loaded_encoder_items"] == 2
    assert s["reused_tokens_by_mode"].get("exact", 0) < n - 1  # the images' KV was computed
    assert got.ec_transfer_params == {
        "orbitkv": {"num_loaded_encoder_items": 2, "num_computed_encoder_items": 0}
    }
    _assert_same_answer(got, ref)
    for layer, (k_want, v_want) in enumerate(want):
        k_got, v_got = engine.kv(blocks, 0, n - 1, layer)
        assert torch.equal(k_got, k_want) and torch.equal(v_got, v_want), f"layer {layer}"


def test_encoder_output_comes_from_redis_when_memory_lost_it(engine):
    """Another node's view: only Redis has the output (this node's memory tier dropped it)."""
    from orbitkv.connector.encoder.entries import output_of
    from orbitkv.store.redis_backend import RedisBackend
    from orbitkv.store.tiered import TieredStore

    (mm_hash,) = _saved(engine, "you read one picture.", [_image(3)])
    key = _key(engine, mm_hash)
    store = engine.sched_connector.store
    # The entry as another node reads it: a store of the Redis tier alone, verified.
    with TieredStore(backends=[RedisBackend(store.settings.redis_url)]) as remote:
        (entry,) = remote.get([key], expect_fingerprint=_ec(engine).scheduler.model_fingerprint)
    assert output_of(entry, entry.meta.num_tokens) is not None and entry.meta.kind == "encoder"
    store.memory.batch_delete([key])
    hits = store.stats().get("hits.redis", 0)

    moved = _request("you read one picture, again.", [_image(3)])
    ref, _, _ = _run(engine, moved, OFF)
    got, _, encoded = _run(engine, moved, EXACT)
    assert encoded == [] and summary(got)["num_loaded_encoder_items"] == 1
    assert store.stats()["hits.redis"] > hits
    _assert_same_answer(got, ref)


def _flip(buf: bytes, at: int) -> bytes:
    return buf[:at] + bytes([buf[at] ^ 0xFF]) + buf[at + 1 :]


@pytest.mark.parametrize("fault", ["corrupt", "other_model", "wrong_size", "missing"])
def test_a_bad_or_missing_entry_runs_the_encoder(engine, fault):
    from orbitkv.connector.encoder.entries import TENSOR, make_encoder_entry

    seed = {"corrupt": 10, "other_model": 11, "wrong_size": 12, "missing": 13}[fault]
    system = f"you look at picture {seed}."
    (mm_hash,) = _saved(engine, system, [_image(seed)])
    key = _key(engine, mm_hash)
    store = engine.sched_connector.store
    (entry,) = store.get([key])
    output = entry.tensors[TENSOR]
    if fault == "corrupt":  # every tier holds the flipped copy
        raw = bytes(store.get_bytes([key])[0])
        store.put_bytes([(key, _flip(raw, len(raw) - 5))])
    elif fault == "other_model":
        store.put(key, make_encoder_entry(output, "0" * 32))
    elif fault == "wrong_size":
        store.put(key, make_encoder_entry(output[:-1], _ec(engine).scheduler.model_fingerprint))
    else:
        store.delete([key])
    assert store.flush(60.0)

    moved = _request(system.replace("picture", "the picture"), [_image(seed)])
    ref, _, _ = _run(engine, moved, OFF)
    got, _, encoded = _run(engine, moved, EXACT)
    assert encoded == [mm_hash]  # the encoder ran, at the model runner
    s = summary(got)
    assert s["num_encoded_items"] == 1 and s["num_loaded_encoder_items"] == 0
    _assert_same_answer(got, ref)
    # The output computed now replaced the bad copy: the image behind yet other text loads it.
    flush(engine)
    again, _, encoded = _run(engine, _request(system.replace("at", "again at"), [_image(seed)]), EXACT)
    assert encoded == [] and summary(again)["num_loaded_encoder_items"] == 1


def _named(request: dict, *uuids: str) -> dict:
    """A request whose client names its images (a chat part's ``uuid``)."""
    return {**request, "multi_modal_uuids": {"image": list(uuids)}}


def _run_elsewhere(engine, request: dict, params: dict | None):
    """``_run`` as on another replica: vLLM's own caches (prefix, processor, encoder), which
    trust a client's uuid inside one engine, are emptied first; only the store remains."""
    engine.llm.reset_mm_cache()
    assert engine.llm.reset_prefix_cache()
    return _run(engine, request, params)


def test_one_uuid_for_two_pictures_shares_neither_kv_nor_encoder_output(engine):
    """vLLM takes a chat part's uuid as the item's hash as given: a client can send its own
    picture under the name another user's image went by. Its KV and encoder output must be its
    own picture's, and the same picture under another name still loads."""
    system = "you keep names apart."
    first = _named(_request(system, [_image(50)]), "shared-name")
    _, _, encoded = _run_elsewhere(engine, first, None)
    assert encoded == ["shared-name"]
    flush(engine)

    forged = _named(_request(system, [_image(51)]), "shared-name")
    ref, _, _ = _run_elsewhere(engine, forged, OFF)
    got, _, encoded = _run_elsewhere(engine, forged, EXACT)
    # The new picture's tokens were computed (no stored KV) from its own pixels (no stored
    # encoder output): the model runner encoded it.
    assert encoded == ["shared-name"]
    assert summary(got)["num_loaded_encoder_items"] == 0
    _assert_same_answer(got, ref)

    renamed = _named(_request(system.replace("apart", "well apart"), [_image(50)]), "other-name")
    got, _, encoded = _run_elsewhere(engine, renamed, EXACT)
    assert encoded == [] and summary(got)["num_loaded_encoder_items"] == 1


def _count_input_hashes(monkeypatch) -> list[int]:
    """Calls that hash an item's processed inputs (``mm_identity._inputs_id``), counted."""
    from orbitkv.connector import mm_identity

    calls: list[int] = []
    inputs_id = mm_identity._inputs_id
    monkeypatch.setattr(mm_identity, "_inputs_id", lambda *a: calls.append(1) or inputs_id(*a))
    return calls


def test_an_image_vllm_hashed_is_keyed_by_that_hash_and_not_hashed_again(engine, monkeypatch):
    """vLLM's front end hashed the picture itself (no uuid) and vouched for it with the launch
    key: both schedulers key it by that hash, and neither hashes its inputs again, while it is
    still served where it recurs (``vllm_ext/mm_hashes.py``)."""
    from orbitkv.connector.mm_identity import _named_by_vllm

    calls = _count_input_hashes(monkeypatch)
    system = "you read vouched names."
    _, _, (mm_hash,) = _run_elsewhere(engine, _request(system, [_image(70)]), EXACT)
    assert _names(engine)[mm_hash] == _named_by_vllm("image", "", mm_hash)
    assert engine.last_chunks and calls == []
    flush(engine)

    moved = _request(system.replace("read", "always read"), [_image(70)])
    ref, _, _ = _run_elsewhere(engine, moved, OFF)
    del calls[:]
    got, _, encoded = _run_elsewhere(engine, moved, EXACT)
    assert encoded == [] and summary(got)["num_loaded_encoder_items"] == 1
    assert calls == []
    _assert_same_answer(got, ref)


def test_a_uuid_naming_another_images_hash_is_keyed_by_its_own_inputs(engine, monkeypatch):
    """A client sends its own picture under the hash vLLM gave another one, with that hash's
    true tag (as if it had leaked): the front end drops a client's tags, so the picture is keyed
    by its inputs, and neither the other picture's KV nor its encoder output is served for it."""
    from orbitkv.connector.mm_identity import _named_by_vllm
    from orbitkv.connector.vllm_ext.mm_hashes import TAGS_PARAM, tag

    from orbitkv.config import launch_key

    system = "you keep hashes apart."
    _, _, (mm_hash,) = _run_elsewhere(engine, _request(system, [_image(71)]), EXACT)
    flush(engine)
    calls = _count_input_hashes(monkeypatch)
    forged = _named(_request(system, [_image(72)]), mm_hash)
    ref, _, _ = _run_elsewhere(engine, forged, OFF)
    leaked = {**EXACT, TAGS_PARAM: {mm_hash: tag(launch_key(), mm_hash)}}
    got, _, encoded = _run_elsewhere(engine, forged, leaked)
    assert encoded == [mm_hash] and summary(got)["num_loaded_encoder_items"] == 0
    assert calls and _names(engine)[mm_hash] != _named_by_vllm("image", "", mm_hash)
    _assert_same_answer(got, ref)


def test_tenants_and_salts_do_not_share_encoder_outputs(engine):
    image = _image(20)
    first, _, (mm_hash,) = _run(engine, _request("you serve tenants.", [image]), _params("alice"))
    assert summary(first)["num_encoded_items"] == 1
    flush(engine)
    moved = _request("you serve tenants well.", [image])
    for params, extra, is_loaded in [
        (_params("bob"), {}, False),
        (_params("alice"), {"cache_salt": "s1"}, False),
        (_params("alice"), {}, True),
    ]:
        out, _, encoded = _run(engine, {**moved, **extra}, params)
        assert (encoded == []) is is_loaded, (params, extra)
        assert summary(out)["num_loaded_encoder_items"] == int(is_loaded)
    # bob's and the salted run's own outputs were saved under their own keys.
    flush(engine)
    store = engine.sched_connector.store
    keys = [_key(engine, mm_hash, "alice"), _key(engine, mm_hash, "bob"), _key(engine, mm_hash, "alice", "s1")]
    assert len(set(keys)) == 3 and all(t is not None for t in store.lookup(keys))


def test_prometheus_counts_loaded_and_computed_outputs(engine):
    from prometheus_client import REGISTRY

    def total(name: str, **labels) -> float:
        return sum(
            sample.value
            for metric in REGISTRY.collect()
            for sample in metric.samples
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
        )

    before = total("vllm:orbitkv_encoder_items_total", source="loaded")
    # The encoder connector's hooks are OrbitKV's own time, exported with the KV connector's.
    encoder_s = total("vllm:orbitkv_seconds_total", part="encoder")
    _saved(engine, "you count pictures.", [_image(30)])
    _run(engine, _request("you count pictures twice.", [_image(30)]), EXACT)
    _run(engine, _request("you count.", []), None)  # the last step's stats land now
    assert total("vllm:orbitkv_encoder_items_total", source="loaded") >= before + 1
    assert total("vllm:orbitkv_encoder_items_total", source="computed") >= 1
    assert total("vllm:orbitkv_encoder_saved_items_total") >= 1
    assert total("vllm:orbitkv_encoder_loaded_bytes_total") > 0
    assert total("vllm:orbitkv_encoder_fetch_latency_seconds_count") >= 1
    assert total("vllm:orbitkv_stored_bytes_total", kind="encoder") > 0
    assert total("vllm:orbitkv_seconds_total", part="encoder") > encoder_s


def test_a_down_redis_runs_the_encoder(engine, redis):
    (mm_hash,) = _saved(engine, "you survive outages.", [_image(40)])
    store = engine.sched_connector.store
    store.memory.batch_delete([_key(engine, mm_hash)])  # only Redis has it now
    moved = _request("you survive outages well.", [_image(40)])
    ref, _, _ = _run(engine, moved, OFF)
    redis.kill()
    try:
        got, _, encoded = _run(engine, moved, EXACT)
    finally:
        redis.start()
    assert encoded == [mm_hash] and summary(got)["num_loaded_encoder_items"] == 0
    _assert_same_answer(got, ref)
