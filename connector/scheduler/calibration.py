"""Which approximate modes this model may serve: the calibration table, and the audit's verdicts.

A mode is approximate: its answers differ from a full prefill's on some prompts, how often depends
on the model (the paper's 7B VLMs keep 98-100% of answers; SmolLM2-135M's relocated text keeps about
half). So approximate KV is served only in a mode that a measurement on the served model put within
the answer budget: ``orbitkv bench fidelity --write-calibration FILE`` writes the table, one row per
(modality, mode) measured, for one model fingerprint (``identity.py``). The connector reads it once at
start-up (``calibration_file``); a malformed file fails the start naming the key.

The live audit (``audit.py``) may later switch a mode off for this model: its verdicts file sits
beside the samples and is read again whenever it changes.
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .planner import (
    APPROXIMATE_MODES,
    BLIND,
    INHERITED,
    ORBIT,
    PATCHED,
    RECOMPUTE,
    SURVIVOR,
    TRANSFER,
)

if TYPE_CHECKING:
    from orbitkv.config import OrbitKVConfig

    from .audit import AuditVerdicts

logger = logging.getLogger(__name__)

FORMAT = "orbitkv-calibration-v1"
CALIBRATED_MODES = (SURVIVOR, TRANSFER, PATCHED, ORBIT, BLIND, RECOMPUTE)
ANY_MODALITY = "*"


@dataclass(frozen=True, slots=True)
class CalibrationRow:
    modality: str
    mode: str
    num_questions: int
    agreement: float
    is_within_budget: bool
    patch_rank: int = 0
    # The share of a chunk a recompute row was measured at (another share is not calibrated).
    recompute_fraction: float = 0.0


@dataclass(frozen=True, slots=True)
class Calibration:
    """The modes measured within budget on one model, per modality."""

    model_fingerprint: str
    rows: tuple[CalibrationRow, ...]
    budget: Mapping[str, float]

    def allowed(
        self, mode: str, patch_rank: int = 0, recompute_fraction: float = 0.0
    ) -> frozenset[str]:
        """Modalities ``mode`` was measured within budget for (patches: at ``patch_rank``;
        recompute: at ``recompute_fraction``, a row without a fraction never allows it)."""
        return frozenset(
            r.modality for r in self.rows
            if r.mode == mode and r.is_within_budget
            and (mode not in (PATCHED, ORBIT) or not r.patch_rank or r.patch_rank == patch_rank)
            and (mode != RECOMPUTE or math.isclose(r.recompute_fraction, recompute_fraction))
        )


def first_token_kl(ref: Mapping[str, float], arm: Mapping[str, float]) -> float | None:
    """KL(P_ref || P_arm) in nats over the union of two top-k logprob maps (token -> logprob): the
    calibration table's KL column and the live audit's budget measure the same thing.

    A token missing from one map counts at that map's smallest logprob (it is at most that likely).
    """
    if not ref or not arm:
        return None
    floor_ref, floor_arm = min(ref.values()), min(arm.values())
    union = set(ref) | set(arm)
    p = {t: math.exp(ref.get(t, floor_ref)) for t in union}
    q = {t: math.exp(arm.get(t, floor_arm)) for t in union}
    zp, zq = sum(p.values()), sum(q.values())
    return max(0.0, sum((p[t] / zp) * math.log((p[t] / zp) / (q[t] / zq)) for t in union))


def load_calibration(path: str | os.PathLike[str], model_fingerprint: str) -> Calibration:
    """The table's rows for ``model_fingerprint`` (none: every approximate mode is uncalibrated).

    Raises ``ValueError`` naming ``calibration_file`` for a file that is missing or malformed."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"calibration_file: cannot read {path}: {exc}") from None
    tables = doc if isinstance(doc, list) else [doc]
    rows: list[CalibrationRow] = []
    budget: dict[str, float] = {}
    for table in tables:
        if not isinstance(table, Mapping) or table.get("format") != FORMAT:
            raise ValueError(f"calibration_file: {path} is not an {FORMAT} table")
        if table.get("model_fingerprint") != model_fingerprint:
            continue
        budget = {k: float(v) for k, v in (table.get("budget") or {}).items() if v is not None}
        for i, raw in enumerate(table.get("rows") or ()):
            try:
                row = CalibrationRow(
                    modality=str(raw["modality"]), mode=str(raw["mode"]),
                    num_questions=int(raw["num_questions"]), agreement=float(raw["agreement"]),
                    is_within_budget=bool(raw["is_within_budget"]),
                    patch_rank=int(raw.get("patch_rank") or 0),
                    recompute_fraction=float(raw.get("recompute_fraction") or 0.0),
                )
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"calibration_file: {path}: row {i}: {exc!r}") from None
            if row.mode not in CALIBRATED_MODES:
                raise ValueError(f"calibration_file: {path}: row {i}: unknown mode {row.mode!r}")
            rows.append(row)
    if not rows:
        logger.warning(
            "OrbitKV: %s has no rows for model fingerprint %s: every approximate mode is "
            "uncalibrated for this model and is served exact", path, model_fingerprint,
        )
    return Calibration(model_fingerprint, tuple(rows), budget)


def write_calibration(
    path: str | os.PathLike[str], model_fingerprint: str, model: str,
    rows: Iterable[Mapping[str, Any]], budget: Mapping[str, float],
) -> None:
    """Write a table (replacing this fingerprint's table if the file holds others)."""
    path = Path(path)
    tables: list[Any] = []
    if path.exists():
        old = json.loads(path.read_text())
        tables = [t for t in (old if isinstance(old, list) else [old])
                  if t.get("model_fingerprint") != model_fingerprint]
    tables.append({"format": FORMAT, "model_fingerprint": model_fingerprint, "model": model,
                   "budget": dict(budget), "rows": [dict(r) for r in rows]})
    write_json_atomic(path, tables[0] if len(tables) == 1 else tables)


def write_json_atomic(path: Path, doc: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


class ModeGate:
    """The modes this model may serve approximately, per modality: the configured scope, narrowed
    by the calibration (when required) and by the audit's verdicts. ``scope(mode)`` is the set of
    modalities (``"*"``: all), empty when the mode is off."""

    def __init__(
        self, config: OrbitKVConfig, model_fingerprint: str,
        audit_verdicts: AuditVerdicts | None = None,
    ) -> None:
        self._is_required = bool(config.require_calibration)
        self._fingerprint = model_fingerprint
        self._calibration = (
            load_calibration(config.calibration_file, model_fingerprint)
            if config.calibration_file else None
        )
        self._verdicts = audit_verdicts
        self._refused_logged: set[tuple[str, str]] = set()
        if config.approximate_reuse != "off" and not self._is_required:
            logger.warning(
                "OrbitKV: require_calibration is off: approximate modes are served without a "
                "measurement on this model (a lab or bench setting, not for production)"
            )

    def narrow(
        self, mode: str, configured: tuple[str, ...], patch_rank: int,
        recompute_fraction: float = 0.0,
    ) -> tuple[str, ...]:
        """``configured`` (modalities, ``"*"`` for all) narrowed to what may be served."""
        scope = frozenset(configured)
        if self._is_required:
            measured = (
                self._calibration.allowed(mode, patch_rank, recompute_fraction)
                if self._calibration else frozenset()
            )
            scope = measured if ANY_MODALITY in scope else scope & measured
            if not scope:
                self._refuse(mode, "*", "no calibration row within budget for this model")
        off = self._verdicts.switched_off(self._fingerprint, mode) if self._verdicts else ()
        if off and scope:
            self._refuse(mode, ",".join(sorted(off)), "switched off by the live audit")
            # A scope of every modality cannot leave one out: the mode is then off for all.
            scope = frozenset() if ANY_MODALITY in scope or ANY_MODALITY in off else scope - off
        return tuple(sorted(scope))

    def _refuse(self, mode: str, modality: str, why: str) -> None:
        if (mode, modality) not in self._refused_logged:
            self._refused_logged.add((mode, modality))
            logger.warning("OrbitKV: approximate mode %s refused for %s: %s", mode, modality, why)


# Modes whose scope the gate decides (inherited comes with any approximate policy).
GATED_MODES = frozenset(APPROXIMATE_MODES - {INHERITED})
