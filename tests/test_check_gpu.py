"""``orbitkv check gpu``: what it says without CUDA, and its own code run on the CPU (``--device
cpu``: Triton through the interpreter, the memcpy comparison on CPU tensors). The live-server part
runs the CPU servers (V1, no async scheduling) and is opt-in (``slow``, about three minutes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from orbitkv_bench.checks import gpu, gpu_kernels, gpu_memcpy, gpu_server
from orbitkv_bench.checks.numerics import tolerance_ulps

REPO = Path(__file__).resolve().parents[1]


def _run(argv: list[str], capsys) -> tuple[int, dict]:
    rc = gpu.main(argv)
    return rc, json.loads(capsys.readouterr().out)


def test_tolerance_follows_the_dtype():
    assert tolerance_ulps(torch.float32) == 16.0
    assert 1.0 < tolerance_ulps(torch.bfloat16) < tolerance_ulps(torch.float16) < 1.01


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs the check instead")
def test_without_cuda_it_skips_and_lists_what_it_would_check():
    proc = subprocess.run([sys.executable, "-m", "orbitkv.cli", "check", "gpu", "--json"],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["ok"] is None and "no CUDA device" in doc["skipped"]
    lines = doc["would_check"]
    num_cases = len(gpu_kernels.cases(gpu_kernels.GPU_SIZES))
    assert len([x for x in lines if x.startswith("kernels: ")]) == num_cases
    for layout in gpu_kernels.LAYOUTS:
        assert any(x.startswith("kernels: load_chunk") and f" {layout} cache" in x for x in lines)
        assert any(x.startswith("kernels: gather_chunk") and f" {layout} cache" in x for x in lines)
    plan = gpu_memcpy.GPU_PLAN
    memcpy = [x for x in lines if x.startswith("memcpy: ")]
    assert len(memcpy) == len(plan.layouts) * len(plan.tokens) * len(plan.ranks)
    assert all("goal >= 0.8" in x and "CUDA events" in x for x in memcpy)
    (server,) = [x for x in lines if x.startswith("server: ")]
    assert "model runner V2" in server and "--async-scheduling" in server


@pytest.fixture
def interpreter(monkeypatch):
    """The check sets TRITON_INTERPRET for the CPU itself; restore the variable afterwards."""
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "1"))


def test_cpu_run_checks_every_kernel_and_labels_its_figures(capsys, interpreter, tmp_path):
    out = tmp_path / "gpu.json"
    rc, doc = _run(["--device", "cpu", "--json", "--parts", "kernels,memcpy", "--reps", "2",
                    "--out", str(out)], capsys)
    assert rc == 0 and doc["ok"] is True and doc["is_gpu_figure"] is False
    assert json.loads(out.read_text()) == doc
    kernels = doc["parts"]["kernels"]
    assert kernels["triton"].startswith("interpreter")
    cases = gpu_kernels.cases(gpu_kernels.CPU_SIZES)
    assert len(kernels["rows"]) == len(cases) * len(gpu_kernels.DTYPES)
    assert {r["dtype"] for r in kernels["rows"]} == {"float32", "bfloat16", "float16"}
    assert {r["layout"] for r in kernels["rows"]} == {None, *gpu_kernels.LAYOUTS}
    for row in kernels["rows"]:
        assert row["ok"] and 0 <= row["mean_ulp"] <= row["max_ulp"] <= row["tol_ulp"], row
        assert row.get("untouched_equal", True) and row.get("bit_equal", True)
    memcpy = doc["parts"]["memcpy"]
    assert memcpy["ok"] is None and memcpy["is_gpu_figure"] is False
    for row in memcpy["rows"]:
        assert "not a GPU figure" in row["timing"] and row["meets_goal"] is None
        low, high = row["ratio_spread"]
        assert 0 < low <= row["ratio"] <= high


def test_a_wrong_kernel_fails_the_check(capsys, interpreter, monkeypatch):
    from orbitkv.kernels.relocate import relocate

    def off_by_one(k, delta, spec, **kw):
        return relocate(k, delta + 1, spec, **kw)

    monkeypatch.setattr(gpu_kernels, "relocate", off_by_one)
    rc, doc = _run(["--device", "cpu", "--json", "--parts", "kernels"], capsys)
    assert rc == 1 and doc["ok"] is False
    bad = [r for r in doc["parts"]["kernels"]["rows"] if not r["ok"]]
    assert bad and {r["kernel"] for r in bad} == {"relocate"}
    assert all(r["max_ulp"] > r["tol_ulp"] for r in bad)


def test_runs_where_vllm_cannot_be_imported(tmp_path):
    """The GPU machine has no vLLM: the other parts run, the server part says why it did not, and
    nothing imports vLLM."""
    code = (
        "import sys, json\n"
        "sys.modules['vllm'] = None  # import vllm now fails, as where it is not installed\n"
        "from orbitkv_bench.checks import gpu\n"
        "rc = gpu.main(['--device', 'cpu', '--json', '--parts', 'memcpy,server', '--reps', '1'])\n"
        "assert sys.modules['vllm'] is None\n"
        "assert not [m for m in sys.modules if m.startswith('vllm.')]\n"
        "sys.exit(rc)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    assert "vLLM is not installed" in doc["skipped_parts"]["server"]
    assert "server" not in doc["parts"] and doc["parts"]["memcpy"]["rows"]


@pytest.fixture(scope="module")
def server_doc(tmp_path_factory):
    return gpu_server.run(False, tmp_path_factory.mktemp("check-gpu"), log=lambda _: None)


def _rows(doc: dict, request: str) -> dict[str, dict]:
    return {r["name"]: r for r in doc["rows"] if r["request"] == request}


@pytest.mark.slow
@pytest.mark.vllm
def test_cpu_servers_serve_prefix_runs_and_holes_exactly(server_doc):
    doc = server_doc
    assert doc["label"].startswith("CPU: V1 model runner")
    assert doc["runner"]["async_scheduling"] is False
    assert doc["holes_refused"] is None and doc["deleted_entries"] > 0
    assert doc["holes_served"] == doc["holes_expected"] == 2 * gpu_server.CHUNK
    rows = _rows(doc, "generate")
    assert set(rows) == {"prefix_run", "holes", "holes_again", "miss"}
    for name, row in rows.items():
        assert row["ok"], (name, row)
        assert row["tokens"] == row["reference_tokens"] and row["max_abs_logprob_diff"] == 0.0
        assert row["num_distinct_tokens"] > 1  # an output worth comparing
        assert row["served"]["num_reused_tokens"] >= row["expected"]["num_reused_tokens"]
        assert row["served"]["num_hole_tokens"] == row["expected"]["num_hole_tokens"]


@pytest.mark.slow
@pytest.mark.vllm
def test_cpu_servers_prompt_logprobs_without_holes(server_doc):
    rows = _rows(server_doc, "prompt_logprobs")
    for name in ("prefix_run", "holes", "holes_again", "miss"):
        assert rows[name]["ok"], rows[name]
        assert rows[name]["max_abs_prompt_logprob_diff"] == 0.0


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.xfail(strict=True, reason="connector bug: holes are jumped for a prompt-logprobs "
                   "request (tests/connector/test_vllm_holes_prompt_logprobs.py)")
def test_cpu_servers_prompt_logprobs_behind_holes(server_doc):
    row = _rows(server_doc, "prompt_logprobs")["holes_prompt_logprobs"]
    assert row["ok"], row
    assert server_doc["orbitkv_server_alive_at_end"]


def test_tile_sweep_runs_every_variant_and_restores_the_defaults(capsys, interpreter, tmp_path):
    from orbitkv.kernels import _triton_common, paged_triton
    from orbitkv_bench.checks import gpu_tiles

    defaults = (_triton_common.IS_ROTATE_IN_REGISTERS, paged_triton.BLOCK_TOKENS,
                paged_triton.NUM_WARPS)
    out = tmp_path / "tiles.json"
    assert gpu_tiles.main(["--device", "cpu", "--reps", "1", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["is_gpu_figure"] is False and "interpreter" in doc["triton"]
    variants = {(r["rotation"], r["block_tokens"], r["num_warps"]) for r in doc["rows"]}
    assert variants == {(rot, bt, nw) for rot in gpu_tiles.ROTATIONS for bt, nw in gpu_tiles.CPU_TILES}
    assert all(r["ratio"] > 0 and "error" not in r for r in doc["rows"])
    eager = doc["eager"]
    assert 0 < eager["checks_us"] < eager["load_chunk_us"]
    assert (_triton_common.IS_ROTATE_IN_REGISTERS, paged_triton.BLOCK_TOKENS,
            paged_triton.NUM_WARPS) == defaults
