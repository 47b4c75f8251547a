"""Content ids and entry keys."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from orbitkv.store.keys import (
    EMPTY_ANTECEDENT,
    EntryKey,
    RequestKeys,
    anchor_context,
    antecedent_hash,
    canonical_key,
    chunk_cid,
    conditioned_key,
    index_key,
    is_cid,
    orbit_key,
    patch_key,
)

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
    tag = "c" * 32
    keys = (EntryKey(cid, "canonical"), EntryKey(cid, "canonical", ante),
            EntryKey(cid, "conditioned", ante), EntryKey(cid, "conditioned", ante, lineage=tag),
            EntryKey(cid, "patch", ante, 16))
    for key in keys:
        assert EntryKey.parse(key.to_str()) == key
    assert len({k.to_str() for k in keys} | {index_key(cid)}) == len(keys) + 1
    for bad in [(cid, "bogus"), (cid, "patch", ante, 0), ("A" * 32, "canonical"),
                (cid, "conditioned", ante, 3), (cid, "canonical", ante, 0, tag),
                (cid, "patch", ante, 4, tag), (cid, "conditioned", ante, 0, "x")]:
        with pytest.raises(ValueError):
            EntryKey(*bad)
    for text in ["", "okv2:canonical", f"okv1:canonical:{cid}:{ante}", f"okv2:patch:{cid}:{ante}:r0",
                 f"okv2:canonical:{cid}:x", f"okv2:patch:{cid}:{ante}", f"okv2:canonical:{cid}:{ante}:r4",
                 f"okv2:conditioned:{cid}:{ante}:r4", f"okv2:conditioned:{cid}:{ante}:lxyz"]:
        with pytest.raises(ValueError):
            EntryKey.parse(text)


def test_the_empty_context_is_named_like_any_other():
    """A chunk first in its prompt and a chunk after the anchor are two contexts: two keys."""
    cid = chunk_cid(FP, LAYOUT, "t", [1])
    anchor = chunk_cid(FP, LAYOUT, "t", [0])
    first = EntryKey(cid, "canonical")
    after_anchor = EntryKey(cid, "canonical", antecedent_hash([anchor]))
    assert first.antecedent == EMPTY_ANTECEDENT == antecedent_hash([])
    assert first.to_str() != after_anchor.to_str()


def test_lineage_separates_exact_from_approximate_entries():
    cid = chunk_cid(FP, LAYOUT, "t", [1])
    ante = antecedent_hash([])
    exact = EntryKey(cid, "conditioned", ante)
    under_p = EntryKey(cid, "conditioned", ante, lineage="a" * 32)
    under_q = EntryKey(cid, "conditioned", ante, lineage="b" * 32)
    assert exact.is_exact and not under_p.is_exact
    assert len({exact.to_str(), under_p.to_str(), under_q.to_str()}) == 3


def test_lora_adapter_is_its_own_field():
    tokens = [1, 2, 3]
    base = chunk_cid(FP, LAYOUT, "t", tokens)
    a = chunk_cid(FP, LAYOUT, "t", tokens, lora="adapter-a")
    assert len({base, a, chunk_cid(FP, LAYOUT, "t", tokens, lora="adapter-b")}) == 3
    assert a != chunk_cid(FP, LAYOUT, "t", tokens, cache_salt="adapter-a")


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 2**31 - 1), max_size=64))
def test_keys_never_contain_prompt_text(tokens):
    cid = chunk_cid("secret model", "flash", "tenant secret", tokens)
    text = EntryKey(cid, "conditioned", antecedent_hash([cid])).to_str()
    assert set(text) <= set("okv2:conditioned0123456789abcdef")


def test_request_keys_name_the_entry_keys_of_their_lineage_context_and_rank():
    """The one key scheme: each name is the EntryKey string of its kind, with the request's
    lineage only on inherited conditioned entries and its rank only on patches."""
    cid, a, b = (chunk_cid(FP, LAYOUT, "t", [i]) for i in (1, 2, 3))
    ante, tag, ctx = antecedent_hash([a, b]), "c" * 32, antecedent_hash([a])
    keys = RequestKeys(lineage=tag, canonical_context=ctx, patch_rank=8)
    assert keys.conditioned(cid, ante) == EntryKey(cid, "conditioned", ante).to_str()
    assert keys.conditioned(cid, ante, is_inherited=True) == f"okv2:conditioned:{cid}:{ante}:l{tag}"
    assert keys.canonical(cid) == f"okv2:canonical:{cid}:{ctx}" == canonical_key(cid, ctx)
    assert keys.patch(cid, ante) == f"okv2:patch:{cid}:{ante}:r8" == patch_key(cid, ante, 8)
    assert keys.orbit_patch(cid, [b, a]) == patch_key(cid, orbit_key([a, b]), 8)
    assert keys.orbit_patch(cid, [b, a]) != keys.patch(cid, antecedent_hash([b, a]))
    assert conditioned_key(cid, ante, tag) == keys.conditioned(cid, ante, is_inherited=True)
    # An exact request with no context: canonicals in the empty context.
    assert RequestKeys().canonical(cid) == EntryKey(cid, "canonical", EMPTY_ANTECEDENT).to_str()


def test_anchor_context_is_the_antecedent_hash_of_the_anchor_chunk():
    anchor = [5, 6, 7]
    for tenant, salt, lora in (("", "", ""), ("t", "", ""), ("", "s", ""), ("", "", "ad")):
        want = antecedent_hash([chunk_cid(FP, LAYOUT, tenant, anchor, cache_salt=salt, lora=lora)])
        got = anchor_context(FP, LAYOUT, anchor, tenant=tenant, cache_salt=salt, lora=lora)
        assert got == want
    assert len({anchor_context(FP, LAYOUT, anchor, tenant=t) for t in ("", "t", "u")}) == 3
    assert anchor_context(FP, LAYOUT, ()) == EMPTY_ANTECEDENT


def test_keys_hash_the_documented_bytes():
    """The cid and the antecedent hash against an independent computation of their format (one
    field after another, every cid of a list on its own), so a faster implementation keeps every
    stored key."""
    import struct

    import xxhash
    from orbitkv.store.keys import KEY_VERSION, antecedent_hash, chunk_cid, orbit_key

    def field(tag: bytes, data: bytes) -> bytes:
        return tag + struct.pack("<Q", len(data)) + data

    def cid_ref(fp, layout, tenant, tokens, salt="", lora=""):
        h = xxhash.xxh3_128()
        for tag, value in ((b"V", KEY_VERSION), (b"F", fp), (b"L", layout), (b"S", tenant),
                           (b"C", salt), (b"R", lora)):
            h.update(field(tag, value.encode()))
        h.update(struct.pack("<Q", len(tokens)))
        h.update(field(b"T", b"".join(struct.pack("<q", t) for t in tokens)))
        return h.hexdigest()

    def list_ref(tag: bytes, cids):
        h = xxhash.xxh3_128()
        h.update(field(b"V", KEY_VERSION.encode()))
        h.update(tag + struct.pack("<Q", len(cids)))
        for c in cids:
            h.update(c.encode())
        return h.hexdigest()

    cids = [chunk_cid("fp", "flash", t, [1, 2, 3 + i], cache_salt=s)
            for i, (t, s) in enumerate([("", ""), ("a", ""), ("", "b"), ("a", "b")])]
    assert cids == [cid_ref("fp", "flash", t, [1, 2, 3 + i], salt=s)
                    for i, (t, s) in enumerate([("", ""), ("a", ""), ("", "b"), ("a", "b")])]
    for n in range(len(cids) + 1):
        assert antecedent_hash(cids[:n]) == list_ref(b"A", cids[:n])
        assert antecedent_hash(iter(cids[:n])) == list_ref(b"A", cids[:n])
    assert orbit_key(cids[::-1]) == list_ref(b"O", sorted(cids))
    with pytest.raises(ValueError, match="32 lowercase hex"):
        antecedent_hash([cids[0], cids[1].upper()])
    with pytest.raises(ValueError, match="32 lowercase hex"):
        antecedent_hash([cids[0], cids[1][:16], cids[1][16:]])


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**40), min_size=1, max_size=200),
    cut_seed=st.integers(0, 10_000),
    salt=st.sampled_from(["", "s"]),
)
def test_a_prompts_cids_in_one_pass_are_its_chunks_cids(tokens, cut_seed, salt):
    """``prompt_cids`` (the scheduler's one pass over a prompt) against ``chunk_cid`` chunk by chunk,
    text runs and whole-chunk placeholder runs alike; ``antecedent_hashes`` against
    ``antecedent_hash`` of every prefix."""
    import random

    from orbitkv.store.keys import antecedent_hashes, prompt_cids

    rng = random.Random(cut_seed)
    runs, pos = [], 0
    while pos < len(tokens):
        end = min(len(tokens), pos + rng.randint(1, 40))
        runs.append((pos, end, f"okv-content:{rng.randrange(4)}" if rng.random() < 0.3 else None))
        pos = end
    arr = np.asarray(tokens, dtype=np.int64)
    expected = [
        chunk_cid(FP, LAYOUT, "t", tokens[s:e], [(0, e - s, h)] if h else None, cache_salt=salt)
        for s, e, h in runs
    ]
    from array import array

    # vLLM's list, a numpy array, and the scheduler's array('q') (``chunking.prompt_tokens``).
    for ids in (tokens, arr, array("q", tokens)):
        assert prompt_cids(FP, LAYOUT, "t", ids, runs, cache_salt=salt) == expected
    assert antecedent_hashes(expected) == [
        antecedent_hash(expected[:i]) for i in range(len(expected) + 1)
    ]


def test_a_prompts_cids_reject_runs_outside_it_and_bad_antecedents():
    from orbitkv.store.keys import antecedent_hashes, prompt_cids

    for bad in ([(0, 4, None)], [(2, 2, None)], [(-1, 2, None)]):
        with pytest.raises(ValueError, match="bad chunk"):
            prompt_cids(FP, LAYOUT, "", [1, 2, 3], bad)
    good = chunk_cid(FP, LAYOUT, "", [1])
    with pytest.raises(ValueError, match="32 lowercase hex"):
        antecedent_hashes([good, good.upper()])
    with pytest.raises(ValueError, match="32 lowercase hex"):
        antecedent_hashes([good, good[:16], good[16:]])
    with pytest.raises(ValueError, match="32 lowercase hex"):
        antecedent_hashes([good, 7])  # type: ignore[list-item]
