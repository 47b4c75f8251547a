"""LMCache interop: prefix chunks in LMCache 0.5.6's Redis layout, read and written byte-for-byte.

What LMCache's ``RedisConnector`` (``lmcache/v1/storage_backend/connector/redis_connector.py``) keeps
for one chunk, with the ``naive`` serde (raw bytes):

- the key string ``CacheEngineKey.to_string()`` (``lmcache/utils.py``):
  ``{model_name}@{world_size}@{worker_id}@{chunk_hash:x}@{dtype}`` plus ``@{tag}%{value}`` per tag;
- two Redis strings: ``<key>kv_bytes``, the tensor's raw bytes, and ``<key>metadata``, a
  ``RemoteMetadata`` (``lmcache/v1/protocol.py``): int32 ``length, fmt`` then per group
  ``dtype_id, d0, d1, d2, d3`` (shape padded with zeros to 4-D). ``kv_bytes`` is written first and
  existence is asked of ``metadata``, so a reader never sees metadata without its payload;
- the tensor in ``KV_2LTD`` (``MemoryFormat`` 1): ``[2, num_layers, num_tokens, num_kv_heads * head_dim]``,
  K then V; MLA uses ``KV_MLA_FMT`` (6): ``[1, num_layers, num_tokens, kv_lora_rank + rope_dim]``.

Chunk hashes are LMCache's prefix chain (``lmcache/v1/token_database.py`` ``ChunkedTokenDatabase``):
``h_i = int(hash_fn((h_{i-1}, tuple(chunk_i_tokens), ())))``, ``h_{-1}`` = NONE_HASH, with vLLM's hash
functions; a digest becomes an int through its first 8 bytes, big-endian. LMCache derives NONE_HASH
through vLLM from ``PYTHONHASHSEED`` (else vLLM's fixed seed), so keys agree across processes only when
both run with the same ``PYTHONHASHSEED`` or a seed-independent algorithm (``sha256_cbor``).

A prefix chunk is ``KV(chunk | everything before it)`` at a fixed position: to OrbitKV it is a
conditioned entry, so ``to_layer_tensors`` gives the store's ``k.{layer}`` / ``v.{layer}`` tensors.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pickle
import struct
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import xxhash

from .base import Backend, Stats

FMT_KV_2LTD = 1
FMT_KV_MLA = 6
_FORMATS = (FMT_KV_2LTD, FMT_KV_MLA)
# protocol.py DTYPE_TO_INT. torch.half and torch.float16 are one object, so fp16 is written as 2;
# 1 is still read as fp16.
_DTYPE_IDS = {
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.float32: 4,
    torch.float64: 5,
    torch.uint8: 6,
    torch.float8_e4m3fn: 7,
    torch.float8_e5m2: 8,
}
_ID_DTYPES = {1: torch.float16, **{v: k for k, v in _DTYPE_IDS.items()}}
# utils.py TORCH_DTYPE_TO_STR_DTYPE, the dtype word in the key string.
_KEY_DTYPES = {
    torch.float16: "half",
    torch.bfloat16: "bfloat16",
    torch.float32: "float",
    torch.float64: "double",
    torch.int8: "int8",
    torch.uint8: "uint8",
    torch.int16: "int16",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.bool: "bool",
    torch.float8_e4m3fn: "fp8_e4m3fn",
    torch.float8_e4m3fnuz: "fp8_e4m3fnuz",
    torch.float8_e5m2: "fp8_e5m2",
    torch.float8_e5m2fnuz: "fp8_e5m2fnuz",
}
_KEY_WORDS = {v: k for k, v in _KEY_DTYPES.items()}
KV_BYTES_SUFFIX = "kv_bytes"
METADATA_SUFFIX = "metadata"
VLLM_NONE_HASH_SEED = "vllm-none-hash"  # vllm/v1/core/kv_cache_utils.py DEFAULT_NONE_HASH_SEED


class LMCacheFormatError(ValueError):
    """Bytes that are not a chunk this module can read (bad metadata, length, format or dtype)."""


@dataclasses.dataclass(frozen=True)
class LMCacheKey:
    """LMCache's ``CacheEngineKey``; ``tags`` are its ``lmcache.tag.*`` request configs, in order."""

    model_name: str
    world_size: int
    worker_id: int
    chunk_hash: int
    dtype: torch.dtype
    tags: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.dtype not in _KEY_DTYPES:
            raise ValueError(f"LMCache has no key word for dtype {self.dtype}")
        # LMCache splits the string on '@' (and a tag on its first '%'): these would not round-trip.
        fields = [self.model_name, *(t for tag in self.tags for t in tag)]
        if any("@" in f for f in fields) or any("%" in name for name, _ in self.tags):
            raise ValueError(f"'@' (or '%' in a tag name) cannot appear in an LMCache key: {self}")

    def to_string(self) -> str:
        text = (
            f"{self.model_name}@{self.world_size}@{self.worker_id}"
            f"@{self.chunk_hash:x}@{_KEY_DTYPES[self.dtype]}"
        )
        return text + "".join(f"@{name}%{value}" for name, value in self.tags)

    @classmethod
    def from_string(cls, text: str) -> LMCacheKey:
        parts = text.split("@")
        if len(parts) < 5 or parts[4] not in _KEY_WORDS:
            raise ValueError(f"not an LMCache CacheEngineKey: {text!r}")
        tags = []
        for part in parts[5:]:
            name, has_value, value = part.partition("%")
            if not has_value:
                raise ValueError(f"bad tag {part!r} in LMCache key {text!r}")
            tags.append((name, value))
        return cls(
            parts[0],
            int(parts[1]),
            int(parts[2]),
            int(parts[3], 16),
            _KEY_WORDS[parts[4]],
            tuple(tags),
        )

    @property
    def kv_bytes_key(self) -> str:
        return self.to_string() + KV_BYTES_SUFFIX

    @property
    def metadata_key(self) -> str:
        return self.to_string() + METADATA_SUFFIX


@dataclasses.dataclass(frozen=True)
class RemoteMetadata:
    """``lmcache.v1.protocol.RemoteMetadata``: payload length, memory format, one (dtype, shape) per group."""

    length: int
    fmt: int
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]

    def serialize(self) -> bytes:
        # LMCache packs with native order ("i" * n); every platform it ships for is little-endian.
        params = [self.length, self.fmt]
        for shape, dtype in zip(self.shapes, self.dtypes, strict=True):
            if len(shape) > 4:
                raise ValueError(f"LMCache metadata holds at most 4 dims, got {shape}")
            params += [_DTYPE_IDS[dtype], *shape, *[0] * (4 - len(shape))]
        return struct.pack(f"<{len(params)}i", *params)

    @classmethod
    def deserialize(cls, buf: bytes) -> RemoteMetadata:
        num_ints, rest = divmod(len(buf), 4)
        if rest or num_ints < 7 or (num_ints - 2) % 5:
            raise LMCacheFormatError(f"LMCache metadata of {len(buf)} bytes")
        values = struct.unpack(f"<{num_ints}i", buf)
        shapes, dtypes = [], []
        for i in range(2, num_ints, 5):
            if values[i] not in _ID_DTYPES:
                raise LMCacheFormatError(f"unknown LMCache dtype id {values[i]}")
            dims = list(values[i + 1 : i + 5])
            while len(dims) > 1 and dims[-1] == 0:  # protocol.strip_shape_padding
                dims.pop()
            shapes.append(tuple(dims))
            dtypes.append(_ID_DTYPES[values[i]])
        return cls(values[0], values[1], tuple(shapes), tuple(dtypes))


def pack_kv(ks: Sequence[torch.Tensor], vs: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per-layer ``k``/``v`` ``[num_tokens, num_kv_heads, head_dim]`` -> ``KV_2LTD`` tensor."""
    if not ks or len(ks) != len(vs):
        raise ValueError(f"need one v per k and at least one layer, got {len(ks)} and {len(vs)}")
    num_tokens = ks[0].shape[0]
    return torch.stack(
        [
            torch.stack([t.reshape(num_tokens, -1) for t in ks]),
            torch.stack([t.reshape(num_tokens, -1) for t in vs]),
        ]
    ).contiguous()


def unpack_kv(kv: torch.Tensor, num_kv_heads: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``KV_2LTD`` -> per-layer ``k``/``v`` ``[num_tokens, num_kv_heads, head_dim]`` (views)."""
    if kv.dim() != 4 or kv.shape[0] != 2 or kv.shape[3] % num_kv_heads:
        raise LMCacheFormatError(f"not KV_2LTD for {num_kv_heads} heads: shape {tuple(kv.shape)}")
    _, num_layers, num_tokens, hidden = kv.shape
    split = kv.reshape(2, num_layers, num_tokens, num_kv_heads, hidden // num_kv_heads)
    return list(split[0].unbind(0)), list(split[1].unbind(0))


def to_layer_tensors(kv: torch.Tensor, fmt: int, num_kv_heads: int = 1) -> dict[str, torch.Tensor]:
    """A chunk as the store's tensors: ``k.{layer}``/``v.{layer}``, or ``kv.{layer}`` for MLA."""
    if fmt == FMT_KV_MLA:
        if kv.dim() != 4 or kv.shape[0] != 1:
            raise LMCacheFormatError(f"not KV_MLA_FMT: shape {tuple(kv.shape)}")
        return {f"kv.{i}": t for i, t in enumerate(kv[0].unbind(0))}
    ks, vs = unpack_kv(kv, num_kv_heads)
    return {**{f"k.{i}": t for i, t in enumerate(ks)}, **{f"v.{i}": t for i, t in enumerate(vs)}}


def from_layer_tensors(tensors: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """The inverse of ``to_layer_tensors``: ``(tensor, fmt)``."""
    num_layers = len({name.partition(".")[2] for name in tensors})
    if f"kv.{num_layers - 1}" in tensors:
        latents = [tensors[f"kv.{i}"] for i in range(num_layers)]
        return torch.stack(latents).unsqueeze(0).contiguous(), FMT_KV_MLA
    ks = [tensors[f"k.{i}"] for i in range(num_layers)]
    return pack_kv(ks, [tensors[f"v.{i}"] for i in range(num_layers)]), FMT_KV_2LTD


def encode_chunk(kv: torch.Tensor, fmt: int = FMT_KV_2LTD) -> tuple[bytes, bytes]:
    """``(kv_bytes, metadata_bytes)`` exactly as LMCache's ``RedisConnector`` would store them."""
    if fmt not in _FORMATS or kv.dim() != 4 or kv.shape[0] != (2 if fmt == FMT_KV_2LTD else 1):
        raise ValueError(f"format {fmt} does not fit shape {tuple(kv.shape)}")
    flat = kv.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    kv_bytes = flat.numpy().tobytes()
    meta = RemoteMetadata(len(kv_bytes), fmt, (tuple(kv.shape),), (kv.dtype,))
    return kv_bytes, meta.serialize()


def decode_chunk(kv_bytes: bytes, metadata_bytes: bytes) -> tuple[torch.Tensor, int]:
    """``(tensor, fmt)`` from the two Redis values; raises ``LMCacheFormatError`` on any mismatch."""
    meta = RemoteMetadata.deserialize(metadata_bytes)
    if meta.fmt not in _FORMATS or len(meta.shapes) != 1:
        raise LMCacheFormatError(
            f"unsupported LMCache chunk: format {meta.fmt}, {len(meta.shapes)} groups"
        )
    shape, dtype = meta.shapes[0], meta.dtypes[0]
    num_bytes = dtype.itemsize * int(torch.Size(shape).numel())
    if len(shape) != 4 or meta.length != num_bytes or len(kv_bytes) < num_bytes:
        raise LMCacheFormatError(
            f"LMCache chunk {shape} {dtype}: metadata length {meta.length}, "
            f"payload {len(kv_bytes)}, expected {num_bytes}"
        )
    raw = torch.frombuffer(bytearray(kv_bytes[:num_bytes]), dtype=torch.uint8)
    return raw.view(dtype).reshape(shape), meta.fmt


def _hash_fn(name: str) -> Any:
    # vllm/utils/hashing.py, re-implemented so that the scheduler need not import vLLM's hashing.
    def cbor(obj: object) -> bytes:
        import cbor2  # a vLLM dependency; only needed for the cbor algorithms

        return cbor2.dumps(obj, canonical=True)

    def pickled(obj: object) -> bytes:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)

    table = {
        "builtin": hash,
        "sha256": lambda o: hashlib.sha256(pickled(o)).digest(),
        "sha256_cbor": lambda o: hashlib.sha256(cbor(o)).digest(),
        "sha256_cbor_64bit": lambda o: hashlib.sha256(cbor(o)).digest(),  # LMCache's rename
        "xxhash": lambda o: xxhash.xxh3_128_digest(pickled(o)),
        "xxhash_cbor": lambda o: xxhash.xxh3_128_digest(cbor(o)),
    }
    if name not in table:
        raise ValueError(f"pre_caching_hash_algorithm: unknown {name!r}")
    return table[name]


def _as_int(value: int | bytes) -> int:
    # token_database._normalize_hash_to_int
    return int.from_bytes(value[:8], "big") if isinstance(value, bytes) else value


def none_hash(hash_algorithm: str = "builtin") -> int:
    """LMCache's NONE_HASH, as vLLM derives it in this process."""
    seed = os.environ.get("PYTHONHASHSEED")
    if seed is None and hash_algorithm.startswith("xxhash"):
        raise ValueError(
            "with xxhash and no PYTHONHASHSEED, vLLM's NONE_HASH is random per process"
        )
    return _as_int(_hash_fn(hash_algorithm)(VLLM_NONE_HASH_SEED if seed is None else seed))


def chunk_hashes(
    token_ids: Iterable[int],
    *,
    chunk_size: int = 256,
    hash_algorithm: str = "builtin",
    save_unfull_chunk: bool = False,
    prefix_hash: int | None = None,
) -> list[tuple[int, int, int]]:
    """``(start, end, chunk_hash)`` per chunk of the prompt, LMCache's prefix chain."""
    tokens = [int(t) for t in token_ids]
    fn = _hash_fn(hash_algorithm)
    h = none_hash(hash_algorithm) if prefix_hash is None else prefix_hash
    end = len(tokens) if save_unfull_chunk else len(tokens) - len(tokens) % chunk_size
    out = []
    for start in range(0, end, chunk_size):
        chunk = tuple(tokens[start : start + chunk_size])
        h = _as_int(fn((h, chunk, ())))
        out.append((start, start + len(chunk), h))
    return out


def prefix_keys(
    token_ids: Iterable[int],
    *,
    model_name: str,
    dtype: torch.dtype,
    world_size: int = 1,
    worker_id: int = 0,
    tags: tuple[tuple[str, str], ...] = (),
    **hash_options: Any,
) -> list[tuple[int, int, LMCacheKey]]:
    """``(start, end, key)`` per chunk: the keys LMCache would look up for this prompt."""
    return [
        (start, end, LMCacheKey(model_name, world_size, worker_id, h, dtype, tags))
        for start, end, h in chunk_hashes(token_ids, **hash_options)
    ]


class LMCacheRedis:
    """Prefix chunks in LMCache's layout on a ``Backend`` (normally ``RedisBackend`` with no key
    prefix, so the keys are LMCache's own). The backend's contract carries over: I/O failures are
    misses and dropped writes, counted in ``stats()``; an unreadable chunk is a miss counted as
    ``corrupt``."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.counters = Stats("lmcache.")

    @classmethod
    def from_url(cls, url: str, **redis_options: Any) -> LMCacheRedis:
        from .redis_backend import RedisBackend

        return cls(RedisBackend(url, **redis_options))

    @classmethod
    def from_config(cls, cfg: Any) -> LMCacheRedis:
        """From an ``OrbitKVConfig``: its ``remote_url``; no TTL and no prefix, as LMCache writes."""
        if not cfg.remote_url:
            raise ValueError("remote_url: LMCache interop needs a Redis URL")
        if cfg.remote_serde not in (None, "naive"):
            raise ValueError(
                f"remote_serde: only 'naive' chunks are readable, got {cfg.remote_serde!r}"
            )
        return cls.from_url(
            cfg.remote_url,
            socket_timeout_s=cfg.remote_timeout_s,
            connect_timeout_s=cfg.remote_connect_timeout_s,
            min_nbytes_per_s=getattr(cfg, "remote_min_nbytes_per_s", float(25 << 20)),
        )

    def batch_put(self, items: Sequence[tuple[LMCacheKey, torch.Tensor, int]]) -> None:
        """Write ``(key, tensor, fmt)`` chunks: every ``kv_bytes`` before any ``metadata``."""
        payloads, metas = [], []
        for key, kv, fmt in items:
            kv_bytes, meta = encode_chunk(kv, fmt)
            payloads.append((key.kv_bytes_key, kv_bytes))
            metas.append((key.metadata_key, meta))
        self.backend.batch_put(payloads)
        self.backend.batch_put(metas)
        self.counters.add("puts", len(items))

    def put(self, key: LMCacheKey, kv: torch.Tensor, fmt: int = FMT_KV_2LTD) -> None:
        self.batch_put([(key, kv, fmt)])

    def batch_exists(self, keys: Sequence[LMCacheKey]) -> list[bool]:
        return self.backend.batch_exists([k.metadata_key for k in keys])

    def num_prefix_hits(self, keys: Sequence[LMCacheKey]) -> int:
        """How many leading chunks exist, as LMCache's ``batched_async_contains`` counts them."""
        flags = self.batch_exists(keys)
        return next((i for i, is_there in enumerate(flags) if not is_there), len(flags))

    def batch_get(self, keys: Sequence[LMCacheKey]) -> list[tuple[torch.Tensor, int] | None]:
        """``(tensor, fmt)`` per key, ``None`` for a miss. One round trip for all the pairs."""
        names = [n for k in keys for n in (k.metadata_key, k.kv_bytes_key)]
        values = self.backend.batch_get(names)
        out: list[tuple[torch.Tensor, int] | None] = []
        for meta, kv_bytes in zip(values[0::2], values[1::2], strict=True):
            if meta is None or kv_bytes is None:
                self.counters.add("misses")
                out.append(None)
                continue
            try:
                out.append(decode_chunk(kv_bytes, meta))
                self.counters.add("hits")
            except LMCacheFormatError:
                self.counters.add("corrupt")
                out.append(None)
        return out

    def get(self, key: LMCacheKey) -> tuple[torch.Tensor, int] | None:
        return self.batch_get([key])[0]

    def batch_delete(self, keys: Sequence[LMCacheKey]) -> None:
        self.backend.batch_delete([n for k in keys for n in (k.metadata_key, k.kv_bytes_key)])

    def stats(self) -> dict[str, float]:
        return {**self.counters.snapshot(), **self.backend.stats()}

    def close(self) -> None:
        self.backend.close()
