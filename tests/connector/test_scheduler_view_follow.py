"""The scheduler's view of the store starts its disk tier's follower only where the worker writes
from another process (``reported.SchedulerView``, ``DiskBackend.follow_other_writers``)."""

from __future__ import annotations

import threading

import pytest
from orbitkv.connector import runtime
from orbitkv.connector.scheduler.reported import ReportedIndex, SchedulerView

from orbitkv.config import OrbitKVConfig

FOLLOWER = "orbitkv-disk-follower"


def _followers() -> int:
    return [t.name for t in threading.enumerate()].count(FOLLOWER)


@pytest.mark.parametrize("has_worker", [False, True])
def test_a_disk_tier_is_followed_only_for_a_worker_in_another_process(tmp_path, has_worker):
    config = OrbitKVConfig(
        local_cpu=True, max_local_cpu_size=0.01, local_disk=f"file://{tmp_path}",
        max_local_disk_size=0.01,
    )
    before = _followers()
    shared = runtime.acquire(config)
    try:
        shared.has_worker = has_worker
        view = SchedulerView(shared, ReportedIndex(1 << 20))
        assert view.lookup(["okv2:absent"]) == [None]
        view.lookup(["okv2:absent"])
        assert _followers() == before + (0 if has_worker else 1)
    finally:
        runtime.release(shared)
    assert _followers() == before
