"""``orbitkv bench store``: put/get throughput of each store tier next to raw I/O of the same bytes.

Each tier is measured through ``TieredStore`` with that one tier, so a put includes encoding the
entry (safetensors header, per-tensor xxh3 digests) and, for disk and Redis, the write-behind hand-off
(timed as put + flush); a get includes the read, the checksum verification and building the tensors.
The baselines run in the same process on the same bytes (the encoded entry):

- memory: ``numpy.copyto`` of the bytes (one thread's memcpy), for put and for get. A put must keep
  a private snapshot and a get must hand out tensors the caller owns, so both write into memory that
  did not exist before the call: each memory row also reports ``alloc_baseline_gbps`` and
  ``ratio_alloc``, against ``numpy.empty`` + ``copyto`` (fresh memory, its page faults included);
- disk: ``open().write()`` (+ ``fsync`` when the tier fsyncs) and ``open().read()``. Reads are timed
  twice: ``cold``, after ``posix_fadvise(DONTNEED)`` on every file (residency checked with ``mincore``
  and reported as ``resident_fraction``), and ``warm``, from the page cache;
- redis: redis-py ``SET`` / ``GET`` of the same bytes on the same server.

Each row: ``tier, op, nbytes, gbps, baseline, baseline_gbps, ratio`` (``gbps / baseline_gbps``; GB is
1e9 bytes, ``nbytes`` the KV payload). A redis-server is started on a free loopback port unless
``--redis-url`` is given.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import json
import mmap
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

MIB = 1 << 20
SIZES_MIB = (1, 8, 64)
NUM_LAYERS, NUM_HEADS, HEAD_DIM = 4, 8, 128  # 8 bf16 tensors of [T, 8, 128]: 16 KiB per token


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="orbitkv bench store", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.add_argument("--redis-url", help="use this Redis instead of starting a redis-server")
    p.add_argument("--quick", action="store_true", help="1 MiB only, few repetitions (for tests)")
    p.add_argument(
        "--dir", default=None, help="where the disk tier and raw files go (default: tmp)"
    )
    p.add_argument("--min-time-s", type=float, default=None, help="time per measurement")
    return p


def make_entry(nbytes: int, seed: int = 0) -> Any:
    from orbitkv.store.entry import make_entry as build

    num_tokens = max(1, nbytes // (2 * NUM_LAYERS * NUM_HEADS * HEAD_DIM * 2))
    g = torch.Generator().manual_seed(seed)
    tensors = {
        f"{p}.{layer}": torch.randn(num_tokens, NUM_HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)
        for p in "kv"
        for layer in range(NUM_LAYERS)
    }
    return build("canonical", tensors, model_fingerprint="bench-store", layout="flash")


def measure(
    fn: Callable[[], Any],
    *,
    setup: Callable[[], Any] | None = None,
    min_time_s: float,
    min_reps: int,
    max_reps: int,
) -> tuple[float, int]:
    """Mean seconds per call of ``fn`` (``setup`` runs untimed before each call), and the count.

    Two untimed calls first, for the tier and its baseline alike: what is measured is a running
    process, not its first calls, which fault in fresh buffers (with transparent huge pages the
    kernel may first compact memory: measured 0.3 s for one 64 MiB buffer here). Two, because a
    put allocates while the value it replaces is still held: steady state has two buffers.
    """
    for _ in range(2):
        if setup is not None:
            setup()
        fn()
    total_s, reps = 0.0, 0
    while reps < min_reps or (total_s < min_time_s and reps < max_reps):
        if setup is not None:
            setup()
        start = time.perf_counter()
        fn()
        total_s += time.perf_counter() - start
        reps += 1
    return total_s / reps, reps


def _libc() -> Any:
    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name, use_errno=True) if name else None


_LIBC = _libc()


def resident_fraction(path: str) -> float | None:
    """Fraction of the file's pages in the page cache (``mincore``), or None where unavailable."""
    if _LIBC is None:
        return None
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                return 0.0
            with mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as mm:
                page = mmap.PAGESIZE
                num_pages = (size + page - 1) // page
                vec = (ctypes.c_ubyte * num_pages)()
                addr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
                if _LIBC.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) != 0:
                    return None
                return sum(v & 1 for v in vec) / num_pages
    except (OSError, ValueError, AttributeError):
        return None


def drop_page_cache(root: str) -> bool:
    """``posix_fadvise(DONTNEED)`` on every file under ``root``; False if the kernel refused."""
    is_ok = True
    for dirpath, _, names in os.walk(root):
        for name in names:
            try:
                fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            except OSError:
                continue  # a writer's temp file renamed away meanwhile
            try:
                os.fdatasync(fd)  # dirty pages are not dropped; make them clean first
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            except OSError:
                is_ok = False
            finally:
                os.close(fd)
    return is_ok


@contextlib.contextmanager
def redis_server() -> Iterator[str]:
    """A private redis-server on a free loopback port, without persistence."""
    binary = shutil.which("redis-server") or "/usr/bin/redis-server"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workdir = tempfile.mkdtemp(prefix="orbitkv-bench-redis-")
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--dir", workdir, "--loglevel", "warning"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        import redis

        client = redis.Redis(port=port, socket_connect_timeout=0.2)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.exceptions.ConnectionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.05)
        client.close()
        yield f"redis://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)


def _row(
    tier: str, op: str, nbytes: int, store_s: float, base_s: float, baseline: str, **extra: Any
) -> dict:
    gbps, base_gbps = nbytes / store_s / 1e9, nbytes / base_s / 1e9
    return {"tier": tier, "op": op, "nbytes": nbytes, "gbps": _sig(gbps), "baseline": baseline,
            "baseline_gbps": _sig(base_gbps), "ratio": _sig(gbps / base_gbps), **extra}


def _alloc_extra(nbytes: int, store_s: float, alloc_s: float) -> dict[str, float]:
    """The memory rows' second baseline: a memcpy into freshly allocated memory."""
    return {"alloc_baseline_gbps": _sig(nbytes / alloc_s / 1e9), "ratio_alloc": _sig(alloc_s / store_s)}


def _sig(x: float) -> float:
    return float(f"{x:.5g}")


def bench_tier(
    tier: str, backend: Any, nbytes: int, raw: dict[str, Any], timing: dict[str, Any]
) -> list[dict]:
    from orbitkv.store import TieredStore
    from orbitkv.store.entry import encode
    from orbitkv.store.keys import EntryKey, chunk_cid

    entry = make_entry(nbytes)
    key = EntryKey(chunk_cid("bench-store", "flash", "", [nbytes]), "canonical")
    payload = encode(entry)
    store = TieredStore(backends=[backend])
    rows = []
    try:

        def put() -> None:
            store.put(key, entry)
            if not store.flush(60):
                raise RuntimeError(f"{tier}: background write did not finish")

        def get() -> None:
            if store.get([key])[0] is None:
                raise RuntimeError(f"{tier}: the entry just written was not read back")

        put_s, put_reps = measure(put, **timing)
        if tier == "memory":
            src = np.frombuffer(payload, dtype=np.uint8)
            dst = np.empty_like(src)

            def alloc_copy() -> None:
                np.copyto(np.empty_like(src), src)

            base_s, _ = measure(lambda: np.copyto(dst, src), **timing)
            alloc_s, _ = measure(alloc_copy, **timing)
            rows.append(_row(tier, "put", nbytes, put_s, base_s, "memcpy", reps=put_reps,
                             **_alloc_extra(nbytes, put_s, alloc_s)))
            get_s, get_reps = measure(get, **timing)
            base_s, _ = measure(lambda: np.copyto(dst, src), **timing)
            alloc_s, _ = measure(alloc_copy, **timing)
            rows.append(_row(tier, "get", nbytes, get_s, base_s, "memcpy", reps=get_reps,
                             **_alloc_extra(nbytes, get_s, alloc_s)))
        elif tier == "disk":
            path = os.path.join(raw["dir"], f"raw-{nbytes}")

            def raw_write() -> None:
                with open(path, "wb") as f:
                    f.write(payload)
                    if raw["is_fsync"]:
                        f.flush()
                        os.fsync(f.fileno())

            def raw_read() -> None:
                with open(path, "rb") as f:
                    f.read()

            base_s, _ = measure(raw_write, **timing)
            name = "write+fsync" if raw["is_fsync"] else "write"
            rows.append(_row(tier, "put", nbytes, put_s, base_s, name, reps=put_reps))

            def drop() -> None:
                drop_page_cache(raw["root"])

            get_s, get_reps = measure(get, setup=drop, **timing)
            drop()
            resident = [
                resident_fraction(os.path.join(d, n))
                for d, _, ns in os.walk(raw["root"])
                for n in ns
            ]
            base_s, _ = measure(raw_read, setup=drop, **timing)
            known = [r for r in resident if r is not None]
            rows.append(_row(tier, "get", nbytes, get_s, base_s, "read", reps=get_reps, page_cache="cold",
                             resident_fraction=max(known) if known else None))
            get(), raw_read()
            get_s, get_reps = measure(get, **timing)
            base_s, _ = measure(raw_read, **timing)
            rows.append(
                _row(tier, "get", nbytes, get_s, base_s, "read", reps=get_reps, page_cache="warm")
            )
            os.unlink(path)
        else:
            import redis

            client = redis.Redis.from_url(raw["url"], socket_timeout=60)
            name = f"rawbench:{nbytes}"
            base_s, _ = measure(lambda: client.set(name, payload), **timing)
            rows.append(_row(tier, "put", nbytes, put_s, base_s, "redis-py SET", reps=put_reps))
            get_s, get_reps = measure(get, **timing)
            base_s, _ = measure(lambda: client.get(name), **timing)
            rows.append(_row(tier, "get", nbytes, get_s, base_s, "redis-py GET", reps=get_reps))
            client.delete(name)
            client.close()
        store.delete([key])
    finally:
        store.close()
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    from orbitkv.store.disk import DiskBackend
    from orbitkv.store.memory import MemoryBackend
    from orbitkv.store.redis_backend import RedisBackend

    from orbitkv.config import OrbitKVConfig

    cfg = OrbitKVConfig.load()  # disk_fsync is the one setting that changes what is measured
    sizes = [1] if args.quick else list(SIZES_MIB)
    min_time_s = args.min_time_s if args.min_time_s is not None else (0.02 if args.quick else 0.3)
    timing = {
        "min_time_s": min_time_s,
        "min_reps": 1 if args.quick else 3,
        "max_reps": 3 if args.quick else 40,
    }
    started = time.perf_counter()
    workdir = tempfile.mkdtemp(prefix="orbitkv-bench-store-", dir=args.dir)
    rows: list[dict] = []
    doc: dict[str, Any] = {"sizes_mib": sizes, "timing": timing}
    try:
        root, raw_dir = os.path.join(workdir, "store"), os.path.join(workdir, "raw")
        os.makedirs(raw_dir)
        doc["disk"] = {
            "dir": workdir,
            "is_fsync": cfg.disk_fsync,
            "cold": "posix_fadvise(DONTNEED)",
        }
        with contextlib.ExitStack() as stack:
            url = args.redis_url
            if url is None and (
                shutil.which("redis-server") or os.path.exists("/usr/bin/redis-server")
            ):
                url = stack.enter_context(redis_server())
                doc["redis"] = {"is_own_server": True}
            elif url is not None:
                doc["redis"] = {"is_own_server": False}
            else:
                doc["redis"] = {"skipped": "no redis-server binary and no --redis-url"}
            for size_mib in sizes:
                nbytes = size_mib * MIB
                budget = 4 * nbytes + 16 * MIB
                rows += bench_tier("memory", MemoryBackend(budget), nbytes, {}, timing)
                disk = DiskBackend(root, budget, is_fsync=cfg.disk_fsync)
                raw = {"dir": raw_dir, "root": workdir, "is_fsync": cfg.disk_fsync}
                rows += bench_tier("disk", disk, nbytes, raw, timing)
                if url is not None:
                    backend = RedisBackend(url, socket_timeout_s=60.0, connect_timeout_s=2.0)
                    rows += bench_tier("redis", backend, nbytes, {"url": url}, timing)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    doc["rows"] = rows
    doc["wall_s"] = round(time.perf_counter() - started, 2)
    return doc


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    doc = run(args)
    if args.json:
        json.dump(doc, sys.stdout, indent=2)
        print()
        return 0
    print(
        f"{'tier':<7} {'op':<4} {'MiB':>4} {'cache':<5} {'GB/s':>8} {'baseline':<13} {'GB/s':>8} {'ratio':>6}"
    )
    for r in doc["rows"]:
        print(f"{r['tier']:<7} {r['op']:<4} {r['nbytes'] // MIB:>4} {r.get('page_cache', ''):<5} "
              f"{r['gbps']:>8.3f} {r['baseline']:<13} {r['baseline_gbps']:>8.3f} {r['ratio']:>6.2f}")
    print(f"wall {doc['wall_s']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
