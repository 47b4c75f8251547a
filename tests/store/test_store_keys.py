"""Content ids and entry keys."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from orbitkv.store.keys import EntryKey, antecedent_hash, chunk_cid, index_key, is_cid, orbit_key

FP, LAYOUT = "fp", "flash"


def test_cid_is_128_bit_hex_and_deterministic():
    cid = chunk_cid(FP, LAYOUT, "t", [1, 2, 3])
    assert is_cid(cid) and len(cid) == 32
    assert cid == chunk_cid(FP, LAYOUT, "t", np.array([1, 2, 3]))
    assert cid == chunk_cid(FP, LAYOUT, "t", torch.tensor([1, 2, 3]))


@pytest.mark.parametrize(
    "other",
    [
        ("fp2", LAYOUT, "t", [1, 2, 3]),
        (FP, "mla", "t", [1, 2, 3]),
        (FP, LAYOUT, "t2", [1, 2, 3]),
        (FP, LAYOUT, "t", [1, 2, 4]),
        (FP, LAYOUT, "t", [1, 2]),
    ],
)
def test_every_field_changes_the_cid(other):
    assert chunk_cid(FP, LAYOUT, "t", [1, 2, 3]) != chunk_cid(*other)


def test_fields_cannot_collide_by_concatenation():
    assert chunk_cid("ab", "c", "", [1]) != chunk_cid("a", "bc", "", [1])
    assert chunk_cid("a", "b", "c", []) != chunk_cid("a", "bc", "", [])


def test_tenant_and_salt_are_separate_fields():
    tokens = [1, 2, 3]
    tenant_x = chunk_cid(FP, LAYOUT, "x", tokens)
    salt_x = chunk_cid(FP, LAYOUT, "", tokens, cache_salt="x")
    assert tenant_x != salt_x
    under_t = {chunk_cid(FP, LAYOUT, "t", tokens, cache_salt=s) for s in ("", "a", "b", "ab")}
    assert len(under_t) == 4
    assert chunk_cid(FP, LAYOUT, "t", tokens, cache_salt="a") == chunk_cid(
        FP, LAYOUT, "t", np.array(tokens), cache_salt="a"
    )
    assert chunk_cid(FP, LAYOUT, "ta", tokens) != chunk_cid(FP, LAYOUT, "t", tokens, cache_salt="a")


def test_multimodal_run_hashed_by_content_not_placeholder():
    tokens = [5, 99, 99, 99, 6]
    a = chunk_cid(FP, LAYOUT, "t", tokens, [(1, 3, "img-hash-a")])
    b = chunk_cid(FP, LAYOUT, "t", tokens, [(1, 3, "img-hash-b")])
    assert a != b
    assert a == chunk_cid(FP, LAYOUT, "t", [5, 0, 0, 0, 6], [(1, 3, "img-hash-a")])
    assert a != chunk_cid(FP, LAYOUT, "t", tokens)
    # The same item at another split of the same tokens is a different chunk.
    assert a != chunk_cid(FP, LAYOUT, "t", tokens, [(1, 2, "img-hash-a")])


@pytest.mark.parametrize("runs", [[(3, 3, "x")], [(0, 2, "x"), (1, 2, "y")], [(0, 0, "x")]])
def test_bad_placeholder_runs_rejected(runs):
    with pytest.raises(ValueError):
        chunk_cid(FP, LAYOUT, "t", [1, 2, 3, 4], runs)


def test_antecedent_hash_is_ordered_and_orbit_key_is_not():
    a, b, c = (chunk_cid(FP, LAYOUT, "t", [i]) for i in range(3))
    assert antecedent_hash([a, b]) != antecedent_hash([b, a])
    assert orbit_key([a, b, c]) == orbit_key([c, a, b])
    assert orbit_key([a, a, b]) != orbit_key([a, b])  # a multiset, not a set
    assert antecedent_hash([a, b]) != orbit_key([a, b])
    assert is_cid(antecedent_hash([]))
    with pytest.raises(ValueError):
        antecedent_hash(["not-a-cid"])


def test_entry_key_round_trip_and_validation():
    cid = chunk_cid(FP, LAYOUT, "t", [1])
    ante = antecedent_hash([chunk_cid(FP, LAYOUT, "t", [2])])
    for key in (EntryKey(cid, "canonical"), EntryKey(cid, "conditioned", ante),
                EntryKey(cid, "patch", ante, 16)):
        assert EntryKey.parse(key.to_str()) == key
    assert len({EntryKey(cid, "canonical").to_str(), EntryKey(cid, "conditioned", ante).to_str(),
                 EntryKey(cid, "patch", ante, 16).to_str(), index_key(cid)}) == 4
    for bad in [(cid, "bogus"), (cid, "canonical", ante), (cid, "conditioned"),
                (cid, "patch", ante, 0), ("A" * 32, "canonical"), (cid, "conditioned", ante, 3)]:
        with pytest.raises(ValueError):
            EntryKey(*bad)
    for text in ["", "okv1:canonical", f"okv2:canonical:{cid}", f"okv1:patch:{cid}:{ante}:r0",
                 f"okv1:canonical:{cid}:x"]:
        with pytest.raises(ValueError):
            EntryKey.parse(text)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 2**31 - 1), max_size=64))
def test_keys_never_contain_prompt_text(tokens):
    cid = chunk_cid("secret model", "flash", "tenant secret", tokens)
    text = EntryKey(cid, "conditioned", antecedent_hash([cid])).to_str()
    assert set(text) <= set("okv1:conditioned0123456789abcdef")
