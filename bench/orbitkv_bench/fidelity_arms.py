"""The arms of ``bench fidelity``: which reuse mode each one measures, the OrbitKV config that
enables it, the server it runs on, and its requests.

Every arm allows ``exact`` plus its own mode, in its own ``cache_salt`` (so arms sharing a server
never share entries). Arms whose configs agree share one server: ``base`` (exact, survivor,
transfer, blind, recompute at each fraction, and orbit at the largest rank) and one server per
patch rank (patched). The ``apc`` arm is vLLM's own prefix cache on a server of its own without
OrbitKV: the baseline a deployment has without OrbitKV.
vLLM's prefix cache is off on every server, so each token a request does not compute was served
by OrbitKV in the arm's mode; the reference is the same prompt with OrbitKV off
(``load``/``save`` false) on the base server: a full prefill.

Patched arms store the patch in place of the conditioned entry (``patch_replaces_conditioned``),
so a context that recurs (``revisit``) is served as canonical + patch rather than exact; blind,
patched, orbit and recompute arms register each record (its canonical) when it is first shown.
A recompute arm (selective recompute, ``connector/scheduler/recompute.py``) loads each moved record
as its canonical, relocated, and has vLLM compute the record's first ``recompute_fraction`` of
tokens in context.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

OFF = {"orbitkv": {"load": False, "save": False}}
REFERENCE = "reference"
# The approximate-reuse policy a bench of uncalibrated modes needs, once the server knows it: the
# request opts in (``approximate: true``) and the deployment allows uncalibrated modes.
POLICY_KEYS = {"approximate_reuse": "request", "require_calibration": False}
REGISTERING_MODES = ("blind", "patched", "orbit", "recompute")
APC = "apc"


@dataclass(frozen=True)
class ArmSpec:
    name: str
    mode: str  # exact, survivor, transfer, blind, patched, orbit, recompute, apc
    server: str  # the key of the server it runs on
    patch_rank: int = 0
    recompute_fraction: float = 0.0

    @property
    def is_registering(self) -> bool:
        return self.mode in REGISTERING_MODES

    def request_options(self, chunk_boundaries: Sequence[int]) -> dict[str, Any] | None:
        if self.mode == APC:
            return None  # a server without OrbitKV
        modes = ["exact"] if self.mode == "exact" else ["exact", self.mode]
        options: dict[str, Any] = {"modes": modes, "chunk_boundaries": list(chunk_boundaries)}
        if self.mode != "exact":
            options["approximate"] = True
        if self.patch_rank:
            options["patch_rank"] = self.patch_rank
        if self.recompute_fraction:
            options["recompute_fraction"] = self.recompute_fraction
        return {"orbitkv": options}


def arm_specs(
    ranks: Sequence[int], modes: Sequence[str], fractions: Sequence[float] = (0.05, 0.15, 0.3)
) -> list[ArmSpec]:
    """The arms for ``modes`` (patched once per rank; recompute once per fraction; orbit at the
    largest rank, its conditioned entries kept: an orbit patch serves a reordering, the ordering
    seen keeps its exact entry)."""
    out = []
    for mode in modes:
        if mode == "recompute":
            out += [
                ArmSpec(f"recompute_{round(f * 100):g}", "recompute", "base", recompute_fraction=f)
                for f in fractions
            ]
        elif mode == APC:
            out.append(ArmSpec(APC, APC, APC))
        elif mode == "patched":
            out += [ArmSpec(f"patched_r{m}", "patched", f"r{m}", m) for m in ranks]
        elif mode == "orbit":
            out.append(ArmSpec("orbit", "orbit", "base", max(ranks)))
        elif mode in ("exact", "survivor", "transfer", "blind"):
            out.append(ArmSpec(mode, mode, "base"))
        else:
            raise ValueError(f"unknown mode {mode!r}")
    return out


def policy_config() -> dict[str, Any]:
    """The server side of the opt-in: requests that send ``approximate: true`` may receive the
    arms' modes, uncalibrated (this bench is what calibrates them)."""
    return dict(POLICY_KEYS)


def arm_config(
    server: str, arms: Sequence[ArmSpec], store_dir: Path, anchor: Sequence[int]
) -> dict[str, Any]:
    """``kv_connector_extra_config`` for one server: every mode its arms measure, records as
    whole chunks (fixed runs cut at the client's boundaries, each record under ``chunk_size``)."""
    modes = {a.mode for a in arms if a.server == server}
    fractions = [a.recompute_fraction for a in arms if a.server == server and a.recompute_fraction]
    ranks = [a.patch_rank for a in arms if a.server == server and a.patch_rank]
    orbitkv: dict[str, Any] = {
        "anchor_tokens": list(anchor),
        "text_chunking": "fixed",
        "enable_survivor": "survivor" in modes,
        "enable_blind": "blind" in modes,
        "transfer_modalities": ["text"] if "transfer" in modes else [],
        "patch_rank": max(ranks) if ranks else 0,
        "patch_replaces_conditioned": "patched" in modes,
        "enable_recompute": "recompute" in modes,
        **({"recompute_fraction": min(fractions)} if fractions else {}),
        # Form the patch at every measured rank: the default (0.5 of the record's KV bytes)
        # refuses rank 32 on a record of this model (KV width 192), so nothing would be measured.
        "patch_max_bytes_fraction": 4.0,
        **policy_config(),
    }
    return {
        "chunk_size": 256,
        "local_cpu": True,
        "max_local_cpu_size": 0.5,
        "local_disk": f"file://{store_dir.resolve()}",
        "max_local_disk_size": 1.0,
        "orbitkv": orbitkv,
    }


def token_offsets(tokenizer: Any, prompt: str) -> tuple[list[int], list[int]]:
    """(token ids, each token's start character) of a rendered prompt."""
    enc = tokenizer(prompt, add_special_tokens=False, return_offsets_mapping=True)
    return list(enc["input_ids"]), [int(s) for s, _ in enc["offset_mapping"]]


def boundaries_at(starts: Sequence[int], num_tokens: int, chars: Sequence[int]) -> list[int]:
    """The token index starting at each character offset in ``chars`` (a record's start or end);
    ``ValueError`` when a record edge falls inside a token (its chunk would not be the record)."""
    index = {c: i for i, c in enumerate(starts)}
    out = []
    for c in chars:
        if c not in index:
            raise ValueError(f"a record edge at character {c} falls inside a token")
        out.append(index[c])
    return sorted(set(b for b in out if 0 < b < num_tokens))


def prompt_boundaries(
    tokenizer: Any, messages: list[dict[str, Any]], user: str, spans: Sequence[tuple[int, int]]
) -> tuple[list[int], list[int]]:
    """(token ids, record boundaries) of a chat whose user turn is ``user`` (records: ``spans``)."""
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    base = prompt.index(user)
    ids, starts = token_offsets(tokenizer, prompt)
    chars = [base + c for span in spans for c in span]
    return ids, boundaries_at(starts, len(ids), chars)


_INFO = re.compile(r'^vllm:orbitkv_model_info\{[^}]*model_fingerprint="([0-9a-fA-F]+)"', re.M)


def fingerprint_from_metrics(text: str) -> str | None:
    m = _INFO.search(text)
    return m.group(1) if m else None


def computed_fingerprint(
    model_dir: str | Path,
    *,
    dtype: str = "bfloat16",
    load_format: str = "auto",
    max_model_len: int = 4096,
) -> str:
    """The connector's model fingerprint (``connector/identity.py``) from the same engine config
    the servers build: for a server that does not report it on ``/metrics``."""
    from orbitkv.connector.identity import model_identity
    from vllm.engine.arg_utils import EngineArgs

    cfg = EngineArgs(
        model=str(model_dir),
        dtype=dtype,
        load_format=load_format,
        max_model_len=max_model_len,
        enforce_eager=True,
    ).create_engine_config()
    return model_identity(cfg, None).model_fingerprint
