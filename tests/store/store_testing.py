"""Helpers shared by the store tests (importable by spawned worker processes too)."""

from __future__ import annotations

import random

import torch
from orbitkv.store.entry import CorruptEntry, decode, encode, make_entry
from orbitkv.store.keys import EntryKey, antecedent_hash, chunk_cid

FP = "model-fp-test"
LAYOUT = "flash"


def cid_of(tokens, tenant: str = "tenant-a") -> str:
    return chunk_cid(FP, LAYOUT, tenant, tokens)


def tensors(num_layers: int = 2, num_tokens: int = 4, heads: int = 2, dim: int = 8, seed: int = 0,
            dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer in range(num_layers):
        out[f"k.{layer}"] = torch.randn(num_tokens, heads, dim, generator=g).to(dtype)
        out[f"v.{layer}"] = torch.randn(num_tokens, heads, dim, generator=g).to(dtype)
    return out


def canonical(seed: int = 0, fp: str = FP, **kw):
    return make_entry("canonical", tensors(seed=seed, **kw), model_fingerprint=fp, layout=LAYOUT)


def conditioned(cid_antecedent: list[str], seed: int = 0, **kw):
    return make_entry("conditioned", tensors(seed=seed, **kw), model_fingerprint=FP, layout=LAYOUT,
                      antecedent=cid_antecedent, start_pos=16)


def canonical_key(seed: int) -> EntryKey:
    return EntryKey(cid_of([seed, seed + 1, seed + 2]), "canonical")


def conditioned_key(cid: str, antecedent: list[str]) -> EntryKey:
    return EntryKey(cid, "conditioned", antecedent_hash(antecedent))


def same_tensors(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def shared_worker(disk_dir: str, redis_url: str, worker_id: int, num_rounds: int) -> dict:
    """One process of the two-process test: writes and reads the same keys as its peer.

    Both workers write the same 8 keys with content that depends on the writer, and read them back
    through their own stores and the raw backends; every read must verify (no torn entry).
    """
    from orbitkv.store.disk import DiskBackend
    from orbitkv.store.redis_backend import RedisBackend

    rng = random.Random(worker_id)
    disk = DiskBackend(disk_dir, 64 << 20)
    remote = RedisBackend(redis_url, socket_timeout_s=2.0)
    num_reads = num_corrupt = 0
    keys = [canonical_key(i).to_str() for i in range(8)]
    for _ in range(num_rounds):
        key = rng.choice(keys)
        value = encode(canonical(seed=rng.randrange(1 << 30), num_tokens=rng.randint(1, 32)))
        disk.batch_put([(key, value)])
        remote.batch_put([(key, value)])
        for backend in (disk, remote):
            for got in backend.batch_get(keys):
                if got is None:
                    continue
                num_reads += 1
                try:
                    decode(got, expect_fingerprint=FP)
                except CorruptEntry:
                    num_corrupt += 1
    remote.close()
    return {"num_reads": num_reads, "num_corrupt": num_corrupt,
            "errors": disk.stats().get("errors", 0) + remote.stats().get("errors", 0)}


def index_worker(disk_dir: str, redis_url: str, worker_id: int, num_adds: int, barrier) -> dict:
    """One process of the concurrent survivor-index test: adds its own antecedents to one CID.

    Each conditioned put adds ``(cid_of([1000 * worker_id + i]),)`` to the index of ``cid_of([0])``
    in memory, disk (shared directory) and Redis (shared server); the peer does the same at once.
    """
    from orbitkv.store.tiered import TieredStore

    b = cid_of([0])
    with TieredStore(memory_nbytes=1 << 20, disk_dir=disk_dir, disk_nbytes=64 << 20, is_disk_fsync=False,
                     redis_url=redis_url, redis_socket_timeout_s=5.0, max_antecedents_per_cid=256,
                     max_write_batch=1) as store:
        barrier.wait(timeout=120)
        for i in range(num_adds):
            ante = [cid_of([1000 * worker_id + i])]
            store.put(conditioned_key(b, ante), conditioned(ante, num_layers=1, num_tokens=1))
        is_flushed = store.flush(60)
        stats = store.stats()
    return {"worker": worker_id, "is_flushed": is_flushed, "errors": stats["errors"],
            "dropped": stats["dropped_writes"]}


def disk_budget_worker(disk_dir: str, worker_id: int, num_puts: int, budget_nbytes: int,
                       value_nbytes: int, barrier) -> dict:
    """One replica of the shared-directory budget test: puts its own keys into the directory,
    once every replica has opened it (as replicas that run side by side)."""
    from orbitkv.store.disk import DiskBackend

    disk = DiskBackend(disk_dir, budget_nbytes, is_fsync=False)
    barrier.wait()
    for i in range(num_puts):
        disk.batch_put([(f"w{worker_id}-{i}", random.randbytes(value_nbytes))])
    stats = disk.stats()
    disk.close()
    return {"writes": stats["writes"], "evictions": stats["evictions"], "errors": stats["errors"]}
