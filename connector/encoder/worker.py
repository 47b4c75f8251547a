"""The encoder connector's worker half: put served outputs into vLLM's encoder cache, save new ones.

Loads cannot fail here: the scheduler half sends outputs it already read and verified. Saves copy
the output to host memory (asynchronously on CUDA: the background writer waits for the copy) and
queue the entry on the process's shared writer (``connector/runtime.py``), so checksumming and
the tier writes stay off the forward pass, exactly as for KV entries.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from orbitkv.store.keys import EntryKey

from .entries import make_encoder_entry
from .metadata import OrbitKVECMetadata, OrbitKVECWorkerMeta

if TYPE_CHECKING:
    from ..runtime import Shared

logger = logging.getLogger(__name__)


def to_host(output: torch.Tensor) -> tuple[torch.Tensor, Callable[[], None]]:
    """``output`` in host memory for the writer, which reads it after this step, and a function
    that waits until it is there.

    On a device, a private copy: an encoder may hand out views of a buffer it reuses (CUDA
    graphs). It is queued behind the encoder on its stream, into pinned memory, so the forward pass
    does not wait for it. On the CPU, ``output`` itself: no capture replays into a CPU buffer and
    vLLM's model runner only reads the outputs it caches, so holding the tensor keeps its bytes as
    they are; the writer's entry is its copy, off the forward. A copy here cost the forward about
    0.2 ms an image on the bench model (page faults on a fresh buffer, issue 26)."""
    if output.is_cpu:
        # Two flag reads: this runs right after the encoder's forward, on cold caches, where a
        # ``detach`` and a ``device`` object cost about 30 us an image on the bench model.
        return (output.detach() if output.requires_grad else output), _no_wait
    output = output.detach()
    if not output.is_cuda:
        return output.to("cpu"), _no_wait
    host = torch.empty(output.shape, dtype=output.dtype, device="cpu", pin_memory=True)
    host.copy_(output, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return host, done.synchronize


def _no_wait() -> None:
    """Nothing to wait for: the output is in host memory already."""


class ECWorkerHalf:
    def __init__(
        self, shared: Shared, model_fingerprint: str, device: torch.device, *, is_saver: bool
    ) -> None:
        self._shared = shared
        self._writer = shared.writer
        self._fingerprint = model_fingerprint
        self._device = device
        # One rank saves (tensor parallel ranks hold the same outputs).
        self._is_saver = is_saver
        self._counters: dict[str, float] = {}

    def _count(self, name: str, value: float = 1) -> None:
        self._counters[name] = self._counters.get(name, 0) + value

    def start_load_caches(
        self, encoder_cache: dict[str, torch.Tensor], meta: OrbitKVECMetadata
    ) -> None:
        for load in meta.loads:
            if load.mm_hash not in encoder_cache:
                encoder_cache[load.mm_hash] = load.output.to(self._device)

    def save_caches(
        self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, meta: OrbitKVECMetadata | None
    ) -> None:
        keys = meta.saves.get(mm_hash) if meta is not None and self._is_saver else None
        output = encoder_cache.get(mm_hash) if keys else None
        if output is None:
            return
        host, wait = to_host(output)
        fingerprint = self._fingerprint

        def job() -> list[tuple[str, Any]]:
            wait()
            return [(key, make_encoder_entry(host, fingerprint)) for key in keys]

        num_dropped = self._writer.num_dropped
        self._writer.submit(frozenset(EntryKey.parse(k).cid for k in keys), job, host.nbytes)
        if self._writer.num_dropped != num_dropped:
            self._count("dropped_saves")
        else:
            self._count("saved_items")

    def build_worker_meta(self) -> OrbitKVECWorkerMeta | None:
        if not self._shared.has_worker:
            # No KV worker in this process drains the shared writer's events (its reports to a
            # scheduler in another process); drop them so they do not pile up.
            self._writer.drain_events()
        if not self._counters:
            return None
        meta, self._counters = OrbitKVECWorkerMeta(self._counters), {}
        return meta
