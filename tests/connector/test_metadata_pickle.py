"""The metadata crosses to the worker process every step: each class pickles as a constructor call
on all its fields (``metadata.pickled_by_fields``), and comes back equal."""

from __future__ import annotations

import pickle
from array import array
from dataclasses import fields

import pytest
import torch
from orbitkv.connector.encoder.metadata import (
    EncoderLoad,
    OrbitKVECMetadata,
    OrbitKVECWorkerMeta,
)
from orbitkv.connector.metadata import (
    LoadSpec,
    OrbitKVMetadata,
    OrbitKVWorkerMeta,
    SaveSpec,
    StoredKey,
)

# Every field set away from its default: a field the reduction forgot would come back default.
LOAD = LoadSpec("r1", "okv2:conditioned:ab", "exact", 32, 4, array("q", [64, 65, 66]), [2, 3],
                "okv2:patch:cd", 17, 31)
SAVE = SaveSpec("r1", "cid1", 32, array("q", [70, 71]), ("a", "b"), "hash", {"exact": "k1"},
                True, 40, "tag", "okv2:canonical:ef")
STORED = StoredKey("okv2:conditioned:ab", "ab", 4096, ("a",))
CASES = [
    LOAD,
    SAVE,
    STORED,
    OrbitKVMetadata([LOAD], [SAVE], ["r0"]),
    OrbitKVWorkerMeta([STORED], ["cid1"], ["cid0"]),
    OrbitKVECMetadata([], {"mm1": ["okv2:encoder:12"]}),
    OrbitKVECWorkerMeta({"saved_items": 2.0}),
]


@pytest.mark.parametrize("value", CASES, ids=lambda v: type(v).__name__)
def test_metadata_pickles_as_its_fields_and_comes_back_equal(value):
    cls, args = value.__reduce__()
    assert cls is type(value)
    assert args == tuple(getattr(value, f.name) for f in fields(value))
    for f in fields(value):
        assert getattr(value, f.name) != f.default, f"{f.name} is at its default in the case"
    assert pickle.loads(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)) == value


def test_an_encoder_load_keeps_its_tensor():
    load = EncoderLoad("mm1", torch.arange(12, dtype=torch.bfloat16).reshape(3, 4))
    back = pickle.loads(pickle.dumps(OrbitKVECMetadata([load]), protocol=pickle.HIGHEST_PROTOCOL))
    assert back.loads[0].mm_hash == "mm1" and torch.equal(back.loads[0].output, load.output)
