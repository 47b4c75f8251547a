"""Fixtures of the routing suite: a real redis-server (tests/redis_server.py)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from redis_server import redis_server_fixture  # noqa: E402


@pytest.fixture
def redis_server():
    yield from redis_server_fixture()
