"""Fixtures of the connector suite (helpers live in ``*_testlib.py``, imported by name)."""

from __future__ import annotations

import pytest
from halves_testlib import build_halves, release


@pytest.fixture
def halves():
    built = build_halves(patch_rank=0)
    yield built
    release(built)


@pytest.fixture
def patched_halves():
    built = build_halves(patch_rank=8)
    yield built
    release(built)
