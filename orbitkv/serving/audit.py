"""The live audit's server side: replay sampled approximate requests exactly, in idle time.

The engine writes samples (``connector/scheduler/audit.py``); this replays each one while the server is idle
(no request running or waiting), twice through the OpenAI completions API with the prompt as token
ids and one generated token with its top logprobs: once as the request asked (its approximate KV is
found again: the same policy's entries and prefix-cache blocks) and once exact (``load: false``, no
approximate KV can reach it). It disagrees when the first token differs or the first token's KL
exceeds ``audit_max_kl``. Per model, mode and modality the counts go to ``verdicts.json``; once
``audit_min_samples`` are in and the disagreement share exceeds the budget (the calibration's
``1 - min_agreement``, else ``audit_max_disagreement``), the mode is switched off for that model
and modality, which the engine picks up within a second.

``orbitkv serve`` runs it in a child process beside vLLM; ``orbitkv audit --url URL`` runs it alone
(a sidecar).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

# One KL for the audit and the calibration it is judged against (``bench fidelity``'s): a token
# missing from one side's top list at that list's smallest logprob (the most it can have), so the
# audit's audit_max_kl and the calibration table's KL column measure the same thing.
from orbitkv.connector.scheduler.audit import PENDING, VERDICTS
from orbitkv.connector.scheduler.calibration import first_token_kl, write_json_atomic
from orbitkv.serving.http_client import first_model_id, http_post_json, scrape_metrics

logger = logging.getLogger(__name__)

TOP_LOGPROBS = 20


class Auditor:
    def __init__(self, base_url: str, audit_dir: str | os.PathLike[str], config: Any) -> None:
        self._url = base_url
        self._dir = Path(audit_dir)
        self._max_kl = float(config.audit_max_kl)
        self._min_samples = int(config.audit_min_samples)
        self._max_disagreement = _budget(config)
        self._model: str | None = None

    def is_idle(self) -> bool:
        metrics = scrape_metrics(self._url)
        if not metrics:
            return False
        return not metrics.get("vllm:num_requests_running") and not metrics.get("vllm:num_requests_waiting")

    def run_pending(self, is_idle: Callable[[], bool] | None = None) -> int:
        """Audit the waiting samples, each once the server is idle; the number audited."""
        is_idle = is_idle or self.is_idle
        pending = self._dir / PENDING
        names = sorted(p.name for p in pending.glob("*.json")) if pending.is_dir() else []
        num_audited = 0
        for name in names:
            if not is_idle():
                break
            path = pending / name
            try:
                sample = json.loads(path.read_text())
            except (OSError, ValueError):
                path.unlink(missing_ok=True)
                continue
            verdict = self.audit(sample)
            path.unlink(missing_ok=True)
            if verdict is not None:
                self._record(sample, *verdict)
                num_audited += 1
        return num_audited

    def audit(self, sample: Mapping[str, Any]) -> tuple[bool, float] | None:
        """(disagrees, KL) of one sample's first token against its exact replay; None on error."""
        opts = dict(sample["orbitkv"])
        approx = self._first_token(sample, opts)
        exact = self._first_token(sample, {"load": False, "save": False,
                                           "tenant": opts.get("tenant", "")})
        if approx is None or exact is None:
            return None
        kl = first_token_kl(exact[1], approx[1])
        if kl is None:  # a replay without top logprobs measures nothing
            return None
        return (approx[0] != exact[0] or kl > self._max_kl), kl

    def _first_token(self, sample: Mapping[str, Any], opts: Mapping[str, Any]) -> tuple[str, dict] | None:
        if self._model is None:
            self._model = first_model_id(self._url)
        body: dict[str, Any] = {
            "model": self._model, "prompt": list(sample["prompt_token_ids"]), "max_tokens": 1,
            "temperature": 0.0, "logprobs": TOP_LOGPROBS, "kv_transfer_params": {"orbitkv": opts},
        }
        if sample.get("cache_salt"):
            body["cache_salt"] = sample["cache_salt"]
        status, data = http_post_json(self._url, "/v1/completions", body, timeout=120.0)
        if status != 200 or not isinstance(data, dict):
            logger.warning("OrbitKV audit: replay failed (%s): %s", status, str(data)[:200])
            return None
        lp = data["choices"][0]["logprobs"]
        return lp["tokens"][0], dict(lp["top_logprobs"][0])

    def _record(self, sample: Mapping[str, Any], disagrees: bool, kl: float) -> None:
        path = self._dir / VERDICTS
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            doc = {"format": "orbitkv-audit-v1", "models": {}}
        cells = doc["models"].setdefault(sample["model_fingerprint"], {})
        for mode in sample["served_modes"]:
            for modality in sample["modalities"]:
                cell = cells.setdefault(f"{mode}:{modality}", {
                    "mode": mode, "modality": modality, "num_samples": 0, "num_disagreed": 0,
                    "kl_sum": 0.0, "is_off": False})
                cell["num_samples"] += 1
                cell["num_disagreed"] += int(disagrees)
                cell["kl_sum"] += kl
                share = cell["num_disagreed"] / cell["num_samples"]
                if (not cell["is_off"] and cell["num_samples"] >= self._min_samples
                        and share > self._max_disagreement):
                    cell["is_off"] = True
                    logger.warning(
                        "OrbitKV audit: mode %s switched off for %s on model %s: %d of %d audited "
                        "requests disagreed with an exact recompute (budget %.3f)", mode, modality,
                        sample["model_fingerprint"], cell["num_disagreed"], cell["num_samples"],
                        self._max_disagreement,
                    )
        write_json_atomic(path, doc)

    def loop(self, interval_s: float = 1.0, should_stop: Callable[[], bool] = lambda: False) -> None:
        while not should_stop():
            try:
                self.run_pending()
            except Exception:
                logger.warning("OrbitKV audit: a round failed", exc_info=True)
            time.sleep(interval_s)


def _budget(config: Any) -> float:
    """The disagreement share a mode may reach: the calibration's budget where one is given."""
    if config.calibration_file:
        try:
            doc = json.loads(Path(config.calibration_file).read_text())
            tables = doc if isinstance(doc, list) else [doc]
            agreements = [t["budget"]["min_agreement"] for t in tables
                          if (t.get("budget") or {}).get("min_agreement") is not None]
            if agreements:
                return 1.0 - max(float(a) for a in agreements)
        except (OSError, ValueError, KeyError, TypeError):
            pass
    return float(config.audit_max_disagreement)


def run_beside(base_url: str, audit_dir: Path, config: Any, parent_pid: int) -> None:
    """The auditor in a forked child: runs until the process it was forked from is gone."""
    Auditor(base_url, audit_dir, config).loop(should_stop=lambda: os.getppid() != parent_pid)


def main(argv: list[str] | None = None) -> int:
    import argparse

    from orbitkv.config import OrbitKVConfig

    p = argparse.ArgumentParser(prog="orbitkv audit", description=__doc__.split("\n")[0])
    p.add_argument("--url", required=True, help="the vLLM server, e.g. http://127.0.0.1:8000")
    p.add_argument("--config", help="the OrbitKV config file the server runs with")
    p.add_argument("--once", action="store_true", help="audit what is pending, then exit")
    args = p.parse_args(argv)
    config = OrbitKVConfig.load(args.config)
    if config.audit_path is None:
        print("orbitkv audit: no audit_dir (and no local_disk) in the config", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO)
    auditor = Auditor(args.url, config.audit_path, config)
    if args.once:
        print(json.dumps({"audited": auditor.run_pending()}))
        return 0
    auditor.loop()
    return 0
