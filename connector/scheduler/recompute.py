"""Selective recompute: which tokens of a reused chunk vLLM computes fresh.

A chunk served in the ``recompute`` mode is its canonical KV (``KV(B | anchor)``), relocated; a
budget of its tokens (``recompute_fraction`` of the chunk, at least one) is computed by vLLM in
context instead, attending to everything before it, as CacheBlend and VLCache do. The rest of the
chunk is loaded as a hole behind those fresh tokens (``planner.find_holes``), so the budget costs
one forward step per chunk, not one per token.

Which tokens: the chunk's first ones. The choice must be known when the request is planned, before
any of its KV exists, so CacheBlend's criterion (the tokens whose layer-1 KV deviates most, found by
computing layer 1 for every token) is not available to vLLM's scheduler. The criteria that are:
- the first tokens: MPIC recomputes the first k tokens of each image (its Insight 2, the attention
  sink at a chunk's start: a chunk cached alone put its first tokens at the head of a sequence, and
  later tokens over-attend them), VLCache the first r% of each reused chunk (its cumulative error
  effect: an error in the first tokens propagates to the later ones; recomputing them stops it);
  EPIC (LegoLink) the first k tokens of each chunk. Nothing has to be stored for it.
- a per-token deviation score stored at save time (the norm of a token's patch rows over the
  layers, formed where the chunk was seen in another context): it predicts this context's
  deviating tokens only as far as they are the same across contexts, and Kamera reports the
  deficit is diffuse across tokens (an oracle by true deficit magnitude needs about half the tokens).
  Not implemented: it needs a patch read on the scheduler's critical path.

``orbitkv bench fidelity``'s ``recompute`` arms measure the first-tokens choice on the real model at
several budgets; it is served only on request opt-in and where the calibration allows it.
"""

from __future__ import annotations

import math


def num_recomputed(num_tokens: int, fraction: float) -> int:
    """Tokens of a ``num_tokens``-token chunk computed fresh at ``fraction`` (0: none)."""
    if fraction <= 0 or num_tokens <= 0:
        return 0
    return min(num_tokens, max(1, math.ceil(fraction * num_tokens - 1e-9)))
