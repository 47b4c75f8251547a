"""Deployment tests: the shipped compose file, Dockerfiles and configs, and the fleet they describe."""

from __future__ import annotations

import os
import sys

import pytest

# tests/redis_server.py, shared with the other suites.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory):
    """A tiny qwen2 with seeded safetensors weights: every replica loads the same weights."""
    from orbitkv.models.make_model import make_model

    models = tmp_path_factory.mktemp("models")
    make_model(models / "qwen2", "qwen2")
    return models
