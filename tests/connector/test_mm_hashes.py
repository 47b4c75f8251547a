"""vLLM's media hashes, vouched for by its front end with the launch key (``vllm_ext/mm_hashes.py``).

An item the front end hashed from content is keyed by that hash, and its inputs are not hashed
again; anything a client could have named (a uuid, a tag it made up, a value a uuid also produced)
is keyed by its inputs as before. The engine-level checks, through vLLM's own front end, are in
``test_vllm_encoder_cache.py``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from orbitkv.connector import mm_identity
from orbitkv.connector.vllm_ext import mm_hashes
from orbitkv.connector.vllm_ext.mm_hashes import (
    TAGS_PARAM,
    VllmHashes,
    _tag_request,
    computed_hashes,
    tag,
    vouched,
)

from orbitkv.config import OrbitKVConfig, ensure_launch_key, launch_key

KEY = bytes(range(32))


def test_the_launch_key_is_made_once_and_read_back():
    env: dict[str, str] = {}
    assert launch_key(env) is None
    ensure_launch_key(env)
    key = launch_key(env)
    assert key is not None and len(key) == 32
    ensure_launch_key(env)
    assert launch_key(env) == key  # inherited, never remade
    env["ORBITKV_LAUNCH_KEY"] = "not hex"
    assert launch_key(env) is None
    ensure_launch_key(env)
    assert launch_key(env) not in (None, key)


def test_the_launch_key_is_not_a_config_key_and_the_switch_is():
    key_env = {"ORBITKV_LAUNCH_KEY": KEY.hex()}
    assert OrbitKVConfig.load(env=key_env).use_vllm_mm_hashes is True
    assert OrbitKVConfig.load(env={"ORBITKV_USE_VLLM_MM_HASHES": "false"}).use_vllm_mm_hashes is False
    with pytest.raises(ValueError, match="use_vllm_mm_hash"):
        OrbitKVConfig.load(env={"ORBITKV_USE_VLLM_MM_HASH": "true"})


def test_only_hashes_vllm_made_from_content_are_computed():
    hashes = {"image": ["a", "b", "c"], "video": ["d"]}
    assert computed_hashes(hashes, None) == {"a", "b", "c", "d"}
    # b was a client's name; c's uuid produced the value an unnamed item (a) also has.
    named = {"image": [None, "b", "a"], "video": [None]}
    assert computed_hashes({"image": ["a", "b", "a"], "video": ["d"]}, named) == {"d"}


def test_a_tag_vouches_only_under_the_key_that_made_it():
    tags = {"h1": tag(KEY, "h1"), "h2": tag(KEY, "h1"), "h3": "0" * 32, "h4": 7}
    assert vouched({TAGS_PARAM: tags}, KEY) == {"h1"}
    assert vouched({TAGS_PARAM: tags}, bytes(32)) == frozenset()
    assert vouched({TAGS_PARAM: "h1"}, KEY) == frozenset()
    assert vouched({"orbitkv": {}}, KEY) == frozenset()
    assert vouched(None, KEY) == frozenset()


def _request(hashes: list[str], kv: object = None):
    features = [SimpleNamespace(mm_hash=h) for h in hashes]
    extra = {"kv_transfer_params": kv} if kv is not None else None
    return SimpleNamespace(mm_features=features, sampling_params=SimpleNamespace(extra_args=extra))


def _kv(request) -> dict:
    return request.sampling_params.extra_args["kv_transfer_params"]


def test_the_front_end_tags_what_it_hashed_and_drops_a_clients_tags():
    prompt = {"mm_hashes": VllmHashes({"image": ["a", "b"]}, frozenset({"a"}))}
    client = {"orbitkv": {"modes": ["exact"]}, TAGS_PARAM: {"b": tag(KEY, "b")}}
    request = _request(["a", "b"], client)
    _tag_request(KEY, prompt, request)
    assert _kv(request) == {"orbitkv": {"modes": ["exact"]}, TAGS_PARAM: {"a": tag(KEY, "a")}}
    assert client[TAGS_PARAM] == {"b": tag(KEY, "b")}  # the caller's dict is not changed
    assert vouched(_kv(request), KEY) == {"a"}

    # Without the key (no OrbitKV connector here), a client's tags are still dropped.
    request = _request(["a", "b"], dict(client))
    _tag_request(None, prompt, request)
    assert _kv(request) == {"orbitkv": {"modes": ["exact"]}}

    # Hashes vLLM's hooks did not mark (copied on the way) get no tag.
    request = _request(["a"])
    _tag_request(KEY, {"mm_hashes": {"image": ["a"]}}, request)
    assert request.sampling_params.extra_args is None


def _feature(pixels: torch.Tensor, mm_hash: str):
    from vllm.multimodal.inputs import (
        MultiModalBatchedField,
        MultiModalFeatureSpec,
        MultiModalFieldElem,
        MultiModalKwargsItem,
        PlaceholderRange,
    )

    data = MultiModalKwargsItem(
        {"pixel_values": MultiModalFieldElem(data=pixels, field=MultiModalBatchedField())}
    )
    return MultiModalFeatureSpec(data=data, modality="image", identifier=mm_hash,
                                 mm_position=PlaceholderRange(offset=0, length=4), mm_hash=mm_hash)


@pytest.mark.vllm
def test_a_vouched_item_is_named_by_its_hash_without_hashing_its_inputs(monkeypatch):
    calls = []
    inputs_id = mm_identity._inputs_id
    monkeypatch.setattr(mm_identity, "_inputs_id", lambda *a: calls.append(1) or inputs_id(*a))
    pixels = torch.randn(3, 8, 8, generator=torch.Generator().manual_seed(1))
    mine, other = _feature(pixels, "vllm-hash-1"), _feature(pixels.clone(), "vllm-hash-2")
    names = mm_identity.identifiers([mine, other], is_client_trusted=False,
                                    vouched=frozenset({"vllm-hash-1"}))
    assert len(calls) == 1  # only the unvouched item's inputs
    assert names[0] == mm_identity.vllm_hashed_id(mine)
    assert names[1] == mm_identity.content_id(other)
    assert names[0] != names[1] and names[0].startswith(mm_identity.PREFIX)
    assert "vllm-hash-1" not in names[0]
    assert mm_identity.vllm_hashed_id(mine) != mm_identity.vllm_hashed_id(other)


@pytest.mark.vllm
def test_install_wraps_vllm_once():
    from vllm.multimodal.processing.inputs import ProcessorInputs
    from vllm.v1.engine.input_processor import InputProcessor

    mm_hashes.install()
    first = (ProcessorInputs.get_mm_hashes, InputProcessor.process_inputs)
    mm_hashes.install()
    assert (ProcessorInputs.get_mm_hashes, InputProcessor.process_inputs) == first
    assert all(getattr(f, "_orbitkv_wrapped", False) for f in first)


@pytest.mark.vllm
def test_an_item_without_inputs_is_keyed_only_when_its_hash_is_vouched_for():
    """vLLM's ``shm`` processor cache hands the scheduler an address, not the inputs: nothing to
    hash, so such an item is not cached, unless the front end vouched for vLLM's hash of it."""
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    item = MultiModalFeatureSpec(data={"address": 1234}, modality="image", identifier="h",
                                 mm_position=PlaceholderRange(offset=0, length=4), mm_hash="h")
    assert mm_identity.identifiers([item], is_client_trusted=False) == [None]
    assert mm_identity.identifiers([item], is_client_trusted=False, vouched=frozenset({"h"})) == [
        mm_identity.vllm_hashed_id(item)
    ]


def test_a_request_s_tags_are_checked_once_for_both_schedulers(monkeypatch):
    """The KV and encoder schedulers check one request's tags in turn: the second takes the
    first's answer. The answer goes by the tags and the key, so other tags are checked anew."""
    calls = []
    monkeypatch.setattr(mm_hashes, "tag", lambda key, h: calls.append(h) or tag(key, h))
    good = {TAGS_PARAM: {"a" * 64: tag(KEY, "a" * 64), "b" * 64: tag(KEY, "b" * 64)}}
    assert vouched(good, KEY) == {"a" * 64, "b" * 64}
    assert vouched(dict(good), KEY) == {"a" * 64, "b" * 64}
    assert len(calls) == 2
    forged = {TAGS_PARAM: {"a" * 64: tag(KEY, "a" * 64), "b" * 64: tag(bytes(32), "b" * 64)}}
    assert vouched(forged, KEY) == {"a" * 64}
    assert vouched(good, bytes(32)) == frozenset()
    assert len(calls) == 6
