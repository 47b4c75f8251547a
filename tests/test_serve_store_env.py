"""``orbitkv serve`` and the store named by the environment (issue 25, item 8): ``ORBITKV_LOCAL_DISK``
and ``ORBITKV_LOCAL_CPU`` name the store's own tiers as a config file does, so the default store
(memory + ``./.orbitkv/store``) is not put over them. Checked on the config vLLM loads: the
printed ``--kv-transfer-config`` read with the environment vLLM inherits."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

import pytest

from orbitkv.config import GB, OrbitKVConfig
from orbitkv.serving import serve


@pytest.fixture
def vllm_config(tmp_path, monkeypatch, capsys):
    """``orbitkv serve --print-cmd -- m`` run in an empty working directory with ``env`` as its
    ``ORBITKV_*`` environment: the ``OrbitKVConfig`` vLLM would load."""
    workdir = tmp_path / "work"
    workdir.mkdir()
    monkeypatch.chdir(workdir)

    def run(env: dict[str, str], *options: str) -> OrbitKVConfig:
        for name in [k for k in os.environ if k.startswith(("ORBITKV_", "LMCACHE_"))]:
            monkeypatch.delenv(name)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        capsys.readouterr()
        assert serve.main([*options, "--print-cmd", "--", "m"]) == 0
        printed = shlex.split(capsys.readouterr().out)
        ktc = json.loads(printed[printed.index("--kv-transfer-config") + 1])
        return OrbitKVConfig.from_kv_connector_extra_config(ktc.get("kv_connector_extra_config"))

    return run


def test_the_environment_names_the_disk_tier(vllm_config, tmp_path):
    disk = tmp_path / "cache"
    cfg = vllm_config({"ORBITKV_LOCAL_DISK": f"file://{disk}", "ORBITKV_MAX_LOCAL_DISK_SIZE": "50"})
    assert cfg.local_disk_path == disk and cfg.local_disk_nbytes == 50 * GB
    assert cfg.local_cpu


def test_the_environment_turns_the_memory_tier_off(vllm_config, tmp_path):
    cfg = vllm_config({"ORBITKV_LOCAL_CPU": "false", "ORBITKV_LOCAL_DISK": str(tmp_path / "d")})
    assert not cfg.local_cpu and cfg.local_cpu_nbytes == 0
    assert cfg.local_disk_path == tmp_path / "d"
    # Alone it names the store too, as a file with only `local_cpu: false` would: no default disk.
    cfg = vllm_config({"ORBITKV_LOCAL_CPU": "false"})
    assert not cfg.local_cpu and cfg.local_disk is None


def test_without_a_store_in_the_environment_the_default_store_stays(vllm_config, tmp_path):
    default = Path.cwd() / ".orbitkv" / "store"
    # Budgets and the Redis URL do not say where the local tiers are: the default disk takes them.
    cfg = vllm_config({"ORBITKV_MAX_LOCAL_DISK_SIZE": "3", "ORBITKV_LOCAL_DISK": ""})
    assert cfg.local_cpu and cfg.local_disk_path == default and cfg.local_disk_nbytes == 3 * GB
    # --store-dir and --set still outrank the environment.
    env = {"ORBITKV_LOCAL_DISK": str(tmp_path / "env"), "ORBITKV_LOCAL_CPU": "false"}
    cfg = vllm_config(env, "--store-dir", str(tmp_path / "flag"))
    assert cfg.local_disk_path == tmp_path / "flag" and cfg.local_cpu
    cfg = vllm_config(env, "--set", f"local_disk={tmp_path / 'set'}")
    assert cfg.local_disk_path == tmp_path / "set" and not cfg.local_cpu
