"""Replicas share KV only when they serve the same model the same way: the fingerprint in every key.

Real vLLM configs (``EngineArgs(...).create_engine_config()``) of the tiny qwen2: the same options
give the same fingerprint (two replicas of a fleet); another path, dtype, weight quantization or
load format gives another, so their entries are never even looked up.
"""

from __future__ import annotations

import shutil

import pytest


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from orbitkv.models.make_model import make_model

    return make_model(tmp_path_factory.mktemp("model") / "qwen2", "qwen2")


def fingerprint(model, **options) -> str:
    from orbitkv.connector.identity import model_identity
    from vllm.engine.arg_utils import EngineArgs

    cfg = EngineArgs(model=str(model), max_model_len=512, enforce_eager=True, **options).create_engine_config()
    return model_identity(cfg, None).model_fingerprint


@pytest.mark.vllm
def test_only_the_same_model_served_the_same_way_shares_kv(model_dir, tmp_path):
    base = fingerprint(model_dir)
    assert fingerprint(model_dir) == base  # a second replica with the same options
    copy = shutil.copytree(model_dir, tmp_path / "elsewhere")
    others = {
        "path": fingerprint(copy),
        "dtype": fingerprint(model_dir, dtype="float32"),
        "fp8 weights": fingerprint(model_dir, quantization="fp8"),
        "dummy weights": fingerprint(model_dir, load_format="dummy"),
    }
    assert base not in others.values() and len(set(others.values())) == len(others), others
