"""A multimodal item's store identity is its processed inputs, not the identifier a client names.

vLLM takes a chat part's ``uuid`` as the item's hash as given, so two requests naming one uuid for
two different pictures reach the scheduler with equal identifiers. Their chunks and encoder keys
must differ (else one user's picture is served, as exact, for the other's), and the same picture
under any name must still share them. Features here are vLLM's own ``MultiModalFeatureSpec`` with
``MultiModalKwargsItem`` data, as the engine core's scheduler holds them.
"""

from __future__ import annotations

import pytest
import torch
from orbitkv.connector.chunking import (
    KeyContext,
    UnkeyableItem,
    chunk_prompt,
    mm_spans_from_features,
)
from orbitkv.connector.encoder.scheduler import ECSchedulerHalf
from orbitkv.connector.mm_identity import PREFIX, content_id
from orbitkv.connector.scheduler.options import RequestRules
from orbitkv.store.tiered import TieredStore

pytestmark = pytest.mark.vllm

CTX = KeyContext("fp", "mha:bfloat16", "")
OFFSET, LENGTH = 3, 6


def _pixels(seed: int) -> torch.Tensor:
    return torch.randn(3, 8, 8, generator=torch.Generator().manual_seed(seed))


def _feature(identifier: str, pixels: torch.Tensor | None, *, offset: int = OFFSET, lora: str = ""):
    from vllm.multimodal.inputs import (
        MultiModalBatchedField,
        MultiModalFeatureSpec,
        MultiModalFieldElem,
        MultiModalKwargsItem,
        PlaceholderRange,
    )

    data = None
    if pixels is not None:
        data = MultiModalKwargsItem(
            {"pixel_values": MultiModalFieldElem(data=pixels, field=MultiModalBatchedField())}
        )
    return MultiModalFeatureSpec(
        data=data,
        modality="image",
        identifier=f"{lora}{identifier}",
        mm_position=PlaceholderRange(offset=offset, length=LENGTH),
        mm_hash=identifier,
    )


def _image_cid(feature, **kwargs) -> str:
    tokens = [1, 2, 3] + [9] * LENGTH + [4, 5]
    chunks = chunk_prompt(tokens, mm_spans_from_features([feature], **kwargs), 64, CTX)
    (image,) = [c for c in chunks if c.is_mm]
    return image.cid


def test_one_uuid_for_two_pictures_gives_two_chunks():
    mine, theirs = _feature("cat-photo", _pixels(1)), _feature("cat-photo", _pixels(2))
    assert _image_cid(mine) != _image_cid(theirs)
    # The same picture under another name, or resent, is one chunk.
    assert _image_cid(mine) == _image_cid(_feature("renamed", _pixels(1)))
    assert content_id(mine).startswith(PREFIX) and "cat-photo" not in content_id(mine)


def test_a_lora_that_changes_the_tower_keeps_its_own_identity():
    plain, with_lora = _feature("h", _pixels(1)), _feature("h", _pixels(1), lora="adapter:")
    assert content_id(plain) != content_id(with_lora)


def test_trusted_client_ids_key_by_the_name_and_missing_inputs_are_not_cached():
    mine, theirs = _feature("cat-photo", _pixels(1)), _feature("cat-photo", _pixels(2))
    assert _image_cid(mine, is_client_trusted=True) == _image_cid(theirs, is_client_trusted=True)
    # Nothing to hash (vLLM's shm cache or a consumer's name-only item): no identity.
    with pytest.raises(UnkeyableItem, match="content identity"):
        mm_spans_from_features([_feature("cat-photo", None)])
    metadata_only = _feature("cat-photo", _pixels(1))
    assert content_id(metadata_only, lambda modality: {"pixel_values"}) is None


def _ec_half(store, **kwargs) -> ECSchedulerHalf:
    from orbitkv.config import OrbitKVConfig

    rules = RequestRules(OrbitKVConfig(local_cpu=True))
    return ECSchedulerHalf(store, "f" * 32, rules, is_load_enabled=True, is_save_enabled=True, **kwargs)


def _request(req_id: str, feature):
    from types import SimpleNamespace

    return SimpleNamespace(request_id=req_id, mm_features=[feature], kv_transfer_params=None,
                           cache_salt=None)


@pytest.mark.parametrize("is_client_trusted", [False, True])
def test_encoder_keys_name_the_pictures(is_client_trusted):
    with TieredStore(memory_nbytes=1 << 24) as store:
        half = _ec_half(store, is_client_trusted=is_client_trusted)
        keys = []
        for req_id, seed in [("mine", 1), ("theirs", 2), ("again", 1)]:
            request = _request(req_id, _feature("cat-photo", _pixels(seed)))
            keys.append(half._item_key(request, request.mm_features[0]).key)
        assert keys[0] == keys[2]
        assert (keys[0] == keys[1]) is is_client_trusted


def test_an_item_is_hashed_once_while_it_lives_and_forgotten_after():
    import gc

    from orbitkv.connector import mm_identity

    feature = _feature("cat-photo", _pixels(1))
    first = content_id(feature)
    key = id(feature.data)
    assert key in mm_identity._DIGESTS
    assert content_id(feature) == first  # the encoder scheduler's ask: from the memo
    # The memo is not the hash: another LoRA prefix over the same data still differs.
    assert content_id(_feature("cat-photo", feature.data["pixel_values"].data, lora="x:")) != first
    del feature
    gc.collect()
    assert key not in mm_identity._DIGESTS  # no growth with the requests served


def test_a_recurring_items_name_comes_from_its_datas_entry_and_is_the_fresh_one():
    """The same data under another LoRA prefix, or under a resolver that calls its one field
    placeholder-only, is named apart; the names kept with the data are those hashed afresh."""
    import dataclasses

    from orbitkv.connector import mm_identity

    feature = _feature("cat-photo", _pixels(3))
    lora = dataclasses.replace(feature, identifier="x:cat-photo")
    def placeholder_only(modality):
        return {"pixel_values"}
    names = [content_id(feature), content_id(lora), content_id(feature, placeholder_only)]
    assert names[0] != names[1] and None not in names[:2] and names[2] is None
    assert [content_id(feature), content_id(lora), content_id(feature, placeholder_only)] == names
    assert len(mm_identity._DIGESTS[id(feature.data)][3]) == 3
    mm_identity._DIGESTS.pop(id(feature.data))
    assert [content_id(feature), content_id(lora), content_id(feature, placeholder_only)] == names


def test_hashing_new_inputs_is_timed_as_its_own_part_and_a_recurring_item_is_not():
    """``mm_hash``: the part of ``chunk`` spent hashing inputs not seen before (the breakdown
    reports it beside the load's memcpy time); a recurring item adds nothing."""
    from orbitkv.connector.timing import PartSeconds

    seconds = PartSeconds()
    feature = _feature("cat-photo", _pixels(2))
    spans = mm_spans_from_features([feature], seconds=seconds)
    first = seconds.take()
    assert first.get("seconds.mm_hash", 0.0) > 0.0
    assert mm_spans_from_features([feature], seconds=seconds) == spans
    assert seconds.take() == {}


def test_one_resolver_per_model_so_both_connectors_name_an_item_with_the_same_function():
    """``content_id``'s memo keys a name by the resolver: the KV and encoder connectors of one
    process get the same one, so the second to name an item finds the first's name."""
    from types import SimpleNamespace

    from orbitkv.connector.mm_identity import metadata_resolver

    model_config = SimpleNamespace()
    kv_side = metadata_resolver(SimpleNamespace(model_config=model_config))
    encoder_side = metadata_resolver(SimpleNamespace(model_config=model_config), is_strict=True)
    assert kv_side is not None and encoder_side is kv_side
    assert metadata_resolver(SimpleNamespace(model_config=SimpleNamespace())) is not kv_side
    assert metadata_resolver(SimpleNamespace()) is None  # a stand-in without a model
