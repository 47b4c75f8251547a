"""Store fixtures: real redis-server processes on free ports (see tests/redis_server.py)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from redis_server import (  # noqa: E402
    RedisServer,
    redis_cluster_fixture,
    redis_server_fixture,
)


@pytest.fixture
def redis_server():
    """A fresh redis-server on a free loopback port; ``.url``, ``.kill()``, ``.start()``."""
    yield from redis_server_fixture()


@pytest.fixture(scope="module")
def redis_cluster():
    """A 3-master local Redis Cluster; ``.url`` is ``redis+cluster://127.0.0.1:PORT``."""
    yield from redis_cluster_fixture()


@pytest.fixture
def redis_password_server():
    with RedisServer(password="s3cret") as server:
        yield server
