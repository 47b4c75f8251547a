"""The Triton kernels on a device against their torch references on the CPU, in ULPs.

Part ``kernels`` of ``orbitkv check gpu``. Every case runs in fp32, bf16 and fp16: the same inputs
(made on the CPU from one seed) go through the Triton kernel on the device (``backend='triton'``)
and through the ``*_ref`` function on the CPU. The error is measured in ULPs of the cache dtype at
the operands' magnitude (``numerics.ulp_stats``) and must stay within ``numerics.tolerance_ulps``;
gathers are copies and must be bit-exact. A paged load must also leave every slot it was not
given untouched.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from orbitkv.kernels.paged import gather_chunk, gather_chunk_ref, load_chunk, load_chunk_ref
from orbitkv.kernels.patch import apply_patch, apply_patch_ref
from orbitkv.kernels.relocate import relocate, relocate_ref

from orbitkv_bench.checks.numerics import (
    make_spec,
    pair_radius,
    patch_magnitude,
    tolerance_ulps,
    ulp_stats,
)

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DELTA = 517
MAX_DELTA = 5000  # per-token shifts are drawn from [-MAX_DELTA, MAX_DELTA)


@dataclass(frozen=True)
class Sizes:
    num_tokens: int
    num_heads: int
    head_dim: int
    mla_lora: int
    mla_rope: int
    rank: int  # above the kernels' BLOCK_RANK (32), so the rank loop runs more than once


# A 7B-like layer and a DeepSeek-V2-like MLA row; an odd token count leaves a partial tile.
GPU_SIZES = Sizes(num_tokens=517, num_heads=8, head_dim=128, mla_lora=512, mla_rope=64, rank=64)
# Small enough for the Triton interpreter to run every case in seconds.
CPU_SIZES = Sizes(num_tokens=21, num_heads=2, head_dim=32, mla_lora=32, mla_rope=16, rank=40)

# case layout -> (PagedLayout name, block size)
LAYOUTS: dict[str, tuple[str, int]] = {
    "flash": ("flash", 16),  # [num_blocks, 2, block, H, D]
    "flash_lbnhc": ("flash", 16),  # vLLM >= 0.32's [num_blocks, H, block, 2D] view, LBNHC strides
    "mla": ("mla", 16),  # [num_blocks, block, lora + rope]
    "cpu_vec": ("cpu_vec", 32),  # [num_blocks, H, block, 2D], K transposed in a page
}


@dataclass(frozen=True)
class Case:
    kernel: str
    name: str
    layout: str | None
    shape: tuple[int, ...]
    # (dtype, device, generator) -> (max ULP, mean ULP, named yes/no checks that must all hold)
    run: Callable[[torch.dtype, torch.device, torch.Generator], tuple[float, float, dict[str, bool]]]
    is_copy: bool = False

    def describe(self) -> str:
        where = f" {self.layout} cache," if self.layout else ""
        tol = "bit-exact" if self.is_copy else "within numerics.tolerance_ulps(dtype)"
        dtypes = ", ".join(str(d).removeprefix("torch.") for d in DTYPES)
        return (f"{self.kernel} ({self.name},{where} {list(self.shape)}) in {dtypes}: Triton on the "
                f"device vs {self.kernel}_ref on the CPU, max/mean ULP, {tol}")


def cases(sizes: Sizes) -> list[Case]:
    s = sizes
    n, h, d = s.num_tokens, s.num_heads, s.head_dim
    mla_row = s.mla_lora + s.mla_rope
    out = [
        _relocate_case("neox, full rotary, per-token delta", (n, h, d),
                       make_spec("neox", d, d), per_token=True),
        _relocate_case("gptj, rotary d/4, one delta", (n, h, d),
                       make_spec("gptj", d, d // 4), per_token=False),
        _relocate_case("MLA row, gptj band after the latent, per-token delta", (n, mla_row),
                       make_spec("gptj", mla_row, s.mla_rope, rope_offset=s.mla_lora), per_token=True),
        _patch_case(f"rank {s.rank}", (n, h, d), s.rank),
        _patch_case("MLA row, rank 16", (n, mla_row), 16),
    ]
    for layout in LAYOUTS:
        for is_patched in (True, False):
            out += _paged_cases(layout, s, is_patched)
    return out


def run_cases(case_list: list[Case], device: torch.device, seed: int = 0) -> Iterator[dict[str, Any]]:
    for case in case_list:
        for dtype in DTYPES:
            gen = torch.Generator().manual_seed(seed)
            row = {
                "kernel": case.kernel,
                "case": case.name,
                "layout": case.layout,
                "dtype": str(dtype).removeprefix("torch."),
                "shape": list(case.shape),
            }
            try:
                max_ulp, mean_ulp, flags = case.run(dtype, device, gen)
            except Exception as exc:  # a launch the device refuses fails its row, not the check
                yield {**row, "error": repr(exc)[:500], "ok": False}
                continue
            tol = 0.0 if case.is_copy else tolerance_ulps(dtype)
            yield {
                **row,
                "max_ulp": round(max_ulp, 4),
                "mean_ulp": round(mean_ulp, 5),
                "tol_ulp": round(tol, 5),
                **flags,
                "ok": bool(max_ulp <= tol and all(flags.values())),
            }


def _randn(shape, gen: torch.Generator, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen) * scale).to(dtype)


def _deltas(per_token: bool, num_tokens: int, gen: torch.Generator) -> int | torch.Tensor:
    if not per_token:
        return DELTA
    return torch.randint(-MAX_DELTA, MAX_DELTA, (num_tokens,), generator=gen)


def _on(device: torch.device, x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, tuple):
        return tuple(_on(device, t) for t in x)
    return x


def _relocate_case(name: str, shape: tuple[int, ...], spec, per_token: bool) -> Case:
    def run(dtype, device, gen):
        k = _randn(shape, gen, dtype)
        delta = _deltas(per_token, shape[0], gen)
        got = relocate(_on(device, k), _on(device, delta), spec, backend="triton")
        want = relocate_ref(k, delta, spec)
        return (*ulp_stats(got.cpu(), want, pair_radius(k, spec)), {})

    return Case("relocate", name, None, shape, run)


def _patch_case(name: str, shape: tuple[int, ...], rank: int) -> Case:
    def run(dtype, device, gen):
        x = _randn(shape, gen, dtype)
        num_features = x[0].numel()
        u, w = _randn((shape[0], rank), gen, torch.float32), _randn((rank, num_features), gen, torch.float32, 1 / 8)
        got = apply_patch(_on(device, x), _on(device, u), _on(device, w), backend="triton")
        want = apply_patch_ref(x, u, w)
        mag = x.double().abs() + patch_magnitude(u, w, x.shape)
        return (*ulp_stats(got.cpu(), want, mag), {})

    return Case("apply_patch", name, None, shape, run)


def _cache_shape(layout: str, num_blocks: int, s: Sizes) -> tuple[int, ...]:
    block = LAYOUTS[layout][1]
    if layout == "flash":
        return (num_blocks, 2, block, s.num_heads, s.head_dim)
    if layout == "mla":
        return (num_blocks, block, s.mla_lora + s.mla_rope)
    return (num_blocks, s.num_heads, block, 2 * s.head_dim)


def _make_cache(layout: str, num_blocks: int, s: Sizes, gen, dtype) -> torch.Tensor:
    if layout == "flash_lbnhc":
        # Physically [blocks, block, H, 2D] (vLLM's LBNHC), handed over as [blocks, H, block, 2D].
        block = LAYOUTS[layout][1]
        return _randn((num_blocks, block, s.num_heads, 2 * s.head_dim), gen, dtype).permute(0, 2, 1, 3)
    return _randn(_cache_shape(layout, num_blocks, s), gen, dtype)


def _paged_inputs(layout: str, s: Sizes, is_patched: bool, dtype, gen):
    """Cache, slots (whole blocks in shuffled order; unpatched: a few padding slots), K, V, spec,
    delta, patches: everything on the CPU."""
    kind, block = LAYOUTS[layout]
    is_mla = kind == "mla"
    n = s.num_tokens
    num_blocks = 2 * -(-n // block) + 1
    cache = _make_cache(layout, num_blocks, s, gen, dtype)
    order = torch.randperm(num_blocks, generator=gen)
    slots = (order[:, None] * block + torch.arange(block)).flatten()[:n].clone()
    if not is_patched:
        slots[torch.randperm(n, generator=gen)[: max(1, n // 8)]] = -1
    row = (s.mla_lora + s.mla_rope,) if is_mla else (s.num_heads, s.head_dim)
    k = _randn((n, *row), gen, dtype)
    v = None if is_mla else _randn((n, *row), gen, dtype)
    spec = (make_spec("gptj", row[0], s.mla_rope, rope_offset=s.mla_lora) if is_mla
            else make_spec("neox", s.head_dim, s.head_dim))
    delta = DELTA if is_patched else _deltas(True, n, gen)
    num_features = k[0].numel()

    def factors():
        return (_randn((n, s.rank), gen, torch.float32),
                _randn((s.rank, num_features), gen, torch.float32, 1 / 8))

    patch_k = factors() if is_patched else None
    patch_v = factors() if is_patched and not is_mla else None
    return kind, cache, slots, k, v, spec, delta, patch_k, patch_v


def _paged_cases(layout: str, s: Sizes, is_patched: bool) -> list[Case]:
    kind, block = LAYOUTS[layout]
    what = (f"rank {s.rank} patch on K and V, one delta" if is_patched
            else "no patch, per-token delta, padding slots")
    shape = (s.num_tokens, s.mla_lora + s.mla_rope) if kind == "mla" else (
        s.num_tokens, s.num_heads, s.head_dim)
    def run_load(dtype, device, gen):
        kind_, cache, slots, k, v, spec, delta, pk, pv = _paged_inputs(layout, s, is_patched, dtype, gen)
        got = _on(device, cache.clone())  # clone and .to keep the strides (flash_lbnhc's too)
        load_chunk(got, _on(device, slots), kind_, _on(device, k), _on(device, v), spec=spec,
                   delta=_on(device, delta), patch_k=_on(device, pk), patch_v=_on(device, pv),
                   backend="triton")
        want = cache.clone()
        load_chunk_ref(want, slots, kind_, k, v, spec=spec, delta=delta, patch_k=pk, patch_v=pv)
        return _compare_load(kind_, got.cpu(), want, slots, k, v, spec, pk, pv)

    def run_gather(dtype, device, gen):
        kind_, cache, slots, *_ = _paged_inputs(layout, s, is_patched, dtype, gen)
        got_k, got_v = gather_chunk(_on(device, cache), _on(device, slots), kind_, backend="triton")
        want_k, want_v = gather_chunk_ref(cache, slots, kind_)
        pairs = [(got_k.cpu(), want_k)] + ([] if want_v is None else [(got_v.cpu(), want_v)])
        stats = [ulp_stats(got, want, want.abs()) for got, want in pairs]
        is_same = all(torch.equal(got, want) for got, want in pairs)
        return max(m for m, _ in stats), sum(a for _, a in stats) / len(stats), {"bit_equal": is_same}

    return [
        Case("load_chunk", what, layout, shape, run_load),
        Case("gather_chunk", "shuffled whole blocks" if is_patched else "with padding slots",
             layout, shape, run_gather, is_copy=True),
    ]


def _compare_load(kind, got, want, slots, k, v, spec, patch_k, patch_v):
    """ULPs over the written tokens (K and V), and whether every other element is unchanged."""
    written = torch.zeros(got.shape, dtype=torch.float32)
    ones_k = torch.ones(k.shape, dtype=torch.float32)
    load_chunk_ref(written, slots, kind, ones_k, None if v is None else torch.ones_like(ones_k))
    is_written = written != 0
    is_untouched = torch.equal(got[~is_written], want[~is_written])
    keep = slots >= 0
    got_k, got_v = gather_chunk_ref(got, slots, kind)
    want_k, want_v = gather_chunk_ref(want, slots, kind)
    mag_k = pair_radius(k, spec)
    if patch_k is not None:
        mag_k = mag_k + patch_magnitude(*patch_k, k.shape)
    stats = [ulp_stats(got_k[keep], want_k[keep], mag_k[keep])]
    if v is not None:
        mag_v = v.double().abs()
        if patch_v is not None:
            mag_v = mag_v + patch_magnitude(*patch_v, v.shape)
        stats.append(ulp_stats(got_v[keep], want_v[keep], mag_v[keep]))
    flags = {"untouched_equal": is_untouched}
    return max(m for m, _ in stats), sum(a for _, a in stats) / len(stats), flags
