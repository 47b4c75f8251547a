"""TieredStore: tiers, promotion, integrity, tenancy, survivor index, queue, pins, config."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch
from orbitkv.store.base import Backend
from orbitkv.store.entry import FORMAT_VERSION, encode
from orbitkv.store.keys import EntryKey, chunk_cid
from orbitkv.store.memory import MemoryBackend
from orbitkv.store.settings import StoreSettings
from orbitkv.store.tiered import TieredStore
from store_testing import (
    FP,
    canonical,
    canonical_key,
    cid_of,
    conditioned,
    conditioned_key,
    same_tensors,
)


@pytest.fixture
def store(tmp_path):
    s = TieredStore(memory_nbytes=1 << 20, disk_dir=str(tmp_path / "disk"), disk_nbytes=4 << 20,
                    is_disk_fsync=False)
    yield s
    s.close()


def test_put_get_lookup_and_promotion(store, tmp_path):
    key, e = canonical_key(1), canonical(seed=1)
    store.put(key, e)
    assert store.lookup([key, canonical_key(2)]) == ["memory", None]
    assert same_tensors(store.get([key])[0].tensors, e.tensors)
    store.flush()
    store.memory.batch_delete([key.to_str()])
    assert store.lookup([key]) == ["disk"]
    got = store.get([key], expect_fingerprint=FP, layers=[1])[0]
    assert set(got.tensors) == {"k.1", "v.1"}
    assert store.lookup([key]) == ["memory"]  # promoted
    s = store.stats()
    assert s["hits.disk"] == 1 and s["promotions"] == 1 and s["disk.written_nbytes"] > 0


def test_open_streams_layers_from_disk_mmap(store):
    key, e = canonical_key(2), canonical(seed=2, num_layers=3)
    store.put(key, e)
    store.flush()
    store.memory.batch_delete([key.to_str()])
    with store.open(key, expect_fingerprint=FP) as reader:
        assert reader.tier == "disk" and reader.layers == [0, 1, 2]
        for layer in reader.layers:
            got = reader.read(layer)
            assert same_tensors(got, {n: e.tensors[n] for n in (f"k.{layer}", f"v.{layer}")})
    assert store.open(canonical_key(77)) is None
    disk = store.tiers[1]
    disk.batch_put([(key.to_str(), b"junk")])
    assert store.open(key) is None and disk.batch_exists([key.to_str()]) == [False]
    assert store.stats()["corrupt.disk"] == 1


def test_embedded_default_restart_keeps_entries(tmp_path):
    kw = dict(memory_nbytes=1 << 20, disk_dir=str(tmp_path), disk_nbytes=1 << 20)
    with TieredStore(**kw) as first:
        assert first.tier_names == ["memory", "disk"]
        first.put(canonical_key(3), canonical(seed=3))
    with TieredStore(**kw) as second:
        assert same_tensors(second.get([canonical_key(3)])[0].tensors, canonical(seed=3).tensors)


@pytest.mark.parametrize("tier", ["memory", "disk"])
@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign", "newer"])
def test_bad_entry_is_miss_deleted_and_counted(store, tier, damage):
    key = canonical_key(4)
    good = encode(canonical(seed=4))
    bad = {
        "flip": good[:-1] + bytes([good[-1] ^ 1]),
        "truncate": good[: len(good) // 2],
        "foreign": encode(canonical(seed=4, fp="another-model")),
        "newer": good.replace(f'"version":"{FORMAT_VERSION}"'.encode(),
                              f'"version":"{FORMAT_VERSION + 1}"'.encode()),
    }[damage]
    backend = store.tiers[store.tier_names.index(tier)]
    backend.batch_put([(key.to_str(), bad)])
    assert store.get([key], expect_fingerprint=FP) == [None]
    assert backend.batch_exists([key.to_str()]) == [False]
    assert store.stats()[f"corrupt.{tier}"] == 1 and store.stats()["corrupt"] == 1


def test_corrupt_upper_copy_falls_through_to_good_lower_copy(store):
    key, e = canonical_key(5), canonical(seed=5)
    store.put(key, e)
    store.flush()
    store.memory.batch_put([(key.to_str(), b"garbage")])
    assert same_tensors(store.get([key])[0].tensors, e.tensors)
    assert store.stats()["corrupt.memory"] == 1
    assert store.lookup([key]) == ["memory"]  # the good copy was promoted back


def test_put_refuses_a_key_that_disagrees_with_its_entry(store):
    b, a = cid_of([1]), cid_of([2])
    with pytest.raises(ValueError):
        store.put(EntryKey(b, "canonical"), conditioned([a]))
    with pytest.raises(ValueError):
        store.put(conditioned_key(b, [b]), conditioned([a]))


def test_tenants_are_isolated(store):
    tokens = [7, 8, 9]
    key_a = EntryKey(chunk_cid(FP, "flash", "tenant-a", tokens), "canonical")
    key_b = EntryKey(chunk_cid(FP, "flash", "tenant-b", tokens), "canonical")
    store.put(key_a, canonical(seed=7))
    store.flush()
    assert store.lookup([key_a, key_b]) == ["memory", None]
    assert store.get([key_b]) == [None]
    assert store.batch_antecedents([key_b.cid]) == [[]]


def test_batch_antecedents_survive_restart(tmp_path):
    kw = dict(memory_nbytes=1 << 20, disk_dir=str(tmp_path), disk_nbytes=4 << 20)
    sys_, img1, img2, b = (cid_of([i]) for i in (100, 101, 102, 103))
    with TieredStore(**kw) as first:
        first.put(conditioned_key(b, [sys_, img1, img2]), conditioned([sys_, img1, img2]))
        first.put(conditioned_key(b, [sys_, img2]), conditioned([sys_, img2]))
        first.put(conditioned_key(b, [sys_, img2]), conditioned([sys_, img2]))  # no duplicate
        assert first.batch_antecedents([b, sys_]) == [[(sys_, img1, img2), (sys_, img2)], []]
    with TieredStore(**kw) as second:
        # Background writer threads may land the disk copy's additions in either order.
        (found,) = second.batch_antecedents([b])
        assert sorted(found) == sorted([(sys_, img1, img2), (sys_, img2)])
        second.put(conditioned_key(b, [img1]), conditioned([img1]))
        (found,) = second.batch_antecedents([b])
        assert sorted(found) == sorted([(sys_, img1, img2), (sys_, img2), (img1,)])


def test_antecedent_index_is_capped(tmp_path):
    b = cid_of([1])
    with TieredStore(memory_nbytes=1 << 20, max_antecedents_per_cid=3) as store:
        for i in range(5):
            store.put(conditioned_key(b, [cid_of([i + 10])]), conditioned([cid_of([i + 10])]))
        assert store.batch_antecedents([b]) == [[(cid_of([i + 10]),) for i in (2, 3, 4)]]


class _SlowBackend(MemoryBackend):
    """A lower tier that blocks its writer until released."""

    name = "slow"

    def __init__(self) -> None:
        super().__init__(1 << 30)
        self.gate = threading.Event()

    def batch_put(self, items):
        self.gate.wait(10)
        super().batch_put(items)


def test_full_queue_drops_oldest_never_blocks():
    slow = _SlowBackend()
    store = TieredStore(backends=[MemoryBackend(1 << 20), slow], write_queue_depth=4,
                        num_writer_threads=1, max_write_batch=1)
    start = time.monotonic()
    for i in range(12):
        store.put_bytes([(f"k{i}", b"v")])
    assert time.monotonic() - start < 1.0
    slow.gate.set()
    assert store.flush(10)
    stored = set(slow.iter_keys())
    assert {"k8", "k9", "k10", "k11"} <= stored and "k1" not in stored
    assert store.stats()["slow.queue.dropped_writes"] >= 7
    store.close()


def test_pins_through_the_store():
    store = TieredStore(memory_nbytes=3000)
    key = canonical_key(9)
    store.pin([key])
    store.put(key, canonical(seed=9))
    assert store.pin_count(key) == 1
    for i in range(10):
        store.put_bytes([(f"filler{i}", bytes(900))])
    assert store.lookup([key]) == ["memory"]
    store.unpin([key])
    assert store.pin_count(key) == 0
    store.put_bytes([(f"more{i}", bytes(900)) for i in range(4)])
    assert store.lookup([key]) == [None]
    memless = TieredStore(backends=[_SlowBackend()])
    memless.pin([key])
    assert memless.pin_count(key) == 1


def test_memory_budget_soak(tmp_path):
    budget = 100_000
    with TieredStore(memory_nbytes=budget, disk_dir=str(tmp_path), disk_nbytes=2 * budget,
                     is_disk_fsync=False) as store:
        for i in range(200):
            store.put(canonical_key(i), canonical(seed=i, num_tokens=8))
        store.flush()
        s = store.stats()
    assert 0.95 * budget <= s["memory.used_nbytes"] <= budget
    assert 0.95 * 2 * budget <= s["disk.used_nbytes"] <= 2 * budget
    assert s["memory.evictions"] > 0 and s["disk.evictions"] > 0


@dataclasses.dataclass(frozen=True)
class _FakeConfig:
    chunk_size: int = 256
    local_cpu: bool = True
    max_local_cpu_size: float = 0.001
    local_disk: str | None = None
    max_local_disk_size: float = 0.002
    remote_url: str | None = None
    cache_policy: str = "LRU"
    remote_ttl_s: float | None = 60.0


def test_from_config(tmp_path):
    cfg = _FakeConfig(local_disk=f"file://{tmp_path}/cache")
    with TieredStore.from_config(cfg) as store:
        assert store.tier_names == ["memory", "disk"]
        assert store.settings.memory_nbytes == int(0.001 * (1 << 30))
        assert store.settings.disk_dir == f"{tmp_path}/cache" and store.settings.redis_ttl_s == 60
    with TieredStore(cfg, is_disk_fsync=False) as store:
        assert not store.settings.is_disk_fsync
    assert StoreSettings.from_config(_FakeConfig(remote_url="redis://h:1")).redis_url == "redis://h:1"
    with pytest.raises(ValueError, match="LFU"):
        StoreSettings.from_config(_FakeConfig(cache_policy="LFU"))


def test_from_real_orbitkv_config(tmp_path):
    config = pytest.importorskip("orbitkv.config")
    cfg = config.OrbitKVConfig.load(overrides={
        "local_disk": f"file://{tmp_path}/d", "max_local_disk_size": 0.001,
        "max_local_cpu_size": 0.002, "remote_url": "redis+cluster://127.0.0.1:7000,127.0.0.1:7001"})
    s = StoreSettings.from_config(cfg)
    assert (s.memory_nbytes, s.disk_nbytes) == (cfg.local_cpu_nbytes, cfg.local_disk_nbytes)
    assert s.disk_dir == f"{tmp_path}/d" and s.redis_url == cfg.remote_url


def test_backend_interface_is_small():
    abstract = sorted(Backend.__abstractmethods__)
    assert abstract == ["batch_delete", "batch_exists", "batch_get", "batch_put", "iter_keys"]


def _no_hashing(monkeypatch):
    from orbitkv.store import entry_decode as entry_mod

    def refuse(*args, **kwargs):
        raise AssertionError("a verified memory hit was hashed again")

    monkeypatch.setattr(entry_mod, "copy_hash", refuse)
    monkeypatch.setattr(entry_mod, "_first_bad", refuse)


def test_memory_hits_are_not_verified_again_and_are_private(store, monkeypatch):
    key, e = canonical_key(40), canonical(seed=40, dtype=torch.float32)
    store.put(key, e)
    store.flush()
    with monkeypatch.context() as m:
        _no_hashing(m)
        got = store.get([key])[0]
        assert same_tensors(got.tensors, e.tensors)
        for t in got.tensors.values():
            t.fill_(7)  # the caller's own copy
        assert same_tensors(store.get([key], layers=[1])[0].tensors, {n: e.tensors[n] for n in ("k.1", "v.1")})
    # A disk hit is verified, and promoted with what verified it: the memory hit after it is not.
    store.memory.batch_delete([key.to_str()])
    assert same_tensors(store.get([key], layers=[0])[0].tensors, {n: e.tensors[n] for n in ("k.0", "v.0")})
    with monkeypatch.context() as m:
        _no_hashing(m)
        assert same_tensors(store.get([key])[0].tensors, e.tensors)


def test_put_bytes_into_memory_are_verified_whole_on_first_read(store):
    key = canonical_key(41)
    bad = bytearray(encode(canonical(seed=41, num_layers=2)))
    bad[-1] ^= 1  # damage the last tensor in data order, then read another layer only
    store.put_bytes([(key.to_str(), bytes(bad))])
    store.flush()
    store.tiers[1].batch_delete([key.to_str()])
    last = max(n for n in canonical(num_layers=2).tensors)  # a name; any layer other than its own
    other_layer = 1 - int(last.split(".")[1])
    assert store.get([key], layers=[other_layer]) == [None]
    assert store.stats()["corrupt.memory"] == 1 and store.lookup([key]) == [None]
    good = encode(canonical(seed=41))
    store.put_bytes([(key.to_str(), bytearray(good))])  # a mutable buffer is copied, then verified once
    assert same_tensors(store.get([key])[0].tensors, canonical(seed=41).tensors)


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_disk_only_store_reads_files_straight_into_tensors(tmp_path, damage):
    with TieredStore(is_memory=False, disk_dir=str(tmp_path), disk_nbytes=4 << 20, is_disk_fsync=False) as store:
        key, e = canonical_key(42), canonical(seed=42, num_layers=3)
        store.put(key, e)
        assert store.flush()
        assert same_tensors(store.get([key])[0].tensors, e.tensors)
        assert same_tensors(store.get([key], layers=2)[0].tensors, {n: e.tensors[n] for n in ("k.2", "v.2")})
        path = next(p for p in tmp_path.rglob("*") if p.is_file() and "canonical" in p.name)
        data = bytearray(path.read_bytes())
        if damage == "flip":
            data[-3] ^= 0xFF
        else:
            del data[-3:]
        path.write_bytes(bytes(data))
        assert store.get([key, canonical_key(43)]) == [None, None]
        assert store.stats()["corrupt.disk"] == 1 and not path.exists()
        assert store.stats()["disk.hits"] == 3 and store.stats()["disk.misses"] == 1


def test_an_empty_file_a_crash_left_is_a_miss_and_written_again(tmp_path):
    """Disk entries are written without fsync by default (``disk_fsync``): after a crash a renamed
    file may be empty. It reads as a miss, the lookup forgets it, and the next save replaces it."""
    with TieredStore(is_memory=False, disk_dir=str(tmp_path), disk_nbytes=4 << 20) as store:
        assert not store.settings.is_disk_fsync
        key, e = canonical_key(44), canonical(seed=44, num_layers=3)
        store.put(key, e)
        assert store.flush()
        path = next(p for p in tmp_path.rglob("*") if p.is_file() and "canonical" in p.name)
        path.write_bytes(b"")
        assert store.get([key]) == [None]
        assert store.lookup([key]) == [None]
        store.put(key, e)
        assert store.flush()
        assert path.stat().st_size > 0
        assert same_tensors(store.get([key])[0].tensors, e.tensors)


def test_memory_hits_keep_the_disk_copy_recent(tmp_path):
    """The hottest entry, served from memory, is not the disk tier's first eviction, and its
    recency survives a restart (the index is rebuilt from file times)."""
    entries = [(canonical_key(100 + i), canonical(seed=100 + i)) for i in range(4)]
    nbytes = len(encode(entries[0][1]))
    disk_dir = str(tmp_path / "lru")
    store = TieredStore(memory_nbytes=1 << 20, disk_dir=disk_dir, disk_nbytes=3 * nbytes + 16,
                        is_disk_fsync=False, refresh_interval_s=0.0)
    hot = entries[0][0]
    for key, entry in entries[:3]:
        store.put(key, entry)
        store.flush()
        time.sleep(0.01)  # distinct file times
    assert store.get([hot])[0] is not None  # a memory hit
    store.flush()
    store.put(*entries[3])  # over the disk budget: the least recently used file goes
    store.flush()
    disk = store.tiers[1]
    keys = [k.to_str() for k, _ in entries]
    assert disk.batch_exists(keys) == [True, False, True, True]
    store.close()
    restarted = TieredStore(is_memory=False, disk_dir=disk_dir, disk_nbytes=3 * nbytes + 16,
                            is_disk_fsync=False)
    assert list(restarted.tiers[0]._index)[-1] == keys[3]
    assert list(restarted.tiers[0]._index)[0] == keys[2]  # hot was touched after entry 2
    restarted.close()


def test_a_load_right_after_the_put_refreshes_nothing_below(tmp_path, monkeypatch):
    """A put writes every tier: the entry is fresh below for ``refresh_interval_s``, so its first
    memory hit (a chunk saved one step and loaded the next) queues no refresh; once the interval
    passed, a hit does."""
    store = TieredStore(memory_nbytes=1 << 20, disk_dir=str(tmp_path / "d"), is_disk_fsync=False,
                        refresh_interval_s=30.0)
    try:
        key, entry = canonical_key(300), canonical(seed=300)
        store.put(key, entry)
        store.flush()
        writer = store._writers[1]
        submitted = []
        real = writer.submit
        monkeypatch.setattr(
            writer, "submit", lambda *a, **k: (submitted.append(a[0]), real(*a, **k))
        )
        assert store.get([key])[0] is not None  # a memory hit
        assert submitted == []
        store._refreshed.interval_s = 0.0  # as if the interval had passed
        assert store.get([key])[0] is not None
        assert submitted == [key.to_str()]
    finally:
        store.close()


@pytest.mark.redis
def test_a_redis_that_restarted_empty_is_refilled_by_use(redis_server):
    cid = cid_of([7, 8, 9])
    ante = [cid_of([1, 2, 3])]
    key, entry = conditioned_key(cid, ante), conditioned(ante, seed=5)
    other_key, other = canonical_key(200), canonical(seed=200)
    store = TieredStore(memory_nbytes=1 << 20, redis_url=redis_server.url, refresh_interval_s=0.0)
    store.put(key, entry)
    store.put(other_key, other)
    store.flush()
    redis_server.kill()
    redis_server.start()  # no persistence: it comes back empty
    fresh = TieredStore(is_memory=False, redis_url=redis_server.url)
    assert fresh.lookup([key, other_key]) == [None, None]
    assert store.get([key])[0] is not None  # used again: served from memory, refilled below
    store.flush()
    assert fresh.lookup([key, other_key]) == ["redis", None]  # only what was used
    assert same_tensors(fresh.get([key])[0].tensors, entry.tensors)
    assert fresh.batch_antecedents([cid]) == [[tuple(ante)]]  # survivor index line too
    stats = store.stats()
    assert stats["redis.queue.refilled"] == 1
    fresh.close()
    store.close()
