"""An entry's layers as one view a side (``Entry.stacks``), found once when it is decoded.

``encode`` lays an entry's tensors out by kind, then layer (``entry._plan``): the K of every layer
at a constant step, then the V. Where a side's tensors are such a run, ``stacks_of`` gives them as
one ``[num_layers, *shape]`` view whose layer ``i`` is the tensor ``<side>.<i>`` itself (the same
bytes of the same storage). The worker checks a stack's dtype and shape once, not once a layer,
and loads every layer of the entry with one native call from it (``connector/worker/loading.py``).

A memory-tier entry's stacks are found at its first zero-copy read and kept with its views
(``tiered_read._Viewed``): a recurring chunk's load then walks no tensor. Any other read finds
them as it decodes, once per read.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import torch

# The sides a load reads: K and V, or MLA's latent (``connector/worker/loading.py``).
STACKED_SIDES = ("k", "v", "kv")


def stacks_of(tensors: Mapping[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """Each side of ``STACKED_SIDES`` whose ``num_layers`` tensors (``<side>.0`` ...) are one
    run (one dtype and shape, contiguous, a constant positive step, in layer order), as a view
    of them all; the other sides are left out (their loads go layer by layer)."""
    out: dict[str, torch.Tensor] = {}
    if num_layers < 1:
        return out
    for side in STACKED_SIDES:
        names = _names(side, num_layers)
        if names[0] not in tensors:
            continue
        stack = _stack([tensors.get(name) for name in names])
        if stack is not None:
            out[side] = stack
    return out


def _stack(layers: list[torch.Tensor | None]) -> torch.Tensor | None:
    first = layers[0]
    if any(t is None or t.dtype != first.dtype or t.shape != first.shape for t in layers):
        return None
    if not all(t.is_contiguous() and t.device == first.device for t in layers):
        return None
    item = first.element_size()
    ptrs = [t.data_ptr() for t in layers]
    step = ptrs[1] - ptrs[0] if len(ptrs) > 1 else 0
    # range() wants a non-zero step; a zero step (every layer one tensor) is no run here.
    if len(ptrs) > 1 and (
        step <= 0 or step % item or ptrs != list(range(ptrs[0], ptrs[-1] + 1, step))
    ):
        return None
    # Contiguous: the strides are the shape's, also where torch reports another for a dimension
    # of size 1 (a one-token chunk).
    try:
        return first.as_strided(
            (len(layers), *first.shape), (step // item, *contiguous_strides(tuple(first.shape))),
            first.storage_offset(),
        )
    except RuntimeError:  # the run would leave the first tensor's storage
        return None


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A C-contiguous tensor's strides for ``shape`` (a dimension of size 0 counts as 1)."""
    strides, step = [], 1
    for dim in reversed(shape):
        strides.append(step)
        step *= max(dim, 1)
    return tuple(reversed(strides))


@functools.lru_cache(maxsize=16)
def _names(side: str, num_layers: int) -> tuple[str, ...]:
    return tuple(f"{side}.{li}" for li in range(num_layers))
