"""Encoder outputs as store entries: their keys, and building and checking the entries.

An encoder output is what vLLM's model runner keeps in its encoder cache for one multimodal item:
a tensor whose first dimension is the item's embeddings (``mm_position.get_num_embeds()``). It is
stored as an entry of kind ``encoder`` with one tensor, ``enc.0``, in the same format, tiers and
checks as KV entries (``store/entry.py``).

Its key is ``okv2:encoder:<cid>``, where the cid hashes what decides the output and who may read
it: the model fingerprint (weights, dtype, quantization: ``connector/identity.py``), OrbitKV's
tenant, vLLM's ``cache_salt`` and the item's identity (``connector/mm_identity.py``: a hash of its
processed inputs and the LoRA prefix vLLM adds where a LoRA changes the vision tower; never a
client-given uuid unless ``trust_client_mm_ids``). Each field is tagged and length-prefixed, as in
``store/keys.py``, so no two inputs share a byte stream.
"""

from __future__ import annotations

import functools
import struct

import torch
import xxhash
from orbitkv.store.entry import Entry, make_entry
from orbitkv.store.keys import KEY_VERSION, EntryKey

KIND = "encoder"
TENSOR = "enc.0"
LAYOUT = "encoder"

_U64 = struct.Struct("<Q")


def _field(tag: bytes, value: str) -> bytes:
    if not isinstance(value, str):
        raise TypeError(f"expected str for {tag.decode()}, got {type(value).__name__}")
    data = value.encode("utf-8")
    return tag + _U64.pack(len(data)) + data


def encoder_cid(model_fingerprint: str, tenant: str, cache_salt: str, mm_hash: str) -> str:
    """32 hex chars of xxh3-128 over the fields above; never equal to a KV chunk's cid (tag E)."""
    if not mm_hash:
        raise ValueError("an encoder output needs vLLM's item identifier (mm_hash)")
    h = xxhash.xxh3_128()
    for tag, value in (
        (b"V", KEY_VERSION),
        (b"E", KIND),
        (b"F", model_fingerprint),
        (b"S", tenant),
        (b"C", cache_salt),
        (b"M", mm_hash),
    ):
        h.update(_field(tag, value))
    return h.hexdigest()


@functools.lru_cache(maxsize=4096)
def encoder_key(model_fingerprint: str, tenant: str, cache_salt: str, mm_hash: str) -> str:
    """The entry key (``okv2:encoder:<cid>``); a recurring item's costs a lookup."""
    return EntryKey(encoder_cid(model_fingerprint, tenant, cache_salt, mm_hash), KIND).to_str()


def make_encoder_entry(output: torch.Tensor, model_fingerprint: str) -> Entry:
    """An entry holding ``output`` (a CPU tensor, at least 1-D: dim 0 is the embeddings)."""
    if output.dim() < 1 or output.shape[0] == 0:
        raise ValueError(f"an encoder output needs embeddings along dim 0, got {tuple(output.shape)}")
    return make_entry(KIND, {TENSOR: output}, model_fingerprint=model_fingerprint, layout=LAYOUT)


def output_of(entry: Entry | None, num_embeds: int) -> torch.Tensor | None:
    """The stored output if ``entry`` is a verified encoder entry with ``num_embeds`` embeddings.

    Anything else (no entry, another kind, a missing tensor, another size) is None: the encoder
    then runs. vLLM refuses a cached output of the wrong size, so a size check here keeps a
    clashing identifier (a trusted client's reused uuid) a miss rather than a failed request.
    """
    if entry is None or entry.meta.kind != KIND or entry.meta.layout != LAYOUT:
        return None
    output = entry.tensors.get(TENSOR)
    if output is None or output.dim() < 1 or output.shape[0] != num_embeds:
        return None
    return output
