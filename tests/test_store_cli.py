"""Smoke tests of ``orbitkv store`` and ``orbitkv bench store``: JSON shape, corruption found on disk."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from orbitkv.store import TieredStore, make_entry
from orbitkv.store import cli as store_cli
from orbitkv.store.keys import EntryKey, antecedent_hash, chunk_cid

from orbitkv import cli

FP = "fp-cli-test"


def entry_key(i: int, kind: str = "canonical") -> tuple[EntryKey, tuple[str, ...]]:
    cid = chunk_cid(FP, "flash", "", [i, i + 1, i + 2])
    if kind == "canonical":
        return EntryKey(cid, kind), ()
    before = (chunk_cid(FP, "flash", "", [9000 + i]),)
    return EntryKey(cid, kind, antecedent_hash(before)), before


def fill(disk: Path, num_entries: int = 3, *, redis_url: str | None = None) -> list[str]:
    """Write ``num_entries`` canonical entries plus one conditioned one (and its survivor index)."""
    store = TieredStore(
        memory_nbytes=1 << 26, disk_dir=str(disk), disk_nbytes=1 << 30, redis_url=redis_url
    )
    keys = []
    for i in range(num_entries + 1):
        kind = "canonical" if i < num_entries else "conditioned"
        key, antecedent = entry_key(i, kind)
        g = torch.Generator().manual_seed(i)
        tensors = {
            f"{p}.{layer}": torch.randn(8, 2, 16, generator=g) for p in "kv" for layer in range(2)
        }
        store.put(
            key,
            make_entry(kind, tensors, model_fingerprint=FP, layout="flash", antecedent=antecedent),
        )
        keys.append(key.to_str())
    assert store.flush(30)
    store.close()
    return keys


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict]:
    rc = cli.main(["store", *argv, "--json"])
    return rc, json.loads(capsys.readouterr().out)


def test_stats_ls_verify_gc_on_disk(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    disk = tmp_path / "kv"
    keys = fill(disk)
    rc, stats = run(capsys, "stats", "--disk", str(disk))
    tier = stats["tiers"]["disk"]
    assert rc == 0 and stats["action"] == "stats"
    assert tier["by_kind"]["canonical"]["num_entries"] == 3
    assert tier["by_kind"]["conditioned"]["num_entries"] == 1
    assert tier["by_kind"]["index"]["num_entries"] == 1
    assert tier["num_entries"] == 5 and tier["nbytes"] > 0
    assert tier["counters_scope"] == "this process" and "hits" in tier["counters"]

    rc, ls = run(capsys, "ls", "--disk", str(disk))
    assert rc == 0 and ls["num_entries"] == 5
    assert set(keys) <= {row["key"] for row in ls["entries"]}
    assert all(set(row) == {"tier", "key", "kind", "nbytes"} for row in ls["entries"])

    rc, ok = run(capsys, "verify", "--disk", str(disk))
    assert rc == 0 and ok["num_corrupt"] == 0 and ok["tiers"]["disk"]["num_checked"] == 5

    # Damage one entry's payload on disk: flip bytes near the end of its file.
    victim = next(p for p in disk.rglob("*") if p.is_file() and "canonical" in p.name)
    data = bytearray(victim.read_bytes())
    data[-5:] = bytes(b ^ 0xFF for b in data[-5:])
    victim.write_bytes(bytes(data))
    truncated = next(p for p in disk.rglob("*") if p.is_file() and "conditioned" in p.name)
    truncated.write_bytes(truncated.read_bytes()[:100])
    rc, bad = run(capsys, "verify", "--disk", str(disk))
    found = {c["key"]: c["error"] for c in bad["tiers"]["disk"]["corrupt"]}
    assert rc == 1 and bad["num_corrupt"] == 2 and len(found) == 2
    assert any("checksum" in e for e in found.values())
    rc, fixed = run(capsys, "verify", "--disk", str(disk), "--delete")
    assert rc == 0 and fixed["tiers"]["disk"]["is_deleted"] and not victim.exists()
    rc, clean = run(capsys, "verify", "--disk", str(disk))
    assert rc == 0 and clean["num_corrupt"] == 0 and clean["tiers"]["disk"]["num_checked"] == 3

    size = sum(row["nbytes"] for row in run(capsys, "ls", "--disk", str(disk))[1]["entries"])
    budget_gb = (size // 2) / (1 << 30)
    rc, dry = run(capsys, "gc", "--disk", str(disk), "--budget-gb", str(budget_gb), "--dry-run")
    assert (
        rc == 0 and dry["tiers"]["disk"]["num_evicted"] >= 1 and dry["tiers"]["disk"]["is_dry_run"]
    )
    rc, gc = run(capsys, "gc", "--disk", str(disk), "--budget-gb", str(budget_gb))
    after = gc["tiers"]["disk"]
    assert (
        rc == 0
        and after["used_nbytes_after"] <= after["budget_nbytes"] < after["used_nbytes_before"]
    )
    assert len(run(capsys, "ls", "--disk", str(disk))[1]["entries"]) == 3 - after["num_evicted"]


def test_config_file_names_the_tiers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in (
        "ORBITKV_CONFIG_FILE",
        "LMCACHE_CONFIG_FILE",
        "ORBITKV_LOCAL_DISK",
        "ORBITKV_REMOTE_URL",
    ):
        monkeypatch.delenv(name, raising=False)
    disk = tmp_path / "kv"
    fill(disk, 1)
    cfg = tmp_path / "lmcache.yaml"
    cfg.write_text(f'chunk_size: 256\nlocal_disk: "file://{disk}"\nmax_local_disk_size: 1\n')
    rc, stats = run(capsys, "stats", "--config", str(cfg))
    assert rc == 0 and stats["tiers"]["disk"]["budget_nbytes"] == 1 << 30
    assert store_cli.main(["stats"]) == 2  # no tier named anywhere
    assert "no tier" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("chunk_size: 256\nbogus_key: 1\n")
    assert cli.main(["store", "stats", "--config", str(bad)]) == 2
    assert "bogus_key" in capsys.readouterr().err


def test_text_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    disk = tmp_path / "kv"
    fill(disk, 1)
    assert store_cli.main(["stats", "--disk", str(disk)]) == 0
    assert "disk:" in capsys.readouterr().out


@pytest.mark.redis
def test_stats_and_verify_on_redis(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], redis_server
) -> None:
    import redis

    keys = fill(tmp_path / "kv", 2, redis_url=redis_server.url)
    raw = redis.Redis.from_url(redis_server.url)
    raw.set("someone@1@0@abc@halfmetadata", b"x")  # a foreign (LMCache) key is counted, not checked
    rc, stats = run(capsys, "stats", "--redis-url", redis_server.url)
    tier = stats["tiers"]["redis"]
    assert rc == 0 and tier["is_up"] and tier["counters_scope"] == "redis server"
    assert (
        tier["by_kind"]["canonical"]["num_entries"] == 2
        and tier["by_kind"]["lmcache"]["num_entries"] == 1
    )
    assert {"hits", "misses", "used_memory_nbytes"} <= set(tier["counters"])
    # The conditioned entry's survivor index is a Redis sorted set: listed, sized and verified.
    rc, ls = run(capsys, "ls", "--redis-url", redis_server.url)
    index_rows = [r for r in ls["entries"] if r["kind"] == "index"]
    assert rc == 0 and len(index_rows) == 1 and index_rows[0]["nbytes"] > 0
    rc, ok = run(capsys, "verify", "--redis-url", redis_server.url)
    assert rc == 0 and ok["num_corrupt"] == 0 and ok["tiers"]["redis"]["num_checked"] == 5  # + the foreign key
    raw.set(keys[0], raw.get(keys[0])[:-1])
    rc, bad = run(capsys, "verify", "--redis-url", redis_server.url)
    assert rc == 1 and [c["key"] for c in bad["tiers"]["redis"]["corrupt"]] == [keys[0]]
    raw.close()


@pytest.fixture
def redis_server():
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from redis_server import redis_server_fixture

    yield from redis_server_fixture()


@pytest.mark.redis
def test_bench_store_quick(capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli.main(["bench", "store", "--json", "--quick"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0
    rows = doc["rows"]
    assert {r["tier"] for r in rows} == {"memory", "disk", "redis"}
    assert {r["op"] for r in rows} == {"put", "get"}
    for row in rows:
        assert {"tier", "op", "nbytes", "gbps", "baseline", "baseline_gbps", "ratio"} <= set(row)
        assert row["gbps"] > 0 and row["baseline_gbps"] > 0
        assert row["ratio"] == pytest.approx(row["gbps"] / row["baseline_gbps"], rel=1e-3)
    assert {r["page_cache"] for r in rows if r["tier"] == "disk" and r["op"] == "get"} == {
        "cold",
        "warm",
    }


def test_compile_forms_the_patches_a_store_allows(tmp_path, capsys, monkeypatch):
    """A canonical and two conditioned entries of B on disk: compile forms each ordering's patch
    and their orbit patch, and canonical + patch rebuilds the conditioned KV (full rank)."""
    # 6-token entries: a rank-32 patch outweighs the KV, which the default policy would refuse.
    monkeypatch.setenv("ORBITKV_PATCH_MAX_BYTES_FRACTION", "1000")
    from orbitkv.kernels.relocate import relocate
    from orbitkv.kernels.rope import RopeSpec
    from transformers import AutoConfig

    from orbitkv.models.make_model import make_model

    model_dir = make_model(tmp_path / "qwen2", "qwen2")
    rope = RopeSpec.from_hf_config(AutoConfig.from_pretrained(model_dir))
    disk = tmp_path / "disk"
    store = TieredStore(memory_nbytes=1 << 26, disk_dir=str(disk), disk_nbytes=1 << 30)
    b = chunk_cid(FP, "mha:float32", "", [1, 2, 3])
    a1, a2 = (chunk_cid(FP, "mha:float32", "", [t]) for t in (7, 8))
    g = torch.Generator().manual_seed(0)

    def kv():
        return {f"{p}.{layer}": torch.randn(6, 2, 32, generator=g) for p in "kv" for layer in range(2)}

    common = dict(model_fingerprint=FP, layout="mha:float32", rope_hash=rope.fingerprint())
    store.put(EntryKey(b, "canonical"), make_entry("canonical", kv(), start_pos=0, **common))
    conditioned = {}
    for ante in ((a1, a2), (a2, a1)):
        conditioned[ante] = kv()
        store.put(EntryKey(b, "conditioned", antecedent_hash(ante)),
                  make_entry("conditioned", conditioned[ante], start_pos=9, antecedent=ante, **common))
    store.flush()
    store.close()

    assert cli.main(["store", "compile", "--disk", str(disk), "--model", str(model_dir), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["num_canonicals"] == 1 and doc["patches formed"] == 3  # two orderings + the orbit
    reader = TieredStore(memory_nbytes=1 << 26, disk_dir=str(disk), disk_nbytes=1 << 30)
    from orbitkv.config import OrbitKVConfig

    rank = OrbitKVConfig().patch_rank
    canonical = reader.get([EntryKey(b, "canonical")])[0]
    for ante, want in conditioned.items():
        patch = reader.get([EntryKey(b, "patch", antecedent_hash(ante), rank)])[0]
        assert patch is not None and patch.meta.antecedent == ante
        for layer in range(2):
            moved = relocate(canonical.tensors[f"k.{layer}"], 9, rope).float()
            got = moved.reshape(6, -1) + patch.tensors[f"uk.{layer}"] @ patch.tensors[f"wk.{layer}"]
            assert torch.allclose(got, want[f"k.{layer}"].reshape(6, -1), atol=1e-4)
    reader.close()
    # Without --model the command says what it needs.
    assert cli.main(["store", "compile", "--disk", str(disk)]) == 2
    assert "--model" in capsys.readouterr().err


def test_encoder_entries_are_listed_and_verified(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from orbitkv.connector.encoder.entries import encoder_key, make_encoder_entry

    disk = tmp_path / "enc"
    key = encoder_key(FP, "", "", "img-1")
    with TieredStore(memory_nbytes=1 << 24, disk_dir=str(disk), disk_nbytes=1 << 30) as store:
        store.put(key, make_encoder_entry(torch.randn(16, 8), FP))
        assert store.flush(30)
    rc, stats = run(capsys, "stats", "--disk", str(disk))
    assert rc == 0 and stats["tiers"]["disk"]["by_kind"]["encoder"]["num_entries"] == 1
    (path,) = [p for p in disk.rglob("*") if p.is_file() and "encoder" in p.name]
    data = bytearray(path.read_bytes())
    data[-3:] = bytes(b ^ 0xFF for b in data[-3:])
    path.write_bytes(bytes(data))
    rc, bad = run(capsys, "verify", "--disk", str(disk))
    assert rc == 1 and [c["key"] for c in bad["tiers"]["disk"]["corrupt"]] == [key]
