"""Helpers of the routing suite: entries keyed as the connector keys them, vLLM's own block
hashes for a prompt, and events through vLLM's msgspec wire format."""

from __future__ import annotations

import time

import msgspec
import torch
from orbitkv.store.entry import make_entry
from orbitkv.store.keys import EntryKey, antecedent_hash, chunk_cid
from vllm.distributed.kv_events import KVEventBatch
from vllm.utils.hashing import sha256_cbor
from vllm.v1.core import kv_cache_utils

BS = 4
FP = "model-fp-routing"


def cid_of(tokens) -> str:
    return chunk_cid(FP, "flash", "tenant-a", list(tokens))


def vllm_block_hashes(prompt: list[int], block_size: int = BS) -> list[bytes]:
    """vLLM's prefix-cache chain for a prompt, computed by vLLM's own functions."""
    kv_cache_utils.init_none_hash(sha256_cbor)
    out: list[bytes] = []
    parent = None
    for start in range(0, len(prompt) - block_size + 1, block_size):
        parent = kv_cache_utils.hash_block_tokens(
            sha256_cbor, parent, prompt[start : start + block_size], None
        )
        out.append(parent)
    return out


def entry(kind: str, num_tokens: int, antecedent: list[str] | None = None, seed: int = 0,
          nbytes_pad: int = 0):
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(2):
        for part in "kv":
            tensors[f"{part}.{layer}"] = torch.randn(num_tokens + nbytes_pad, 2, 8, generator=g)
    kw = {"antecedent": antecedent or [], "start_pos": 0} if kind == "conditioned" else {}
    return make_entry(kind, tensors, model_fingerprint=FP, layout="flash", **kw)


def conditioned_key(cid: str, antecedent: list[str]) -> str:
    return EntryKey(cid, "conditioned", antecedent_hash(antecedent)).to_str()


def canonical_key(cid: str) -> str:
    return EntryKey(cid, "canonical").to_str()


def wire(events: list) -> KVEventBatch:
    """Encode as vLLM's ZMQ publisher does and decode with vLLM's class, as a router would."""
    payload = msgspec.msgpack.Encoder().encode(KVEventBatch(ts=time.time(), events=events))
    return msgspec.msgpack.Decoder(type=KVEventBatch).decode(payload)


def dynamo_event(event_id: int, event, block_size: int) -> bytes | None:
    """One decoded vLLM event as Dynamo's router event JSON (``RadixTree.apply_event``): Dynamo
    matches by its own hash of each block's tokens (``compute_block_hash_for_seq``) and keeps the
    engine's block hashes as the blocks' names, as its vLLM relay does."""
    import json

    from dynamo._core import compute_block_hash_for_seq
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

    if isinstance(event, BlockStored):
        local = compute_block_hash_for_seq(list(event.token_ids), block_size,
                                           lora_name=event.lora_name)
        blocks = [{"block_hash": h, "tokens_hash": t}
                  for h, t in zip(event.block_hashes, local, strict=True)]
        data = {"stored": {"parent_hash": event.parent_block_hash, "blocks": blocks}}
    elif isinstance(event, BlockRemoved):
        data = {"removed": {"block_hashes": list(event.block_hashes)}}
    elif isinstance(event, AllBlocksCleared):
        data = "cleared"
    else:
        return None
    return json.dumps({"event_id": event_id, "data": data}).encode()
