"""``orbitkv check exactness --json``: exact stays exact, against a live server.

Two vLLM servers on ``make-model``'s tiny qwen2 (seeded weights) with a LoRA adapter: OrbitKV (the
connector, its scheduler, vLLM's prefix cache kept across requests, a disk store) and a reference
with no connector and no prefix cache. The scripted mix (``exactness_mix.py``: an agent session
with approximate KV, exact-only and reuse-off requests right after each of its turns, an unsalted
agent, two tenants and a refused one, three salts, a LoRA adapter, prompt logprobs, entries
corrupted and cut on disk) goes to both. Then an in-process engine computes every prompt in full
and the check compares, bit for bit, every exact entry the OrbitKV server left in its store.

Per request it prints the tokens served and their lineage; the totals must all be 0:
``exact_lineage_tokens_differing`` (stored exact KV that is not a full prefill's),
``exact_requests_differing`` (a request served only exact KV, ``approximate_from`` null, whose
greedy tokens, logprobs or prompt logprobs differ from the reference's: every request that did not
opt into approximate KV is one) and ``approximate_tokens_not_opted_in``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from orbitkv.checks.exactness_mix import CHUNK, LORA_NAME, TENANTS, Ask, build_mix

SERVED_NAME = "orbitkv-check"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="orbitkv check exactness", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--out", type=Path, help="also write the JSON report here")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/orbitkv-check-exactness"))
    parser.add_argument("--agent-turns", type=int, default=6, help="turns per agent session (1-6)")
    args = parser.parse_args(argv)
    report = run(args.workdir, num_agent_turns=args.agent_turns, log=lambda m: print(m, file=sys.stderr))
    text = json.dumps(report, indent=2)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text if args.json else _summary_line(report))
    return 0 if report["ok"] else 1


def run(workdir: Path, *, num_agent_turns: int = 6, log: Any = print) -> dict[str, Any]:
    from orbitkv.models.lora import make_lora_adapter
    from orbitkv.models.make_model import make_model

    started = time.monotonic()
    workdir.mkdir(parents=True, exist_ok=True)
    model_dir = make_model(workdir / "qwen2-tiny", "qwen2")
    adapter = make_lora_adapter(workdir / "adapter", model_dir, seed=1)
    store_dir = workdir / "store"
    shutil.rmtree(store_dir, ignore_errors=True)
    config = {"chunk_size": CHUNK, "orbitkv_text_chunking": "fixed", "local_cpu": False,
              "local_disk": str(store_dir), "orbitkv_request_tenants": list(TENANTS),
              "orbitkv_patch_rank": 0, "orbitkv_approximate_reuse": "request",
              # The check is about lineage, not fidelity: the modes need no calibration here.
              "orbitkv_require_calibration": False}
    asks = build_mix(num_agent_turns)
    from orbitkv.checks.exactness_live import send_all

    rows = send_all(asks, model_dir, adapter, config, store_dir, workdir / "logs", log=log)
    log("check exactness: comparing the stored exact entries with full prefills")
    from orbitkv.checks.exactness_kv import compare_stored

    kv = compare_stored(asks, model_dir, adapter, config, store_dir)
    totals = {
        "num_requests": len(rows),
        "exact_lineage_tokens_differing": kv["num_tokens_differing"],
        "exact_requests_differing": sum(r["is_exact"] and not r["is_equal"] for r in rows),
        "num_exact_requests": sum(r["is_exact"] for r in rows),
        "approximate_tokens_not_opted_in": sum(
            r["served"]["num_approximate_tokens"] for r in rows if not r["is_opted_in"]
        ),
        "expectations_failed": sum(not r["is_expected"] for r in rows),
        "num_exact_entries_compared": kv["num_entries"],
        "num_exact_tokens_compared": kv["num_tokens"],
        "num_approximate_tokens_served_opted_in": sum(
            r["served"]["num_approximate_tokens"] for r in rows if r["is_opted_in"]
        ),
        "num_failed_load_tokens": sum(r["served"]["num_failed_load_tokens"] for r in rows),
    }
    is_ok = (
        totals["num_requests"] >= 40 and totals["exact_lineage_tokens_differing"] == 0
        and totals["exact_requests_differing"] == 0 and totals["approximate_tokens_not_opted_in"] == 0
        and totals["expectations_failed"] == 0 and kv["num_entries"] > 0
    )
    return {
        "ok": is_ok,
        "model": "qwen2 tiny (orbitkv make-model, seeded safetensors) + a seeded LoRA adapter",
        "reference": "a vLLM server with no connector and no prefix cache; stored KV: a full "
        "prefill in an in-process engine",
        "totals": totals,
        "kv": kv,
        "requests": rows,
        "elapsed_s": round(time.monotonic() - started, 1),
    }


def _summary_line(report: dict[str, Any]) -> str:
    t = report["totals"]
    return (
        f"check exactness: {'ok' if report['ok'] else 'FAILED'} over {t['num_requests']} requests: "
        f"{t['exact_lineage_tokens_differing']} exact-lineage tokens differ, "
        f"{t['exact_requests_differing']} exact requests differ, "
        f"{t['approximate_tokens_not_opted_in']} approximate tokens reached requests that did not "
        f"opt in ({t['num_exact_tokens_compared']} stored exact tokens compared)"
    )


def lora_request(adapter: Path) -> Any:
    from vllm.lora.request import LoRARequest

    return LoRARequest(LORA_NAME, 1, str(adapter))


def ask_params(ask: Ask) -> dict[str, Any] | None:
    return dict(ask.params) if ask.params else None


if __name__ == "__main__":
    sys.exit(main())
