"""Paged load/gather for vLLM's ``CPU_AMX`` cache (bf16 on CPUs with AMX tiles; layout in
``paged_layout.py``).

Loads relocate (+ patch) K token-major first, with the reference's own ``rotate_and_patch`` call, so
the bytes are those of every other layout; the tiles are then written by vLLM's own writer
``cpu_attn_reshape_and_cache(..., "amx")`` when it packs ``amx`` caches on this CPU
(``backend='auto'``), else by advanced indexing on the 6-D packed views (the reference,
``backend='torch'``). Gathers always index the views: vLLM has no reader.
"""

from __future__ import annotations

import torch

from ._common import vllm_amx_writer
from .paged_layout import AMX_TILE, CacheViews
from .paged_torch import drop_padding
from .relocate import rotate_and_patch


def request_amx_permission() -> bool:
    """Ask Linux for the AMX tile state once per process (``arch_prctl(ARCH_REQ_XCOMP_PERM)``,
    through torch). Returns whether AMX tiles may be used here.

    vLLM 0.32's CPU attention runs AMX tile instructions without asking: a process whose first
    forward is short (a prompt of a few tokens, or one whose KV was loaded) has not yet run a large
    bf16 GEMM (oneDNN asks then) and dies of SIGILL in ``cpu_attention::AttentionMainLoop``."""
    try:
        return bool(torch.cpu._is_amx_tile_supported()) and bool(torch._C._cpu._init_amx())
    except (AttributeError, RuntimeError):  # a torch without these hooks: nothing to ask for
        return False


def _index(views: CacheViews, slots: torch.Tensor):
    """Per-token indices into the packed views: ``(block, k_group, k_lane, v_pair, v_lane)``."""
    block, token = slots // views.block_size, slots % views.block_size
    return block, token // AMX_TILE, token % AMX_TILE, token // 2, token % 2


def load_amx(views: CacheViews, cache, slots, k, v, cos, sin, spec, patch_k, patch_v, *,
             is_reference: bool) -> None:
    """``slots`` may hold padding (-1), skipped."""
    slots, k, v, cos, sin, patch_k, patch_v = drop_padding(slots, k, v, cos, sin, patch_k, patch_v)
    n = k.shape[0]
    if n == 0:
        return
    _, bs, nh, hd = views.shape
    k = rotate_and_patch(k.view(n, nh, hd), cos, sin, spec, patch_k)
    v = rotate_and_patch(v, None, None, None, patch_v)
    op = None if is_reference else vllm_amx_writer()
    if op is not None:
        key_cache, value_cache = cache.view(views.num_blocks, nh, 2 * bs, hd).chunk(2, dim=2)
        op(k.contiguous(), v.contiguous(), key_cache, value_cache, slots, "amx",
           k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
        return
    block, k_group, k_lane, v_pair, v_lane = _index(views, slots)
    views.k[block, :, k_group, :, k_lane, :] = k.reshape(n, nh, hd // 2, 2)
    views.v[block, :, :, v_pair, :, v_lane] = v.reshape(n, nh, hd // AMX_TILE, AMX_TILE)


def gather_amx(views: CacheViews, cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens at ``slots`` as contiguous ``[N, H, D]`` K and V; padding (-1) reads as zeros.

    The touched pages are copied out whole (one row copy on a wide-word view), then unpacked with
    one transpose each: K's VNNI pairs are two features of one token, so K moves as 32-bit words
    (``[t//16, d//2, t%16]`` to ``[t, d//2]``); V's pairs are one feature of two tokens. Indexing the
    packed views per token, or permuting them in bf16, moves 2- or 4-byte pieces and runs ~100x
    slower."""
    keep = slots >= 0
    safe = torch.where(keep, slots, torch.zeros_like(slots))
    nb, bs, nh, hd = views.shape
    t = AMX_TILE
    if not cache.is_contiguous():  # not what vLLM allocates: index the packed views per token
        block, k_group, k_lane, v_pair, v_lane = _index(views, safe)
        k = views.k[block, :, k_group, :, k_lane, :].reshape(-1, nh, hd)
        v = views.v[block, :, :, v_pair, :, v_lane].reshape(-1, nh, hd)
        k[~keep] = 0
        v[~keep] = 0
        return k, v
    blocks, page_of = torch.unique(safe // bs, return_inverse=True)
    m = blocks.shape[0]
    pages = cache.view(torch.int64).view(nb, -1).index_select(0, blocks)
    pages = pages.view(torch.int16).view(m, nh, 2, bs * hd)
    k_words = pages[:, :, 0].view(torch.int32).view(m, nh, bs // t, hd // 2, t)
    k = k_words.permute(0, 2, 4, 1, 3).reshape(m * bs, nh, hd // 2).view(cache.dtype)
    v_pairs = pages[:, :, 1].view(m, nh, hd // t, bs // 2, t, 2)
    v = v_pairs.permute(0, 3, 5, 1, 2, 4).reshape(m * bs, nh, hd).view(cache.dtype)
    rows = page_of * bs + safe % bs
    if not (rows.shape[0] == m * bs and torch.equal(rows, torch.arange(m * bs))):
        k, v = k.index_select(0, rows), v.index_select(0, rows)
    if not bool(keep.all()):
        k[~keep] = 0
        v[~keep] = 0
    return k, v
