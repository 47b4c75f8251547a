"""Fused load of a staged chunk into vLLM's paged KV cache: relocate + patch + scatter, in place.

``load_chunk`` computes, per token and head, ``round(R(delta) k + u_k @ w_k)`` in fp32 (one rounding
to the cache dtype) and writes it to the token's slot; V gets ``round(v + u_v @ w_v)``. Nothing
outside the given slots is written. Negative slots are skipped (vLLM's padding convention); a slot
past the cache end is an error. ``gather_chunk`` is the plain inverse copy.

Public functions run Triton on CUDA tensors; on CPU tensors ``backend='auto'`` (production) takes the
fast CPU_VEC path of ``paged_cpu`` (whole-block page writes, vLLM's own writer for the rest; same
bytes), vLLM's own writer for CPU_AMX caches (``paged_amx``), and the torch reference otherwise. ``backend='torch'`` forces the reference, ``'triton'`` the
kernel (e.g. under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from ._common import Backend, check_kv_dtype, check_same_device, use_triton
from .paged_amx import gather_amx, load_amx
from .paged_cpu import gather_cpu_vec, is_cpu_vec_fast, load_cpu_vec
from .paged_layout import CacheViews, PagedLayout, cache_views, check_cache
from .paged_native import gather_native_many, load_native_many
from .paged_torch import gather_torch, load_torch
from .patch import check_patch_args
from .relocate import check_delta, check_spec, is_zero_delta
from .rope import RopeSpec

__all__ = [
    "PagedLayout",
    "CacheViews",
    "check_cache",
    "load_chunk",
    "load_chunk_ref",
    "load_many",
    "gather_chunk",
    "gather_many",
    "gather_chunk_ref",
]

Patch = tuple[torch.Tensor, torch.Tensor]


def load_chunk(
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    layout: PagedLayout | str,
    k: torch.Tensor,
    v: torch.Tensor | None = None,
    *,
    spec: RopeSpec | None = None,
    delta: int | torch.Tensor = 0,
    patch_k: Patch | None = None,
    patch_v: Patch | None = None,
    backend: Backend = "auto",
    check_slots: bool = True,
) -> None:
    """Write one layer of a chunk into ``cache`` at ``slot_mapping`` (int64 ``[N]``), in place.

    ``k``/``v``: ``[N, H, D]`` in the cache dtype (MLA: ``k`` is the ``[N, lora + rope]`` row, ``v``
    None). ``spec``/``delta``: relocate K by ``delta`` (int or int tensor ``[N]``); ``spec`` may be
    None only when ``delta`` is 0. ``patch_k``/``patch_v``: ``(u [N, m], w [m, H*D])`` or None.
    ``check_slots=False`` skips the host-side range and uniqueness checks (a device sync on CUDA;
    check once per chunk, not per layer); the kernel still drops out-of-range slots instead of
    writing past the cache.
    """
    views, slots, cos, sin = _check_load(
        cache, slot_mapping, layout, k, v, spec, delta, patch_k, patch_v, check_slots
    )
    if views.layout is PagedLayout.CPU_AMX:
        _refuse_triton_amx(backend)
        load_amx(views, cache, slots, k, v, cos, sin, spec, patch_k, patch_v,
                 is_reference=backend == "torch")
    elif use_triton(backend, cache):
        from .paged_triton import load_chunk_triton

        load_chunk_triton(views, slots, k, v, cos, sin, spec, patch_k, patch_v)
    elif backend == "auto" and is_cpu_vec_fast(views, cache):
        load_cpu_vec(views, cache, slots, k, v, cos, sin, spec, patch_k, patch_v)
    else:
        load_torch(views, cache, slots, k, v, cos, sin, spec, patch_k, patch_v)


def load_many(
    caches: Sequence[torch.Tensor],
    layout: PagedLayout | str,
    slots: Sequence[torch.Tensor],
    ks: Sequence[torch.Tensor],
    vs: Sequence[torch.Tensor],
    *,
    spec: RopeSpec | None,
    deltas: Sequence[int],
) -> bool:
    """Many unpatched loads in one call, where the native op runs: job ``j`` writes
    ``ks[j]``, ``vs[j]`` (``[n_j, H, D]``, contiguous, the cache dtype) at ``slots[j]`` (int64
    ``[n_j]``; -1 is skipped) of ``caches[j]``, K moved by ``deltas[j]``. Every cache has the first
    one's shape, strides and dtype (a model's layers). The bytes equal ``load_chunk``'s per job.

    CPU_VEC and CPU_AMX caches (``csrc/cpu_amx.cpp``: the bytes of ``load_chunk`` there too).
    Returns False, writing nothing, where the op cannot take them (a GPU cache, no
    compiler): the caller then loads each job with ``load_chunk``. Raises like ``load_chunk`` on
    bad arguments; every slot is bounds-checked before anything is written, repeats are not
    looked for (vLLM never maps two tokens to one slot).
    """
    num_jobs = len(caches)
    if not num_jobs or not (len(slots) == len(ks) == len(vs) == len(deltas) == num_jobs):
        raise ValueError("load_many needs one cache, slot mapping, k, v and delta per job")
    views = _many_views(caches, layout)
    if views is None:
        return False
    _check_many_slots(slots)
    dtype, num_heads, head_dim = caches[0].dtype, views.num_kv_heads, views.head_dim
    for s, k, v in zip(slots, ks, vs, strict=True):
        want = (s.shape[0], num_heads, head_dim)
        for name, x in (("k", k), ("v", v)):
            if x.dtype != dtype or x.shape != want or not x.is_contiguous() or not x.is_cpu:
                raise ValueError(f"{name} must be a contiguous {list(want)} {dtype} CPU tensor, "
                                 f"got {tuple(x.shape)} {x.dtype} on {x.device}")
    coss, sins = _many_tables(views, caches[0], spec, deltas)
    return load_native_many(views, caches, ks, vs, slots, coss, sins, spec)


def _many_views(caches: Sequence[torch.Tensor], layout: PagedLayout | str) -> CacheViews | None:
    """The first cache's views where one native call can take every cache (CPU_VEC, CPU_AMX on
    the CPU, a model's layers alike), else None."""
    first = caches[0]
    views = cache_views(first, layout)
    is_amx = views.layout is PagedLayout.CPU_AMX and first.device.type == "cpu"
    if not (is_amx or is_cpu_vec_fast(views, first)):
        return None
    _check_same_caches(caches)
    return views


def _check_many_slots(slots: Sequence[torch.Tensor]) -> None:
    # The op addresses every tensor by its pointer: each one is checked (cheap attribute reads,
    # run once per step for all layers), a slot mapping once however many jobs share it.
    for s in {id(s): s for s in slots}.values():
        if not (isinstance(s, torch.Tensor) and s.dtype == torch.int64 and s.dim() == 1
                and s.is_contiguous() and s.is_cpu):
            raise TypeError("each slot mapping must be a contiguous 1-D int64 CPU tensor")


def _many_tables(views: CacheViews, cache: torch.Tensor, spec: RopeSpec | None,
                 deltas: Sequence[int]) -> tuple[list, list]:
    """Each delta's cos and sin tables (None, None for no shift), one per distinct delta."""
    if any(deltas):
        if spec is None:
            raise ValueError("a non-zero delta needs the model's RopeSpec (spec=...)")
        check_spec(spec, views.head_dim, "k")
    tables = [_shared_cos_sin(spec, int(d), cache.device) if d else (None, None) for d in deltas]
    return [cos for cos, _ in tables], [sin for _, sin in tables]


def gather_many(
    caches: Sequence[torch.Tensor], slot_mapping: torch.Tensor, layout: PagedLayout | str,
    *, num_threads: int | None = None,
) -> torch.Tensor | None:
    """The tokens at ``slot_mapping`` (int64 ``[N]``, no padding) of every cache (a model's layers:
    one shape, strides and dtype) in one call where the native op runs:
    ``[len(caches), 2, N, H, D]``, K then V. None where it cannot (the caller gathers each cache
    with ``gather_chunk``). CPU_VEC and CPU_AMX caches (the bits of ``gather_chunk``'s).
    ``num_threads``: the op's OpenMP threads (None: torch's setting of the
    calling thread); 1 runs on the calling thread alone."""
    views = _many_views(caches, layout)
    if views is None:
        return None
    slots = _check_slots(slot_mapping, views, caches[0], check_bounds=True)
    if slots.numel() and int(slots.min()) < 0:
        raise ValueError("gather_many takes no padding slots")
    if num_threads is not None and num_threads < 1:
        raise ValueError(f"num_threads must be at least 1, got {num_threads}")
    return gather_native_many(views, caches, slots, num_threads)


def load_chunk_ref(
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    layout: PagedLayout | str,
    k: torch.Tensor,
    v: torch.Tensor | None = None,
    *,
    spec: RopeSpec | None = None,
    delta: int | torch.Tensor = 0,
    patch_k: Patch | None = None,
    patch_v: Patch | None = None,
) -> None:
    """Pure-torch ``load_chunk``."""
    load_chunk(cache, slot_mapping, layout, k, v, spec=spec, delta=delta, patch_k=patch_k,
               patch_v=patch_v, backend="torch")


def gather_chunk(
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    layout: PagedLayout | str,
    *,
    backend: Backend = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Read the tokens at ``slot_mapping`` back as contiguous ``(k, v)`` ``[N, H, D]`` (MLA: ``(kv, None)``,
    ``kv`` ``[N, lora + rope]``). Negative slots read as zeros."""
    views = cache_views(cache, layout)
    slots = _check_slots(slot_mapping, views, cache, check_bounds=True)
    if views.layout is PagedLayout.CPU_AMX:
        _refuse_triton_amx(backend)
        k, v = gather_amx(views, cache, slots)
    elif use_triton(backend, cache):
        from .paged_triton import gather_chunk_triton

        k, v = gather_chunk_triton(views, slots)
    else:
        fast = gather_cpu_vec(views, cache, slots) if (
            backend == "auto" and is_cpu_vec_fast(views, cache)) else None
        k, v = fast if fast is not None else gather_torch(views, cache, slots)
    if views.layout is PagedLayout.MLA:
        return k.squeeze(1), None
    return k, v


def gather_chunk_ref(
    cache: torch.Tensor, slot_mapping: torch.Tensor, layout: PagedLayout | str
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Pure-torch ``gather_chunk``."""
    return gather_chunk(cache, slot_mapping, layout, backend="torch")


def _check_same_caches(caches: Sequence[torch.Tensor]) -> None:
    """One native call addresses every cache with the first one's geometry: a model's layers."""
    first = caches[0]
    for cache in {id(c): c for c in caches}.values():
        if (cache.shape != first.shape or cache.stride() != first.stride()
                or cache.dtype != first.dtype or cache.device != first.device):
            raise ValueError(f"caches differ: {tuple(cache.shape)} {cache.dtype} against "
                             f"{tuple(first.shape)} {first.dtype}")


def _refuse_triton_amx(backend: Backend) -> None:
    if backend == "triton":
        raise ValueError("CPU_AMX caches live on the CPU only: there is no Triton path for them")


def _check_load(cache, slot_mapping, layout, k, v, spec, delta, patch_k, patch_v, check_slots):
    views = cache_views(cache, layout)
    is_mla = views.layout is PagedLayout.MLA
    check_kv_dtype("k", k)
    if k.dtype != cache.dtype:
        raise TypeError(f"k dtype {k.dtype} differs from the cache dtype {cache.dtype}")
    want = (views.head_dim,) if is_mla else (views.num_kv_heads, views.head_dim)
    if k.dim() != len(want) + 1 or tuple(k.shape[1:]) != want:
        shape = "[N, lora + rope]" if is_mla else "[N, H, D]"
        raise ValueError(
            f"k must be {shape} = [N, {', '.join(map(str, want))}] for this {views.layout.name} "
            f"cache, got {tuple(k.shape)}"
        )
    if is_mla and (v is not None or patch_v is not None):
        raise ValueError("MLA caches hold one row per token: pass v=None and patch_v=None")
    if not is_mla:
        if v is None:
            raise ValueError(f"{views.layout.name} caches need v (same shape as k)")
        check_kv_dtype("v", v)
        if v.shape != k.shape or v.dtype != k.dtype:
            raise ValueError(
                f"v {tuple(v.shape)} {v.dtype} must match k {tuple(k.shape)} {k.dtype}"
            )
    check_same_device(cache=cache, k=k, v=v, slot_mapping=slot_mapping)
    for name, patch, x in (("patch_k", patch_k, k), ("patch_v", patch_v, v)):
        if patch is not None:
            if not isinstance(patch, tuple | list) or len(patch) != 2:
                raise TypeError(f"{name} must be a (u, w) pair or None")
            check_patch_args(x, patch[0], patch[1], name=name[-1])
    slots = _check_slots(
        slot_mapping, views, cache, check_bounds=check_slots, check_unique=check_slots
    )
    if slots.shape[0] != k.shape[0]:
        raise ValueError(f"slot_mapping has {slots.shape[0]} slots for {k.shape[0]} tokens")
    delta = check_delta(delta, k.shape[0])
    if spec is not None:
        check_spec(spec, views.head_dim, "k")
    if is_zero_delta(delta):
        cos = sin = None
    elif spec is None:
        raise ValueError("a non-zero delta needs the model's RopeSpec (spec=...)")
    elif isinstance(delta, int):
        cos, sin = _shared_cos_sin(spec, delta, k.device)
    else:
        cos, sin = spec.cos_sin(delta, device=k.device)
    return views, slots, cos, sin


@functools.lru_cache(maxsize=256)
def _shared_cos_sin(spec: RopeSpec, delta: int, device: torch.device):
    """cos/sin of one shift, built once: every layer of a chunk moves by the same delta, and the
    tables cost more to build (fp64 angles, a device copy) than a small load. Read-only."""
    return spec.cos_sin(delta, device=device)


def _check_slots(
    slot_mapping, views: CacheViews, cache, *, check_bounds: bool, check_unique: bool = False
) -> torch.Tensor:
    """Type/shape checks always; with ``check_bounds`` also the range (a device sync on CUDA)."""
    if not isinstance(slot_mapping, torch.Tensor) or slot_mapping.dtype != torch.int64:
        got = slot_mapping.dtype if isinstance(slot_mapping, torch.Tensor) else type(slot_mapping)
        raise TypeError(f"slot_mapping must be an int64 tensor, got {got}")
    if slot_mapping.dim() != 1:
        raise ValueError(f"slot_mapping must be 1-D [N], got shape {tuple(slot_mapping.shape)}")
    if slot_mapping.device != cache.device:
        raise ValueError(f"slot_mapping is on {slot_mapping.device}, the cache on {cache.device}")
    if check_bounds and slot_mapping.numel():
        top = int(slot_mapping.max())
        if top >= views.num_slots:
            raise ValueError(
                f"slot {top} is past the cache end ({views.num_blocks} blocks x "
                f"{views.block_size} = {views.num_slots} slots)"
            )
    if check_unique and slot_mapping.numel():
        used = slot_mapping[slot_mapping >= 0]
        if torch.unique(used).numel() != used.numel():
            # Two tokens on one slot would race in the kernel; vLLM never maps tokens that way.
            raise ValueError("slot_mapping repeats a slot; each token needs its own slot")
    return slot_mapping
