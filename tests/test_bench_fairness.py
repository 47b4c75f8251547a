"""Fair benchmark arms (``orbitkv.agent.fairness``): the binding read back from real vLLM log lines,
the refusal to compare arms on different cores, the spread, the identical-work flag, the wait for
an arm's background work, and vLLM's iteration log (encoder inputs)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from orbitkv.agent import fairness as fair
from orbitkv.agent.driver import IterationLog

# Verbatim from vLLM 0.32 CPU server logs (tabs and all): a server with a KV connector on a 2-core
# machine left on "auto" (nothing left to reserve: cores [0, 1]), the same server without one
# (core 0 alone, core 1 reserved), and a server with the binding set explicitly.
AUTO_WITH_CONNECTOR = """\
(EngineCore pid=8473) WARNING 11-23 18:56:13 [ompmultiprocessing.py:273] Selected CPU core number (2) should be greater than reserved CPU core number (2).
(EngineCore pid=8473) INFO 11-23 18:56:13 [ompmultiprocessing.py:185] OpenMP thread binding info:\x20
(EngineCore pid=8473) INFO 11-23 18:56:13 [ompmultiprocessing.py:185] \tVLLM_CPU_OMP_THREADS_BIND='auto', auto_setup=True, skip_setup=False
(EngineCore pid=8473) INFO 11-23 18:56:13 [ompmultiprocessing.py:185] \tlocal_world_size=1, reserve_cpu_num=2
(EngineCore pid=8473) INFO 11-23 18:56:13 [ompmultiprocessing.py:185] \tlocal_rank=0, core ids=[0, 1]
(EngineCore pid=8473) INFO 11-23 18:56:13 [ompmultiprocessing.py:185] \treserved_cpus=[]
Triton is installed, but doesn't include CPU backend. Disabling Triton.
"""
AUTO_WITHOUT_CONNECTOR = """\
(EngineCore pid=9120) INFO 11-23 18:58:40 [ompmultiprocessing.py:185] OpenMP thread binding info:\x20
(EngineCore pid=9120) INFO 11-23 18:58:40 [ompmultiprocessing.py:185] \tVLLM_CPU_OMP_THREADS_BIND='auto', auto_setup=True, skip_setup=False
(EngineCore pid=9120) INFO 11-23 18:58:40 [ompmultiprocessing.py:185] \tlocal_world_size=1, reserve_cpu_num=1
(EngineCore pid=9120) INFO 11-23 18:58:40 [ompmultiprocessing.py:185] \tlocal_rank=0, core ids=[0]
(EngineCore pid=9120) INFO 11-23 18:58:40 [ompmultiprocessing.py:185] \treserved_cpus=[1]
"""
EXPLICIT = """\
(EngineCore pid=14956) INFO 11-23 19:04:42 [ompmultiprocessing.py:185] OpenMP thread binding info:\x20
(EngineCore pid=14956) INFO 11-23 19:04:42 [ompmultiprocessing.py:185] \tVLLM_CPU_OMP_THREADS_BIND='0-1', auto_setup=False, skip_setup=False
(EngineCore pid=14956) INFO 11-23 19:04:42 [ompmultiprocessing.py:185] \tlocal_world_size=1, reserve_cpu_num=0
(EngineCore pid=14956) INFO 11-23 19:04:42 [ompmultiprocessing.py:185] \tlocal_rank=0, core ids=[0, 1]
(EngineCore pid=14956) INFO 11-23 19:04:42 [ompmultiprocessing.py:185] \treserved_cpus=[]
"""
ITERATIONS = """\
(APIServer pid=14750) INFO 11-23 19:04:54 [loggers.py:199] Engine 000: Iteration(0): 1 context requests, 268 context tokens, 0 generation requests, 0 generation tokens, iteration elapsed time: 74.40 ms, CPU KV cache usage: 0.0%, encoder inputs: 2, encoder output embeddings: 32
(APIServer pid=14750) INFO 11-23 19:04:54 [loggers.py:199] Engine 000: Iteration(1): 1 context requests, 171 context tokens, 0 generation requests, 0 generation tokens, iteration elapsed time: 35.12 ms, CPU KV cache usage: 0.0%, encoder inputs: 1, encoder output embeddings: 16
(APIServer pid=14750) INFO 11-23 19:04:55 [loggers.py:199] Engine 000: Iteration(2): 1 context requests, 40 context tokens, 0 generation requests, 0 generation tokens, iteration elapsed time: 20.01 ms, CPU KV cache usage: 0.0%
"""


def test_binding_read_back_from_real_log_lines():
    auto = fair.parse_binding(AUTO_WITH_CONNECTOR)
    assert auto == {
        "omp_threads_bind": "auto", "auto_setup": True, "skip_setup": False, "local_world_size": 1,
        "reserve_cpu_num": 2, "core_ids": [[0, 1]], "reserved_cpus": [],
    }
    assert fair.parse_binding(AUTO_WITHOUT_CONNECTOR)["core_ids"] == [[0]]
    assert fair.parse_binding(AUTO_WITHOUT_CONNECTOR)["reserved_cpus"] == [1]
    explicit = fair.parse_binding(EXPLICIT)
    assert explicit["omp_threads_bind"] == "0-1" and not explicit["auto_setup"] and explicit["reserve_cpu_num"] == 0
    # A restarted server appends to its log: the last block is the binding it runs with.
    assert fair.parse_binding(AUTO_WITHOUT_CONNECTOR + "...\n" + EXPLICIT)["core_ids"] == [[0, 1]]
    assert fair.parse_binding("(APIServer pid=1) INFO no binding here\n") is None


def test_arms_on_different_cores_get_no_ratio():
    # The case of issue 16: OrbitKV's server on [0, 1], APC's on [0].
    check = fair.compare_bindings(
        {"orbitkv": fair.parse_binding(AUTO_WITH_CONNECTOR), "apc": fair.parse_binding(AUTO_WITHOUT_CONNECTOR)},
        is_required=True)
    assert not check["is_equal"] and "[[0, 1]]" in check["reason"] and "apc [[0]]" in check["reason"]
    same = fair.compare_bindings({"orbitkv": fair.parse_binding(EXPLICIT), "apc": fair.parse_binding(EXPLICIT)},
                                 is_required=True)
    assert same["is_equal"] and same["reason"] is None
    # A binding that cannot be read back is not assumed equal on the CPU platform.
    missing = fair.compare_bindings({"orbitkv": fair.parse_binding(EXPLICIT), "apc": None}, is_required=True)
    assert not missing["is_equal"] and "apc" in missing["reason"]
    assert not fair.compare_bindings({"a": None, "b": None}, is_required=True)["is_equal"]
    # Off the CPU platform no server logs one: nothing to compare.
    assert fair.compare_bindings({"a": None, "b": None}, is_required=False)["is_equal"]
    assert not fair.compare_bindings({"a": None, "b": fair.parse_binding(EXPLICIT)}, is_required=False)["is_equal"]


def test_bench_agent_withholds_ratios_when_cores_differ():
    from orbitkv.agent.arms import compare_systems
    from orbitkv.agent.report import format_report

    summaries = {
        name: {"ttft_p50_s": t, "ttft_p95_s": t, "prefill_tokens_computed": n, "error": None}
        for name, t, n in (("orbitkv", 1.0, 100), ("apc", 2.0, 300))
    }
    unequal = fair.compare_bindings(
        {"orbitkv": fair.parse_binding(AUTO_WITH_CONNECTOR), "apc": fair.parse_binding(AUTO_WITHOUT_CONNECTOR)},
        is_required=True)
    speedup, withheld = compare_systems(summaries, None, unequal)
    assert speedup == {} and withheld == unequal["reason"]
    speedup, withheld = compare_systems(summaries, None, {"is_equal": True, "reason": None})
    assert withheld is None and speedup["orbitkv_vs_apc"]["ttft_p50"] == 2.0
    fairness = {"binding_check": unequal, "start_step": fair.start_step_check({"orbitkv": [1.0], "apc": [1.1]}, {}),
                "bindings": {}, "quiet_wait_s": {}}
    doc = {"config": {"model": "m", "window": 4, "steps": 14, "episodes": 3}, "systems": {},
           "fairness": fairness, "speedup": {}, "speedup_withheld": unequal["reason"]}
    assert "NO RATIOS: the arms compute on different cores" in format_report(doc)


def test_binding_env_and_core_lists():
    assert fair.binding_env("0-1") == {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    assert fair.binding_env("auto") == {}
    everything = fair.binding_env("all")["VLLM_CPU_OMP_THREADS_BIND"]
    assert fair.parse_core_list(everything) == sorted(os.sched_getaffinity(0))
    assert fair.format_core_list([6, 0, 1, 2, 3]) == "0-3,6" and fair.parse_core_list("0-3,6") == [0, 1, 2, 3, 6]
    for bad in ("", "a", "1-x", "0,0"):
        with pytest.raises(ValueError, match="bad core list"):
            fair.parse_core_list(bad)


def test_spread_and_the_identical_work_flag():
    assert fair.spread([None, 3.0, 1.0, 2.0]) == {"n": 3, "min": 1.0, "p25": 1.5, "median": 2.0, "p75": 2.5, "max": 3.0}
    assert fair.spread([None]) is None
    steady = fair.start_step_check({"orbitkv": [4.6, 4.4], "apc": [5.0, 4.9]}, {"orbitkv": [1430, 1430]})
    assert not steady["is_flagged"] and steady["slowest_over_fastest"] == pytest.approx(4.95 / 4.5)
    # Issue 16's unequal run: APC's start step 9.4 s against OrbitKV's 4.4 s for the same tokens.
    assert fair.start_step_check({"orbitkv": [4.4], "apc": [9.4]}, {})["is_flagged"]


def _record(episode, step, computed, encoders, engine_s):
    from orbitkv.agent.driver import StepRecord

    return StepRecord(step=step, kind="slide", note="", images=[], prompt_tokens=computed,
                      computed_tokens=computed, apc_tokens=0, connector_tokens=0, reused_by_mode=None,
                      ttft_s=engine_s, engine_ttft_s=engine_s, latency_s=engine_s, answer="",
                      episode=episode, encoder_items_run=encoders)


def test_the_same_work_as_apc_is_matched_by_step_tokens_and_encoder_runs():
    """Only requests that computed what APC's did count; their ratio is APC's over the arm's."""
    apc = [_record(0, 0, 1000, 1, 2.0), _record(0, 1, 900, 1, 1.8), _record(1, 0, 1000, 1, 2.2),
           _record(1, 1, 500, 0, 1.0)]
    orbitkv = [_record(0, 0, 1000, 1, 2.5),   # same work, slower: 0.8
               _record(0, 1, 880, 1, 1.0),    # fewer tokens: reuse, not the same work
               _record(1, 0, 1000, 0, 1.1),   # no encoder run: not the same work
               _record(1, 1, 500, 0, 0.8)]    # same work, faster: 1.25
    unknown = [_record(0, 0, 1000, None, 2.0)]  # encoder runs not known: not counted
    got = fair.identical_work({"apc": apc, "orbitkv": orbitkv, "other": unknown})
    assert got["orbitkv"]["num_requests"] == 2
    assert got["orbitkv"]["engine_ttft_ratio"]["min"] == pytest.approx(0.8)
    assert got["orbitkv"]["engine_ttft_ratio"]["max"] == pytest.approx(1.25)
    assert got["other"] == {"reference": "apc", "num_requests": 0, "engine_ttft_ratio": None}
    assert "apc" not in got and fair.identical_work({"orbitkv": orbitkv}) == {}


def test_wait_quiet_waits_for_a_busy_session():
    burn = "import time\nt = time.time()\nwhile time.time() - t < 1.0: pass\ntime.sleep(30)"
    proc = subprocess.Popen([sys.executable, "-c", burn], start_new_session=True)
    try:
        time.sleep(0.1)
        assert fair.session_cpu_s(proc.pid) is not None
        waited = fair.wait_quiet(proc.pid, timeout_s=10.0)
        assert 0.6 <= waited < 5.0  # the busy second, then quiet
        assert fair.wait_quiet(proc.pid, timeout_s=10.0) < 1.0  # already quiet
    finally:
        proc.kill()
        proc.wait()


def test_iteration_log_counts_encoder_inputs_per_request(tmp_path):
    path = tmp_path / "server.log"
    path.write_text("(APIServer pid=1) INFO startup\n")
    log = IterationLog(path)
    start = log.offset()
    with open(path, "a") as f:
        f.write(ITERATIONS)
    assert log.encoder_inputs(start, 268 + 171 + 40) == 3
    assert log.encoder_inputs(start, None) == 3
    # The server has not logged the request's last iteration yet: unknown, not a guess.
    assert log.encoder_inputs(start, 1000, timeout_s=0.2) is None
    assert log.encoder_inputs(log.offset(), 10, timeout_s=0.1) is None
