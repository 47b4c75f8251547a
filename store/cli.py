"""``orbitkv store stats|ls|verify|gc``: inspect and maintain the persistent tiers (disk, Redis).

The memory tier lives inside the serving process, so this tool sees only what outlives it: the disk
directory and the Redis server. Tiers come from ``--config`` (an OrbitKV / LMCache YAML file, else
``ORBITKV_CONFIG_FILE`` / ``LMCACHE_CONFIG_FILE``), and ``--disk`` / ``--redis-url`` replace them.

- ``stats``: per tier, entries and bytes by kind, plus hit/miss counters: the server's own
  ``keyspace_hits`` / ``keyspace_misses`` for Redis (every client's traffic since the server started),
  and this process's counters for the disk tier (a directory keeps no counters).
- ``ls``: one row per key.
- ``verify``: decodes every entry (checksums, format, key/entry agreement) and every survivor index;
  ``--delete`` removes what is corrupt. Exit status 1 when corruption remains.
- ``gc``: evicts least recently used disk entries until the disk tier is within its budget:
  ``--budget-gb``, else the budget the serving stores recorded in the directory (``.budget``); with
  neither it refuses, rather than guess one (a default would delete most of a larger cache). Redis
  keeps its own budget (TTL, maxmemory).

``orbitkv store compile`` (forming patches, the connector's job) lives in
``connector/worker/compile.py`` and runs through ``run`` with these tiers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from orbitkv.config import GB, OrbitKVConfig

from .base import Backend
from .disk import recorded_budget

LMCACHE_SUFFIXES = ("kv_bytes", "metadata")


# An action: (the config, its tiers by name, the parsed arguments) -> the JSON document.
Command = Callable[[OrbitKVConfig, dict[str, Any], argparse.Namespace], dict[str, Any]]


def _parser(actions: tuple[str, ...]) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="orbitkv store", description=__doc__.split("\n\n")[0])
    p.add_argument("action", choices=actions)
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.add_argument("--config", help="OrbitKV / LMCache YAML config file")
    p.add_argument("--disk", help="disk tier directory (replaces local_disk)")
    p.add_argument("--redis-url", help="Redis URL (replaces remote_url)")
    p.add_argument("--delete", action="store_true", help="verify: delete corrupt entries")
    p.add_argument(
        "--budget-gb", type=float, help="gc: disk budget in GB (replaces max_local_disk_size)"
    )
    p.add_argument("--dry-run", action="store_true", help="gc: report, delete nothing")
    p.add_argument("--limit", type=int, default=0, help="ls: at most this many rows per tier")
    return p


def _open_tiers(args: argparse.Namespace) -> tuple[OrbitKVConfig, dict[str, Any]]:
    overrides: dict[str, Any] = {}
    if args.disk:
        overrides["local_disk"] = os.path.abspath(args.disk)
    if args.redis_url:
        overrides["remote_url"] = args.redis_url
    if args.budget_gb is not None:
        overrides["max_local_disk_size"] = args.budget_gb
    cfg = OrbitKVConfig.load(args.config, overrides=overrides)
    from orbitkv.store.disk import DiskBackend
    from orbitkv.store.redis_backend import RedisBackend

    tiers: dict[str, Any] = {}
    if cfg.local_disk_path is not None:
        if not cfg.local_disk_path.is_dir():
            raise ValueError(f"disk tier {cfg.local_disk_path} does not exist")
        # No budget of its own: opening a directory to inspect it must not change its record.
        tiers["disk"] = DiskBackend(cfg.local_disk_path, None, is_fsync=cfg.disk_fsync)
    if cfg.remote_url:
        tiers["redis"] = RedisBackend(
            cfg.remote_url,
            socket_timeout_s=max(cfg.remote_timeout_s, 5.0),  # a scan is not a hot-path call
            connect_timeout_s=cfg.remote_connect_timeout_s,
            key_prefix=cfg.redis_key_prefix,
        )
        if cfg.entry_signing_key is not None:
            from orbitkv.store.signing import SignedBackend

            tiers["redis"] = SignedBackend(tiers["redis"], cfg.entry_signing_key)
    if not tiers:
        raise ValueError("no tier to inspect; give --disk DIR and/or --redis-url URL")
    return cfg, tiers


def classify(key: str) -> str:
    """``canonical`` / ``conditioned`` / ``patch`` / ``encoder`` / ``index`` (survivor index) /
    ``lmcache`` / ``other``."""
    from orbitkv.store.keys import INDEX_KIND, KEY_VERSION, EntryKey

    if key.startswith(f"{KEY_VERSION}:{INDEX_KIND}:"):
        return "index"
    try:
        return EntryKey.parse(key).kind
    except ValueError:
        return "lmcache" if "@" in key and key.endswith(LMCACHE_SUFFIXES) else "other"


def disk_files(root: str) -> list[tuple[float, str, int]]:
    """``(recency, key, nbytes)`` per entry file, oldest first. Recency as the disk tier keeps it
    across restarts: the later of atime and mtime. Temp files (leading ``.``) are not entries."""
    from orbitkv.store.disk import filename_to_key

    out = []
    for shard in os.scandir(root):
        if not shard.is_dir(follow_symlinks=False):
            continue
        for item in os.scandir(shard.path):
            try:
                if not item.name.startswith("."):
                    st = item.stat(follow_symlinks=False)
                    out.append(
                        (max(st.st_atime, st.st_mtime), filename_to_key(item.name), st.st_size)
                    )
            except (OSError, UnicodeDecodeError, ValueError):
                continue  # vanished or not an entry file
    return sorted(out)


def _redis_client(cfg: OrbitKVConfig) -> Any:
    import redis
    from orbitkv.store.redis_backend import parse_url
    from redis.cluster import RedisCluster

    url, is_cluster = parse_url(cfg.remote_url)
    options = {"socket_timeout": max(cfg.remote_timeout_s, 5.0), "socket_connect_timeout": 2.0}
    return (
        RedisCluster.from_url(url, **options)
        if is_cluster
        else redis.Redis.from_url(url, **options)
    )


def _rows(
    cfg: OrbitKVConfig, name: str, tier: Backend, *, batch: int = 512
) -> Iterator[dict[str, Any]]:
    if name == "disk":
        for _, key, nbytes in disk_files(str(cfg.local_disk_path)):
            yield {"tier": name, "key": key, "kind": classify(key), "nbytes": nbytes}
        return
    keys = sorted(tier.iter_keys())
    client = _redis_client(cfg)
    try:
        for i in range(0, len(keys), batch):
            chunk = keys[i : i + batch]
            pipe = client.pipeline(transaction=False)
            for key in chunk:
                # Sizes without moving the values. Survivor indexes are sorted sets in Redis, which
                # STRLEN refuses; MEMORY USAGE sizes any type.
                if classify(key) == "index":
                    pipe.memory_usage(cfg.redis_key_prefix + key)
                else:
                    pipe.strlen(cfg.redis_key_prefix + key)
            for key, nbytes in zip(chunk, pipe.execute(raise_on_error=False), strict=True):
                if isinstance(nbytes, int) and nbytes > 0:  # 0: vanished since the listing
                    yield {"tier": name, "key": key, "kind": classify(key), "nbytes": nbytes}
    finally:
        client.close()


def cmd_stats(
    cfg: OrbitKVConfig, tiers: dict[str, Any], args: argparse.Namespace
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, tier in tiers.items():
        counts: Counter[str] = Counter()
        nbytes: Counter[str] = Counter()
        for row in _rows(cfg, name, tier):
            counts[row["kind"]] += 1
            nbytes[row["kind"]] += row["nbytes"]
        info: dict[str, Any] = {
            "num_entries": sum(counts.values()),
            "nbytes": sum(nbytes.values()),
            "by_kind": {k: {"num_entries": counts[k], "nbytes": nbytes[k]} for k in sorted(counts)},
        }
        if name == "disk":
            info["path"] = str(cfg.local_disk_path)
            info["budget_nbytes"] = recorded_budget(cfg.local_disk_path)
            info["counters_scope"] = "this process"
            info["counters"] = tier.stats()
        else:
            info["url"] = cfg.remote.redacted_url
            server = _redis_info(cfg)
            if server is None:
                info["is_up"] = False
            else:
                # A cluster client answers per node; sum the counters over the nodes.
                nodes = (
                    server.values()
                    if all(isinstance(v, dict) for v in server.values())
                    else [server]
                )
                info["is_up"] = True
                info["counters_scope"] = "redis server"
                info["counters"] = {
                    "hits": sum(int(n.get("keyspace_hits", 0)) for n in nodes),
                    "misses": sum(int(n.get("keyspace_misses", 0)) for n in nodes),
                    "used_memory_nbytes": sum(int(n.get("used_memory", 0)) for n in nodes),
                    "evicted_keys": sum(int(n.get("evicted_keys", 0)) for n in nodes),
                }
        out[name] = info
    return {"action": "stats", "tiers": out}


def _redis_info(cfg: OrbitKVConfig) -> dict[str, Any] | None:
    try:
        client = _redis_client(cfg)
        try:
            return client.info()
        finally:
            client.close()
    except Exception:  # an unreachable server is reported as down, not as a crash
        return None


def cmd_ls(cfg: OrbitKVConfig, tiers: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    for name, tier in tiers.items():
        for i, row in enumerate(_rows(cfg, name, tier)):
            if args.limit and i >= args.limit:
                break
            rows.append(row)
    return {"action": "ls", "num_entries": len(rows), "entries": rows}


def check_value(key: str, value: bytes) -> str | None:
    """Why ``value`` is not a valid value for ``key``, or None when it is."""
    from orbitkv.store import antecedents
    from orbitkv.store.entry import CorruptEntry, decode
    from orbitkv.store.keys import KINDS, EntryKey, antecedent_hash

    kind = classify(key)
    if kind == "index":
        try:
            antecedents.decode_index(value)
        except ValueError as exc:
            return f"bad survivor index: {exc}"
        return None
    if kind not in KINDS:
        return None  # not ours (LMCache chunks, foreign keys): nothing to check against
    try:
        meta = decode(value).meta  # every tensor's digest, not only the header
    except CorruptEntry as exc:
        return str(exc)
    entry_key = EntryKey.parse(key)
    if meta.kind != entry_key.kind:
        return f"key kind {entry_key.kind} but entry kind {meta.kind}"
    if entry_key.kind == "conditioned" and entry_key.antecedent != meta.antecedent_hash:
        return "key antecedent does not match the entry's antecedent hash"
    if meta.antecedent and antecedent_hash(meta.antecedent) != meta.antecedent_hash:
        return "stored antecedent list does not hash to its antecedent hash"
    if entry_key.kind == "patch" and entry_key.rank != meta.rank:
        return f"key rank {entry_key.rank} but entry rank {meta.rank}"
    return None


def cmd_verify(
    cfg: OrbitKVConfig, tiers: dict[str, Any], args: argparse.Namespace
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, tier in tiers.items():
        num_checked = num_skipped = 0
        corrupt: list[dict[str, str]] = []
        keys = sorted(tier.iter_keys())
        index_keys = [k for k in keys if classify(k) == "index"]
        entry_keys = [k for k in keys if classify(k) != "index"]
        # Indexes are read through the tier's own index reader (a Redis sorted set, a JSON file on
        # disk); it drops and counts a malformed one itself, so what it cannot parse is corrupt.
        for i in range(0, len(index_keys), 64):
            chunk = index_keys[i : i + 64]
            for key, parsed in zip(chunk, tier.batch_index_get(chunk), strict=True):
                num_checked += 1
                if parsed is None:
                    corrupt.append({"key": key, "error": "bad or vanished survivor index"})
        for i in range(0, len(entry_keys), 64):
            chunk = entry_keys[i : i + 64]
            for key, value in zip(chunk, tier.batch_get(chunk), strict=True):
                if value is None:
                    num_skipped += 1  # evicted or deleted since the listing
                    continue
                num_checked += 1
                reason = check_value(key, value)
                if reason is not None:
                    corrupt.append({"key": key, "error": reason})
        if args.delete and corrupt:
            tier.batch_delete([c["key"] for c in corrupt])
        out[name] = {
            "num_checked": num_checked,
            "num_ok": num_checked - len(corrupt),
            "num_corrupt": len(corrupt),
            "num_skipped": num_skipped,
            "is_deleted": bool(args.delete and corrupt),
            "corrupt": corrupt,
        }
    num_corrupt = sum(t["num_corrupt"] for t in out.values())
    return {"action": "verify", "num_corrupt": num_corrupt, "tiers": out}


def cmd_gc(cfg: OrbitKVConfig, tiers: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    disk = tiers.get("disk")
    if disk is not None:
        budget = (
            int(args.budget_gb * GB) if args.budget_gb is not None
            else recorded_budget(cfg.local_disk_path)
        )
        if budget is None:
            raise ValueError(
                f"gc: {cfg.local_disk_path} records no budget (no store has used it); "
                "give --budget-gb"
            )
        files = disk_files(str(cfg.local_disk_path))
        used = sum(size for _, _, size in files)
        victims, freed = [], 0
        for _, key, size in files:
            if used - freed <= budget:
                break
            victims.append(key)
            freed += size
        if victims and not args.dry_run:
            disk.batch_delete(victims)
        out["disk"] = {
            "budget_nbytes": budget,
            "used_nbytes_before": used,
            "used_nbytes_after": used - (0 if args.dry_run else freed),
            "num_evicted": len(victims),
            "evicted_nbytes": freed,
            "is_dry_run": bool(args.dry_run),
        }
    if "redis" in tiers:
        out["redis"] = {"skipped": "Redis evicts by TTL (remote_ttl_s) and its maxmemory policy"}
    return {"action": "gc", "tiers": out}


def _print_text(doc: dict[str, Any]) -> None:
    if doc["action"] == "ls":
        for row in doc["entries"]:
            print(f"{row['tier']:<6} {row['kind']:<12} {row['nbytes']:>12}  {row['key']}")
        return
    for name, info in doc.get("tiers", {}).items():
        flat = {k: v for k, v in info.items() if not isinstance(v, (dict, list))}
        print(f"{name}: " + ", ".join(f"{k}={v}" for k, v in flat.items()))
        for item in info.get("corrupt", []):
            print(f"  corrupt {item['key']}: {item['error']}")
        for kind, sub in info.get("by_kind", {}).items():
            print(f"  {kind}: {sub['num_entries']} entries, {sub['nbytes'] / GB:.3f} GB")


COMMANDS: dict[str, Command] = {
    "stats": cmd_stats, "ls": cmd_ls, "verify": cmd_verify, "gc": cmd_gc
}


def main(argv: list[str] | None = None) -> int:
    return run(argv, COMMANDS)


def run(
    argv: list[str] | None,
    commands: dict[str, Command],
    extra_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
) -> int:
    """Parse ``argv`` (the action first), open the tiers, run the action, print its document.
    ``extra_arguments`` adds an action's own flags (``orbitkv store compile``'s ``--model``)."""
    parser = _parser(tuple(commands))
    if extra_arguments is not None:
        extra_arguments(parser)
    args = parser.parse_args(argv)
    try:
        cfg, tiers = _open_tiers(args)
    except ValueError as exc:  # a bad config names its key: a message, not a traceback
        print(f"orbitkv store: {exc}", file=sys.stderr)
        return 2
    try:
        doc = commands[args.action](cfg, tiers, args)
    except ValueError as exc:
        print(f"orbitkv store: {exc}", file=sys.stderr)
        return 2
    finally:
        for tier in tiers.values():
            tier.close()
    if args.json:
        json.dump(doc, sys.stdout, indent=2, sort_keys=True)
        print()
    else:
        _print_text(doc)
    is_dirty = args.action == "verify" and doc["num_corrupt"] and not args.delete
    return 1 if is_dirty else 0


if __name__ == "__main__":
    raise SystemExit(main())
