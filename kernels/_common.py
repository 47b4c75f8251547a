"""Shared argument checks and the Triton-or-torch dispatch rule for the kernels package."""

from __future__ import annotations

import functools
from typing import Literal

import torch

Backend = Literal["auto", "torch", "triton"]

# Cache and chunk dtypes the operator handles. fp8 caches carry per-tensor scales the relocation
# would have to re-apply, so they are refused rather than silently mis-rotated.
KV_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def use_triton(backend: Backend, *tensors: torch.Tensor) -> bool:
    """Whether to run the Triton kernel: ``auto`` picks it for CUDA tensors only.

    Triton has no CPU backend, so on CPU tensors ``triton`` is only meaningful under
    ``TRITON_INTERPRET=1`` (the tests). On CPU, ``auto`` is the production path (``paged_cpu`` for
    CPU_VEC caches, the torch reference otherwise) and ``torch`` forces the reference.
    """
    if backend == "torch":
        return False
    if backend == "triton":
        return True
    if backend != "auto":
        raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
    return all(t.is_cuda for t in tensors)


def check_kv_dtype(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in KV_DTYPES:
        raise TypeError(
            f"{name} has dtype {t.dtype}; supported are float32, bfloat16, float16 "
            "(fp8 and integer caches are not supported)"
        )


def check_same_device(**tensors: torch.Tensor | None) -> None:
    present = {k: t.device for k, t in tensors.items() if t is not None}
    if len(set(present.values())) > 1:
        detail = ", ".join(f"{k} on {d}" for k, d in present.items())
        raise ValueError(f"tensors must share one device: {detail}")


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


@functools.cache
def vllm_cpu_writer():
    """vLLM's own CPU cache writer ``cpu_attn_reshape_and_cache``, or None where vLLM is missing or
    built without its CPU ops (looked up once per process)."""
    try:
        from vllm import _custom_ops as ops

        return ops.cpu_attn_reshape_and_cache
    except Exception:  # vLLM missing or built without its CPU ops
        return None


@functools.cache
def vllm_amx_writer():
    """``vllm_cpu_writer`` where it packs ``amx`` caches on this CPU, else None (probed once per
    process with a one-token write). vLLM's op refuses the ``amx`` isa on a CPU without AMX tiles
    ("Unsupported CPU attention configuration"); vLLM never allocates such a cache there, but the
    layout's reference writer still packs one, byte for byte as vLLM's would."""
    op = vllm_cpu_writer()
    if op is None:
        return None
    try:
        block_size, head_dim = 32, 64
        cache = torch.zeros(1, 1, 2 * block_size, head_dim, dtype=torch.bfloat16)
        one = torch.zeros(1, 1, head_dim, dtype=torch.bfloat16)
        op(one, one, *cache.chunk(2, dim=2), torch.zeros(1, dtype=torch.int64), "amx")
    except Exception:  # this CPU (or this vLLM build) has no AMX writer
        return None
    return op
