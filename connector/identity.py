"""What both connector halves must agree on to address the same entries: the model's identity.

The scheduler and the worker derive it independently from the ``VllmConfig`` (they may live in
different processes), so it is a pure function of the config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import xxhash
from orbitkv.kernels.rope import RopeSpec

from .positions import ChunkPositions

if TYPE_CHECKING:
    from vllm.config import VllmConfig


@dataclass(frozen=True, slots=True)
class ModelIdentity:
    model_fingerprint: str
    # Cache layout family and dtype, e.g. "mha:bfloat16". Part of every cid: an entry is only
    # loadable into a cache of the same kind.
    layout: str
    cache_dtype: torch.dtype
    num_layers: int
    num_kv_heads: int
    head_dim: int
    is_mla: bool
    rope: RopeSpec | None
    rope_hash: str
    anchor_ids: tuple[int, ...]
    # Token index -> position in the units relocation rotates by (M-RoPE: the t stream).
    positions: ChunkPositions = ChunkPositions("index")


def cache_torch_dtype(vllm_config: VllmConfig) -> torch.dtype:
    """The KV cache dtype. fp8 caches are rejected later, by the worker's layout check."""
    cache_dtype = vllm_config.cache_config.cache_dtype
    model_dtype = vllm_config.model_config.dtype
    if cache_dtype in (None, "auto"):
        return model_dtype
    table = {
        "bfloat16": torch.bfloat16,
        "float16": torch.float16,
        "half": torch.float16,
        "float32": torch.float32,
        "float": torch.float32,
    }
    return table.get(str(cache_dtype), model_dtype)


def model_identity(vllm_config: VllmConfig, anchor_tokens: tuple[int, ...] | None) -> ModelIdentity:
    mc = vllm_config.model_config
    text = mc.hf_text_config
    is_mla = bool(getattr(mc, "use_mla", False))
    dtype = cache_torch_dtype(vllm_config)
    try:
        rope: RopeSpec | None = RopeSpec.from_hf_config(mc.hf_config)
        rope_hash = rope.fingerprint()
    except (AttributeError, KeyError, TypeError, ValueError):
        # A model without RoPE (or one the spec cannot read) is reused at its stored position only.
        rope, rope_hash = None, "none"
    positions = ChunkPositions.from_vllm_config(vllm_config, rope is not None and rope.is_mrope)
    if positions.kind != "index":
        # Entries store their start in these units: nodes that place chunks differently (or
        # cannot place them) must never read each other's entries.
        rope_hash = f"{rope_hash}:{positions.kind}"
    num_layers = int(mc.get_num_layers(vllm_config.parallel_config))
    num_kv_heads = int(mc.get_num_kv_heads(vllm_config.parallel_config))
    head_dim = int(mc.get_head_size())
    h = xxhash.xxh3_128()
    for part in (
        mc.model,
        getattr(mc, "revision", None) or "",
        # Dummy (random) weights must never share entries with real ones at the same path.
        str(getattr(getattr(vllm_config, "load_config", None), "load_format", "")),
        ",".join(getattr(mc.hf_config, "architectures", None) or []),
        str(getattr(text, "vocab_size", "")),
        str(getattr(text, "hidden_size", "")),
        str(num_layers),
        str(num_kv_heads),
        str(head_dim),
        str(mc.dtype),
        # Weights quantized online (--quantization fp8 on an unquantized checkpoint) give other KV
        # at the same path: they must never share entries with the full-precision model.
        str(getattr(mc, "quantization", None) or ""),
        rope_hash,
        str(vllm_config.parallel_config.tensor_parallel_size),
    ):
        h.update(str(part).encode())
        h.update(b"\x00")
    if anchor_tokens is None:
        bos = getattr(text, "bos_token_id", None) or getattr(mc.hf_config, "bos_token_id", None)
        anchor = (int(bos),) if isinstance(bos, int) else ()
    else:
        anchor = tuple(anchor_tokens)
    return ModelIdentity(
        model_fingerprint=h.hexdigest(),
        layout=f"{'mla' if is_mla else 'mha'}:{str(dtype).removeprefix('torch.')}",
        cache_dtype=dtype,
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        is_mla=is_mla,
        rope=rope,
        rope_hash=rope_hash,
        anchor_ids=anchor,
        positions=positions,
    )


def line_end_ids(vllm_config: VllmConfig) -> frozenset[int]:
    """Ids of the tokens whose text ends a line (ends with a newline), from the model's tokenizer:
    the content chunker cuts after them. Empty when the tokenizer cannot be loaded here."""
    try:
        from transformers import AutoTokenizer

        mc = vllm_config.model_config
        tok = AutoTokenizer.from_pretrained(
            mc.tokenizer, revision=getattr(mc, "tokenizer_revision", None),
            trust_remote_code=bool(getattr(mc, "trust_remote_code", False)),
        )
        texts = tok.batch_decode([[i] for i in range(len(tok))])
    except Exception:
        return frozenset()
    return frozenset(i for i, text in enumerate(texts) if text.endswith("\n"))
