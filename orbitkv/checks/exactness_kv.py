"""The stored half of ``orbitkv check exactness``: every exact entry the OrbitKV server left on disk
against a full prefill of the same prompt (``exactness.py`` has the whole check).

An in-process engine with the same model, adapter and connector settings runs each distinct prompt
of the mix (same salt, tenant and adapter, so the same chunk keys) with OrbitKV's loads and saves
off and vLLM's prefix cache emptied: a full prefill. Each chunk whose exact conditioned entry is in
the store is compared with that prefill's KV, every layer, bit for bit; a differing token is one
whose K or V differs anywhere.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from orbitkv.checks.exactness_mix import CHUNK, TENANTS, Ask


def compare_stored(
    asks: list[Ask], model_dir: Path, adapter: Path, config: dict[str, Any], store_dir: Path
) -> dict[str, Any]:
    from orbitkv.checks.engine import InProcessEngine, orbitkv_llm
    from orbitkv.checks.exactness import lora_request
    from orbitkv.store.disk import DiskBackend
    from orbitkv.store.entry import CorruptEntry, decode
    from orbitkv.store.keys import EntryKey, conditioned_key

    disk = DiskBackend(store_dir, None)
    exact = {k for k in disk.iter_keys() if _is_exact_conditioned(k, EntryKey)}
    extra = {"chunk_size": CHUNK, "orbitkv_text_chunking": "fixed", "max_local_cpu_size": 0.05,
             "orbitkv_request_tenants": list(TENANTS)}
    seen: set[tuple[Any, ...]] = set()
    checked: set[str] = set()
    out = {"num_entries": 0, "num_tokens": 0, "num_tokens_differing": 0, "num_unreadable": 0,
           "differing": []}
    with orbitkv_llm(model_dir, extra, enable_lora=True, max_lora_rank=8, max_num_seqs=1) as llm:
        eng = InProcessEngine(llm, block_size=CHUNK)
        for ask in asks:
            tenant = (ask.params or {}).get("tenant")
            what = (ask.ids, ask.cache_salt, tenant, ask.lora)
            if what in seen or ask.expect_refused:
                continue
            seen.add(what)
            params = {"load": False, "save": False, **({"tenant": tenant} if tenant else {})}
            run = eng.generate(list(ask.ids), {"orbitkv": params}, cache_salt=ask.cache_salt,
                               lora_request=lora_request(adapter) if ask.lora else None)
            for chunk in run.chunks:
                key = conditioned_key(chunk.cid, chunk.antecedent_hash)
                if key not in exact or key in checked:
                    continue
                checked.add(key)
                (raw,) = disk.batch_get([key])
                try:
                    entry = decode(raw)
                except (CorruptEntry, TypeError):
                    out["num_unreadable"] += 1  # never served either: a load verifies it
                    continue
                num_differing = _num_differing(eng, run.block_ids, chunk, entry)
                out["num_entries"] += 1
                out["num_tokens"] += chunk.length
                out["num_tokens_differing"] += num_differing
                if num_differing:
                    out["differing"].append({"key": key, "prompt": ask.name, "tokens": num_differing})
    out["num_exact_entries_on_disk"] = len(exact)
    out["num_exact_entries_not_matched"] = len(exact - checked)
    return out


def _is_exact_conditioned(key: str, entry_key: Any) -> bool:
    try:
        parsed = entry_key.parse(key)
    except ValueError:
        return False
    return parsed.kind == "conditioned" and parsed.is_exact


def _num_differing(eng: Any, block_ids: list[int], chunk: Any, entry: Any) -> int:
    """Tokens of ``chunk`` whose stored K or V differs from the prefill's, in any layer."""
    bad = torch.zeros(chunk.length, dtype=torch.bool)
    for layer in range(eng.num_layers):
        k, v = eng.kv(block_ids, chunk.start, chunk.end, layer)
        for name, want in (("k", k), ("v", v)):
            got = entry.tensors[f"{name}.{layer}"]
            if got.shape != want.shape:
                return chunk.length
            bad |= (got != want).flatten(1).any(dim=1)
    return int(bad.sum())
