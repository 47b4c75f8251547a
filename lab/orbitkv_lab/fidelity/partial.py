"""Partial prefill: one forward of the whole prompt in which chosen tokens' KV comes from a reused
cache, layer by layer, and the rest is computed by the model.

How it works (exact, no approximation beyond the cache rounding every arm shares):

* :class:`ReuseCache` is a ``DynamicCache`` whose ``update`` -- called by every attention layer
  with the freshly computed (post-RoPE; MLA: latent ``kv_c`` and rotated ``k_pe``) K/V of all
  tokens -- first rounds them to the bf16 cache dtype and then overwrites the rows whose
  ``reuse[layer]`` flag is set with the reused KV. The attention of that layer, for every query,
  then reads reused KV for those rows and fresh KV for the others.
* Tokens interact only through attention K/V, so a token whose rows are fresh at layers
  ``0..l`` has exactly the hidden state a partial prefill would give it (it attends to the mixed
  cache). A reused token's own hidden state is computed too but never read: its KV row is
  overwritten at every layer where it is reused. For schedules in which a token, once reused at a
  layer, stays reused deeper (CacheBlend, VLCache, MPIC, EPIC all are), this is *identical* to a
  partial prefill that skips the reused tokens; the extra compute is only wasted work.
* ``drop[layer]`` (``[H_kv, N]`` bools) removes keys per KV head from every query's view (an
  additive ``-inf``), the eviction that MM-ShiftKV's selection performs.

The custom attention (``orbitkv_lab``) is plain eager attention plus the drop mask; it can also
record the queries and keys each layer saw (MM-ShiftKV's proxies need them).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from orbitkv.models import hfrun

CACHE_DTYPE = torch.bfloat16
ATTN_NAME = "orbitkv_lab"


@dataclasses.dataclass
class _State:
    drop: list[torch.Tensor | None] | None = None
    capture: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None


STATE = _State()


def _attention(
    module: Any, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw: Any
):
    layer = getattr(module, "layer_idx", None)
    if layer is None:  # not a decoder layer (the vision tower): leave it as transformers runs it
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kw
        )
    groups = query.shape[1] // key.shape[1]
    if STATE.capture is not None and layer is not None:
        STATE.capture[layer] = (query[0].detach().clone(), key[0].detach().clone())
    k = key.repeat_interleave(groups, dim=1) if groups > 1 else key
    v = value.repeat_interleave(groups, dim=1) if groups > 1 else value
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    scores = torch.matmul(query, k.transpose(2, 3)) * scaling
    if attention_mask is not None:
        mask = attention_mask
        if mask.dtype == torch.bool:
            mask = torch.zeros_like(mask, dtype=scores.dtype).masked_fill(~mask, float("-inf"))
        scores = scores + mask[..., : k.shape[-2]]
    if STATE.drop is not None and layer is not None and STATE.drop[layer] is not None:
        d = STATE.drop[layer]  # [H_kv, N_prefix]
        d = d.repeat_interleave(groups, dim=0) if groups > 1 else d
        full = torch.zeros(scores.shape[1], scores.shape[-1], dtype=torch.bool)
        full[:, : d.shape[1]] = d
        scores = scores.masked_fill(full[None, :, None, :], float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(query.dtype)
    out = torch.matmul(probs, v).transpose(1, 2).contiguous()
    return out, probs


def install(hm: hfrun.HFModel) -> None:
    """Route the text model's attention through ``orbitkv_lab`` (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(ATTN_NAME, _attention)
    AttentionMaskInterface.register(ATTN_NAME, eager_mask)
    seen = set()
    for mod in hm.model.modules():
        cfg = getattr(mod, "config", None)
        if cfg is None or id(cfg) in seen or "Vision" in type(cfg).__name__:
            continue
        if mod is hm.model and hm.arch == "qwen2-vl":
            continue  # the composite config would hand the setting to the vision tower too
        if "Vision" in type(mod).__name__ or "Visual" in type(mod).__name__:
            continue
        seen.add(id(cfg))
        cfg._attn_implementation = ATTN_NAME


class ReuseCache:
    """Factory of a ``DynamicCache`` subclass instance (see module doc)."""

    def __new__(
        cls,
        hm: hfrun.HFModel,
        reused: list[tuple[torch.Tensor, torch.Tensor]] | None,
        reuse: list[torch.Tensor] | None,
    ):
        from transformers import DynamicCache

        class _Cache(DynamicCache):
            def update(self, key_states, value_states, layer_idx, *args, **kwargs):
                k = key_states.to(CACHE_DTYPE).to(key_states.dtype)
                v = value_states.to(CACHE_DTYPE).to(value_states.dtype)
                if reused is not None and reuse is not None and bool(reuse[layer_idx].any()):
                    rk, rv = reused[layer_idx]
                    n = rk.shape[2]
                    m = reuse[layer_idx][:n].view(1, 1, n, 1)
                    k = k.clone()
                    v = v.clone()
                    k[:, :, :n] = torch.where(m, rk.to(k.dtype), k[:, :, :n])
                    v[:, :, :n] = torch.where(m, rv.to(v.dtype), v[:, :, :n])
                return super().update(k, v, layer_idx, *args, **kwargs)

        return _Cache()


def to_cache_layout(
    hm: hfrun.HFModel, kv: list[hfrun.LayerKV]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Chunk layout (``[N, H, D]``; MLA ``[N, lora + rope]``) -> cache layout ``[1, H, N, D]``."""
    out = []
    for k, v in kv:
        if hm.is_mla:
            lora = hm.spec.rope_offset
            out.append((k[None, None, :, :lora].float(), k[None, None, :, lora:].float()))
        else:
            out.append((k.transpose(0, 1)[None].float(), v.transpose(0, 1)[None].float()))
    return out


@torch.no_grad()
def forward(
    hm: hfrun.HFModel,
    prompt: hfrun.Prompt,
    reused: list[hfrun.LayerKV] | None = None,
    reuse: list[torch.Tensor] | None = None,
    drop: list[torch.Tensor | None] | None = None,
    capture: bool = False,
) -> tuple[torch.Tensor, list[hfrun.LayerKV], dict[int, tuple[torch.Tensor, torch.Tensor]] | None]:
    """Run ``prompt`` once; rows flagged in ``reuse[layer]`` (``[N]`` bools over the prompt, or
    a prefix of it) take ``reused`` (chunk layout, covering that prefix). Returns (last-token
    logits fp32, the bf16 KV every layer attended to, in chunk layout, captured q/k or None)."""
    cache = ReuseCache(hm, None if reused is None else to_cache_layout(hm, reused), reuse)
    STATE.drop = drop
    STATE.capture = {} if capture else None
    try:
        out = hm.model(
            input_ids=prompt.input_ids[None],
            position_ids=hfrun._position_ids(hm, prompt.positions),
            past_key_values=cache,
            use_cache=True,
            **prompt.extras,
        )
        captured = STATE.capture
    finally:
        STATE.drop = None
        STATE.capture = None
    kv = [
        (k.to(CACHE_DTYPE), None if v is None else v.to(CACHE_DTYPE))
        for k, v in hfrun.cache_to_chunk(hm, cache)
    ]
    return out.logits[0, -1].float(), kv, captured
