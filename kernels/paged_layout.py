"""vLLM paged KV-cache layouts, seen as strided ``[block, token, head, dim]`` views of K and V.

Every supported layout is a pure stride pattern once K and V are viewed separately, so one
scatter/gather rule (and one Triton kernel) serves them all:

- ``FLASH``: K and V of a token sit at ``[block, offset, head, :]``. Two forms are accepted: the
  classic ``[num_blocks, 2, block_size, H, D]`` tensor, and vLLM >= 0.32's logical per-layer view
  ``[num_blocks, H, block_size, 2*D]`` (K = ``[..., :D]``, V = ``[..., D:]``) with whatever physical
  stride order the ``KVCacheLayout`` gave it (LBNHC by default).
- ``CPU_VEC``: vLLM's CPU backend (``vec``/``vec16`` ISA), per layer ``[num_blocks, H, block_size,
  2*D]``, which vLLM views as ``[num_blocks, H, 2*block_size, D]`` and splits into key/value halves.
  Checked against ``cpu_attn_reshape_and_cache``: inside the ``(block, head)`` page the first
  ``block_size*D`` elements are K stored transposed (``[D, block_size]``), the next ``block_size*D``
  are V as ``[block_size, D]``.
- ``CPU_AMX``: vLLM's CPU backend with the ``amx`` ISA (bf16 caches on CPUs with AMX tiles, block
  size a multiple of 32), same ``[num_blocks, H, block_size, 2*D]`` tensor and K-then-V pages, but
  each half is packed for the tile multiply (VNNI pairs). K ``(t, d)`` sits at
  ``[t//16, d//2, t%16, d%2]`` (strides ``16*D, 32, 2, 1``), V ``(t, d)`` at ``[d//16, t//2, d%16,
  t%2]`` (strides ``16*block_size, 32, 2, 1``); read off ``cpu_attn_reshape_and_cache(..., "amx")``
  and checked against it in the tests. These are not ``[block, token, head, dim]`` stride
  patterns, so the views are 6-D (``paged_amx.py`` indexes them).
- ``MLA``: ``[num_blocks, block_size, kv_lora_rank + rope_dim]``, one row per token, no V.

Not supported, with an error saying so: fp8 or integer caches.
"""

from __future__ import annotations

import dataclasses
import enum

import torch

from ._common import check_kv_dtype

# vLLM's CPU attention ISAs OrbitKV reads and writes, with their layout.
CPU_ISAS = {"vec": "cpu_vec", "vec16": "cpu_vec", "amx": "cpu_amx"}
# AMX tiles pack 16 tokens of K (and 16 features of V) per row group.
AMX_TILE = 16


class PagedLayout(enum.Enum):
    FLASH = "flash"
    CPU_VEC = "cpu_vec"
    CPU_AMX = "cpu_amx"
    MLA = "mla"

    @classmethod
    def parse(cls, layout: PagedLayout | str) -> PagedLayout:
        """A layout from the enum or a name: ``flash``/``LBNHC``, ``cpu_vec``/``vec``/``vec16``,
        ``cpu_amx``/``amx``, ``mla``."""
        if isinstance(layout, PagedLayout):
            return layout
        if not isinstance(layout, str):
            raise TypeError(f"layout must be a PagedLayout or a str, got {type(layout).__name__}")
        name = layout.strip().lower()
        aliases = {"flash": cls.FLASH, "lbnhc": cls.FLASH, "cpu_vec": cls.CPU_VEC,
                   "vec": cls.CPU_VEC, "vec16": cls.CPU_VEC, "cpu_amx": cls.CPU_AMX,
                   "amx": cls.CPU_AMX, "mla": cls.MLA}
        if name not in aliases:
            raise ValueError(f"unknown paged layout {layout!r}; supported: {sorted(aliases)}")
        return aliases[name]


@dataclasses.dataclass(frozen=True)
class CacheViews:
    """K and V of one layer's cache as ``[num_blocks, block_size, H, D]`` views (MLA: H = 1, no V).

    ``CPU_AMX``: the 6-D packed views of the module doc (K ``[num_blocks, H, block_size/16, D/2,
    16, 2]``, V ``[num_blocks, H, D/16, block_size/2, 16, 2]``); ``shape`` then gives the logical
    ``(num_blocks, block_size, H, D)``."""

    layout: PagedLayout
    k: torch.Tensor
    v: torch.Tensor | None
    packed_shape: tuple[int, int, int, int] | None = None

    @property
    def shape(self) -> tuple[int, int, int, int]:
        if self.packed_shape is not None:
            return self.packed_shape
        nb, bs, nh, hd = self.k.shape
        return int(nb), int(bs), int(nh), int(hd)

    @property
    def num_blocks(self) -> int:
        return self.shape[0]

    @property
    def block_size(self) -> int:
        return self.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.shape[2]

    @property
    def head_dim(self) -> int:
        return self.shape[3]

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size


def cache_views(cache: torch.Tensor, layout: PagedLayout | str) -> CacheViews:
    """Check ``cache`` is a well-formed ``layout`` cache and return its K/V views (no copy)."""
    layout = PagedLayout.parse(layout)
    check_kv_dtype("cache", cache)
    if layout is PagedLayout.MLA:
        if cache.dim() != 3:
            raise ValueError(
                f"MLA cache must be [num_blocks, block_size, kv_lora_rank + rope_dim], "
                f"got shape {tuple(cache.shape)}"
            )
        return CacheViews(layout, cache.unsqueeze(2), None)
    if layout is PagedLayout.FLASH and cache.dim() == 5:
        if cache.shape[1] != 2:
            raise ValueError(
                f"FLASH cache [num_blocks, 2, block_size, H, D] needs dim 1 == 2, "
                f"got shape {tuple(cache.shape)}"
            )
        return CacheViews(layout, cache[:, 0], cache[:, 1])
    if cache.dim() != 4 or cache.shape[3] % 2:
        forms = "[num_blocks, H, block_size, 2*D]"
        if layout is PagedLayout.FLASH:
            forms = "[num_blocks, 2, block_size, H, D] or " + forms
        raise ValueError(f"{layout.name} cache must be {forms}, got shape {tuple(cache.shape)}")
    num_blocks, num_heads, block_size, two_d = cache.shape
    head_dim = two_d // 2
    if layout is PagedLayout.FLASH:
        return CacheViews(
            layout, cache[..., :head_dim].transpose(1, 2), cache[..., head_dim:].transpose(1, 2)
        )
    if cache.stride(3) != 1 or cache.stride(2) != two_d:
        raise ValueError(
            f"{layout.name} cache pages must be contiguous within each (block, head): expected "
            f"strides (..., {two_d}, 1) for the last two dims, got {cache.stride()}"
        )
    page_elems = block_size * head_dim
    stride_block, stride_head = cache.stride(0), cache.stride(1)
    offset = cache.storage_offset()
    if layout is PagedLayout.CPU_AMX:
        return _amx_views(cache, (num_blocks, block_size, num_heads, head_dim))
    size = (num_blocks, block_size, num_heads, head_dim)
    k = cache.as_strided(size, (stride_block, 1, stride_head, block_size), offset)
    v = cache.as_strided(size, (stride_block, head_dim, stride_head, 1), offset + page_elems)
    return CacheViews(layout, k, v)


def _amx_views(cache: torch.Tensor, shape: tuple[int, int, int, int]) -> CacheViews:
    num_blocks, block_size, num_heads, head_dim = shape
    t = AMX_TILE
    if cache.dtype != torch.bfloat16 or block_size % (2 * t) or head_dim % (2 * t):
        raise ValueError(
            "CPU_AMX caches are bf16 with block_size and head_dim multiples of 32 (vLLM picks the "
            f"amx ISA only then), got {cache.dtype}, block_size={block_size}, head_dim={head_dim}"
        )
    stride_block, stride_head = cache.stride(0), cache.stride(1)
    offset = cache.storage_offset()
    k = cache.as_strided(
        (num_blocks, num_heads, block_size // t, head_dim // 2, t, 2),
        (stride_block, stride_head, t * head_dim, 2 * t, 2, 1), offset,
    )
    v = cache.as_strided(
        (num_blocks, num_heads, head_dim // t, block_size // 2, t, 2),
        (stride_block, stride_head, t * block_size, 2 * t, 2, 1), offset + block_size * head_dim,
    )
    return CacheViews(PagedLayout.CPU_AMX, k, v, shape)


def check_cache(
    cache: torch.Tensor,
    layout: PagedLayout | str,
    *,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    block_size: int | None = None,
    dtype: torch.dtype | None = None,
    isa: str | None = None,
) -> CacheViews:
    """Raise ``ValueError``/``TypeError`` naming the problem if ``cache`` is not what OrbitKV can load.

    ``num_kv_heads`` (MLA: 1), ``head_dim`` (MLA: ``kv_lora_rank + rope_dim``), ``block_size`` and
    ``dtype`` are what the model expects; None skips that check. ``isa`` is vLLM's CPU attention ISA
    (``vec``/``vec16``: ``CPU_VEC``; ``amx``: ``CPU_AMX``). Returns the cache's K/V views.
    """
    if isa is not None:
        if isa not in CPU_ISAS:
            raise ValueError(
                f"vLLM CPU attention ISA {isa!r} is not supported; supported: {sorted(CPU_ISAS)}"
            )
        if PagedLayout.parse(layout) is not PagedLayout.parse(CPU_ISAS[isa]):
            raise ValueError(
                f"isa={isa!r} is vLLM's {CPU_ISAS[isa]} CPU layout but layout is {layout!r}"
            )
    if dtype is not None and cache.dtype != dtype:
        raise TypeError(f"cache dtype {cache.dtype} does not match the model's KV dtype {dtype}")
    views = cache_views(cache, layout)
    expected = {"num_kv_heads": num_kv_heads, "head_dim": head_dim, "block_size": block_size}
    for name, want in expected.items():
        got = getattr(views, name)
        if want is not None and got != want:
            raise ValueError(
                f"{views.layout.name} cache of shape {tuple(cache.shape)} has {name}={got}, "
                f"expected {want}"
            )
    return views
