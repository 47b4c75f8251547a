"""The live audit's engine side: sample requests that received approximate KV, read the verdicts.

The engine cannot recompute a request exactly on its own (that is a forward pass it must schedule),
so the audit is split at a directory (``audit_dir``):
- here, a finished request that was served approximate KV is sampled (``audit_fraction``) and
  written to ``pending/`` as what is needed to replay it: its prompt token ids, salt, tenant and the
  approximate modes and modalities it was served;
- ``orbitkv serve``'s auditor (``orbitkv/serving/audit.py``) replays each sample in idle time, once
  as the request asked and once exact, compares the first token (top-1 and KL), and writes
  ``verdicts.json``: per model, mode and modality, the samples audited, how many disagreed, and
  whether the mode is switched off;
- ``AuditVerdicts`` re-reads that file when it changes, and the policy gate (``calibration.py``)
  stops serving a switched-off mode at once.

Only text prompts are sampled: a replay by token ids cannot carry images (counted as
``audit_unauditable``).
"""

from __future__ import annotations

import json
import logging
import os
import random
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from .calibration import ANY_MODALITY, write_json_atomic
from .planner import APPROXIMATE_MODES, INHERITED

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from .options import RequestOptions

logger = logging.getLogger(__name__)

VERDICTS = "verdicts.json"
PENDING = "pending"
# Samples waiting for the auditor are capped: a stopped auditor must not fill the disk.
MAX_PENDING = 256
VERDICT_CHECK_INTERVAL_S = 1.0


class AuditVerdicts:
    """The auditor's verdicts, read again when the file changes (checked at most once a second)."""

    def __init__(self, audit_dir: Path) -> None:
        self._path = Path(audit_dir) / VERDICTS
        self._mtime_ns = -1
        self._checked_at = 0.0
        self._off: dict[tuple[str, str], frozenset[str]] = {}
        self.num_switched_off = 0

    def switched_off(self, model_fingerprint: str, mode: str) -> frozenset[str]:
        """Modalities the audit switched ``mode`` off for on this model."""
        self._refresh()
        return self._off.get((model_fingerprint, mode), frozenset())

    def _refresh(self) -> None:
        now = time.monotonic()
        if now - self._checked_at < VERDICT_CHECK_INTERVAL_S:
            return
        self._checked_at = now
        try:
            mtime_ns = self._path.stat().st_mtime_ns
        except OSError:
            return
        if mtime_ns == self._mtime_ns:
            return
        try:
            doc = json.loads(self._path.read_text())
        except (OSError, ValueError):
            logger.warning("OrbitKV: cannot read the audit's verdicts %s; keeping the last", self._path)
            return
        self._mtime_ns = mtime_ns
        off: dict[tuple[str, str], set[str]] = {}
        for fp, cells in (doc.get("models") or {}).items():
            for cell in cells.values():
                if cell.get("is_off"):
                    off.setdefault((fp, cell["mode"]), set()).add(cell.get("modality", ANY_MODALITY))
        newly = sum(len(v) for v in off.values()) - sum(len(v) for v in self._off.values())
        if newly > 0:
            self.num_switched_off += newly
            logger.warning("OrbitKV: the live audit switched off %s", sorted(
                f"{mode} for {m}" for (_, mode), ms in off.items() for m in ms))
        self._off = {k: frozenset(v) for k, v in off.items()}


class AuditSampler:
    """Writes a share of the finished approximate requests to ``pending/`` for the auditor."""

    def __init__(self, audit_dir: Path, fraction: float, model_fingerprint: str) -> None:
        self._pending = Path(audit_dir) / PENDING
        self._fraction = fraction
        self._fingerprint = model_fingerprint
        self._rng = random.Random()

    def offer(
        self, request: Request, options: RequestOptions, served_modes: Iterable[str],
        modalities: Iterable[str],
    ) -> str:
        """Sample ``request`` (served ``served_modes``): "sampled", "skipped" or "unauditable"."""
        modes = sorted(set(served_modes) & APPROXIMATE_MODES - {INHERITED})
        if not modes or self._rng.random() >= self._fraction:
            return "skipped"
        if getattr(request, "mm_features", None) or getattr(request, "prompt_embeds", None) is not None:
            return "unauditable"
        try:
            self._pending.mkdir(parents=True, exist_ok=True)
            if sum(1 for _ in os.scandir(self._pending)) >= MAX_PENDING:
                return "skipped"
            sample = {
                "model_fingerprint": self._fingerprint,
                "request_id": str(request.request_id),
                "prompt_token_ids": list(request.prompt_token_ids or ()),
                "cache_salt": getattr(request, "cache_salt", None),
                "orbitkv": {
                    "approximate": True,
                    "modes": sorted(options.modes),
                    "tenant": options.tenant,
                    "chunk_boundaries": list(options.chunk_boundaries),
                    **({"patch_rank": options.patch_rank} if options.patch_rank else {}),
                },
                "served_modes": modes,
                "modalities": sorted(set(modalities)) or ["text"],
            }
            name = f"{time.time_ns()}-{abs(hash(request.request_id)) % 10**8}.json"
            write_json_atomic(self._pending / name, sample)
        except OSError:
            logger.warning("OrbitKV: cannot write an audit sample to %s", self._pending, exc_info=True)
            return "skipped"
        return "sampled"
