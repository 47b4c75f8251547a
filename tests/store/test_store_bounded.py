"""The write-behind queues are bounded in bytes: a slow Redis never grows the process' memory.

Soak: a real redis-server behind a loopback proxy capped at 20 MiB/s, a memory tier of 8 MiB and
puts of 1 MiB entries as fast as the caller can make them. The bytes the Redis queue holds
(queued + being written) stay within ``write_queue_max_nbytes`` plus one entry, resident memory
within the memory budget plus the queue cap plus a stated margin, and no put or get raises.
"""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
import torch
from orbitkv.store.entry import make_entry
from orbitkv.store.keys import EntryKey
from orbitkv.store.tiered import TieredStore
from orbitkv.store.writeback import WriteBehind
from redis_server import has_redis
from slow_proxy import SlowProxy
from store_testing import FP, LAYOUT, cid_of

pytestmark = pytest.mark.skipif(not has_redis(), reason="redis-server not installed")

MIB = 1 << 20
MEMORY_NBYTES = 8 * MIB
QUEUE_MAX_NBYTES = 16 * MIB
# Resident memory may exceed memory tier + queue cap by this much: the entry being encoded, the
# allocator's free lists and torch's own buffers (measured: 10-25 MiB on this machine).
RSS_MARGIN_NBYTES = 48 * MIB


def _rss_nbytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _one_mib_entry():
    g = torch.Generator().manual_seed(0)
    tensors = {f"{kv}.{layer}": torch.randn(256, 8, 64, generator=g)  # 512 KiB each in fp32
               for layer in range(1) for kv in "kv"}
    return make_entry("canonical", tensors, model_fingerprint=FP, layout=LAYOUT)


class Sampler:
    """Samples resident memory and the Redis queue's held bytes every 5 ms on its own thread."""

    def __init__(self, writer: WriteBehind) -> None:
        self.writer = writer
        self.max_rss = self.max_held = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.max_rss = max(self.max_rss, _rss_nbytes())
            self.max_held = max(self.max_held, self.writer.held_nbytes)
            time.sleep(0.005)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


@pytest.mark.parametrize(
    "num_puts", [pytest.param(300, id="short"), pytest.param(3000, id="soak", marks=pytest.mark.slow)]
)
def test_slow_redis_holds_queue_and_memory_within_caps(redis_server, num_puts):
    entry = _one_mib_entry()
    with SlowProxy(redis_server.port, nbytes_per_s=20 * MIB) as proxy:
        store = TieredStore(
            memory_nbytes=MEMORY_NBYTES, redis_url=f"redis://127.0.0.1:{proxy.port}",
            write_queue_max_nbytes=QUEUE_MAX_NBYTES, num_writer_threads=1,
        )
        writer = store._writers[1]
        keys = [EntryKey(cid_of([i, i + 1]), "canonical") for i in range(num_puts)]
        rss_before = _rss_nbytes()
        started = time.monotonic()
        with Sampler(writer) as sampler:
            for i, key in enumerate(keys):
                store.put(key, entry)  # must never raise, nor block on Redis
                if i % 10 == 0:
                    assert store.get([key])[0] is not None  # reads go on (memory tier)
            elapsed_s = time.monotonic() - started
            store.flush(30.0)
        stats = store.stats()
        store.close()
    entry_nbytes = stats["memory.used_nbytes"] // max(stats["memory.num_entries"], 1)
    figures = {
        "num_puts": num_puts, "put_s": round(elapsed_s, 2),
        "rss_growth_mib": round((sampler.max_rss - rss_before) / MIB, 1),
        "max_held_mib": round(sampler.max_held / MIB, 1),
        "peak_held_mib": round(writer.peak_nbytes / MIB, 1),
        "redis_writes": stats["redis.writes"], "dropped_writes": stats.get("redis.queue.dropped_writes", 0),
    }
    print(json.dumps(figures))
    assert writer.peak_nbytes <= QUEUE_MAX_NBYTES + entry_nbytes
    assert sampler.max_held <= QUEUE_MAX_NBYTES + entry_nbytes
    assert sampler.max_rss - rss_before <= MEMORY_NBYTES + QUEUE_MAX_NBYTES + RSS_MARGIN_NBYTES
    # The link was the bottleneck: Redis took some writes and the queue dropped the rest.
    assert stats["redis.writes"] > 0
    assert stats["redis.queue.dropped_writes"] > 0
    assert stats["redis.queue.dropped_nbytes"] > 0


def test_write_behind_drops_oldest_writes_over_its_byte_cap():
    release = threading.Event()

    written: list[str] = []

    class Stalled:  # a tier that takes nothing until released: every write stays held
        name = "stalled"

        def batch_put(self, items):
            release.wait(5)
            written.extend(k for k, _ in items)

    writer = WriteBehind(Stalled(), queue_depth=1024, max_batch=1, max_queue_nbytes=10)
    writer.submit("k0", b"xxxx")
    deadline = time.monotonic() + 5
    while writer.depth and time.monotonic() < deadline:
        time.sleep(0.001)  # k0 is in flight now
    for i in range(1, 8):
        writer.submit(f"k{i}", b"xxxx")  # 4 bytes each: k0 in flight + one queued fit in 10
        assert writer.held_nbytes <= 10
    release.set()
    assert writer.flush(5)
    writer.close()
    # The first write was in flight; of the others only the newest survived the cap.
    assert written == ["k0", "k7"]
    assert writer.stats()["queue.dropped_nbytes"] == 6 * 4
    assert writer.held_nbytes == 0
