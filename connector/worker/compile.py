"""``orbitkv store compile --model DIR``: form every patch a store allows, with no forward.

For each canonical ``KV(B|anchor)`` in the persistent tiers, the conditioned entries of B stored so
far get their patch (this ordering's and the orbit's, ``connector/worker/patching.py``) unless it is
stored already. A patch needs the model's RoPE to relocate the canonical, so ``--model`` names the
model directory (its Hugging Face config); entries stored under another RoPE are skipped, and
counted. The live writer does the same when a canonical lands; this is the offline pass, e.g.
after importing entries or changing ``patch_rank``.
"""

from __future__ import annotations

import argparse
from collections import Counter
from typing import TYPE_CHECKING, Any

import torch
from orbitkv.store import cli as store_cli

if TYPE_CHECKING:
    from orbitkv.kernels.rope import RopeSpec
    from orbitkv.store.entry import Entry
    from orbitkv.store.tiered import TieredStore

    from orbitkv.config import OrbitKVConfig


def identity_for(entry: Entry, rope: RopeSpec) -> Any:
    """The model identity a patch needs, read off a stored canonical (and the model's RoPE)."""
    from orbitkv.connector.identity import ModelIdentity

    meta = entry.meta
    is_mla = meta.layout.startswith("mla")
    first = entry.tensors["kv.0" if is_mla else "k.0"]
    return ModelIdentity(
        model_fingerprint=meta.model_fingerprint,
        layout=meta.layout,
        cache_dtype=first.dtype,
        num_layers=meta.num_layers,
        num_kv_heads=1 if is_mla else int(first.shape[1]),
        head_dim=int(first.shape[-1]),
        is_mla=is_mla,
        rope=rope,
        rope_hash=meta.rope_hash,
        anchor_ids=(),
    )


def compile_store(
    store: TieredStore, keys: list[str], rope: RopeSpec, config: OrbitKVConfig
) -> dict[str, Any]:
    from orbitkv.connector.worker.patching import PatchFormer
    from orbitkv.store.keys import EntryKey

    counts: Counter[str] = Counter()
    canonicals = [k for k in keys if k.split(":")[1:2] == ["canonical"]]
    for key in canonicals:
        (canonical,) = store.get([key])
        if canonical is None:
            counts["unreadable canonicals"] += 1
            continue
        if not canonical.meta.rope_hash.startswith(rope.fingerprint()):
            counts["canonicals under another RoPE"] += 1
            continue
        former = PatchFormer(store, identity_for(canonical, rope), config)
        with torch.no_grad():
            items = former.for_canonical(EntryKey.parse(key).cid, canonical)
        if items:
            store.put_many(items)
        counts["canonicals"] += 1
        counts["patches formed"] += len(items)
    store.flush()
    return {"num_canonicals": len(canonicals), **dict(counts)}


def cmd_compile(
    cfg: OrbitKVConfig, tiers: dict[str, Any], args: argparse.Namespace
) -> dict[str, Any]:
    from orbitkv.kernels.rope import RopeSpec
    from orbitkv.store.tiered import TieredStore
    from transformers import AutoConfig

    if not args.model:
        raise ValueError("compile needs --model DIR (the model's config gives its RoPE)")
    rope = RopeSpec.from_hf_config(AutoConfig.from_pretrained(args.model))
    store = TieredStore(backends=list(tiers.values()))
    keys = sorted({k for tier in tiers.values() for k in tier.iter_keys()})
    return compile_store(store, keys, rope, cfg)


def _model_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="the model directory (its config gives the RoPE)")


def main(argv: list[str] | None = None) -> int:
    """``orbitkv store compile ARGS``: the store tool's tiers and flags, plus ``--model``."""
    return store_cli.run(["compile", *(argv or [])], {"compile": cmd_compile}, _model_argument)
