"""The entries a saved chunk becomes (run on the writer thread, off the forward pass): its conditioned
entry and canonical, and the patch jobs they allow, queued at low priority (``patch_queue.py``)."""

from __future__ import annotations

from array import array
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from orbitkv.kernels.paged import PagedLayout, gather_chunk, gather_many
from orbitkv.kernels.paged_layout import cache_views
from orbitkv.store.entry import make_entry

from ..identity import ModelIdentity
from ..metadata import OrbitKVMetadata, SaveSpec
from .loading import slot_tensor
from .patch_queue import PatchQueue
from .patching import PatchFormer

if TYPE_CHECKING:
    from orbitkv.store.entry import Entry


class EntryBuilder:
    def __init__(
        self, identity: ModelIdentity, queue: PatchQueue, patches: PatchFormer,
        *, is_forming_patches: bool = True,
    ) -> None:
        self._identity = identity
        self._queue = queue
        self.patches = patches
        # A server that serves exact KV only (approximate_reuse off) never reads a patch, so its
        # canonicals queue no patch jobs either: a job is BLAS work on the forward's cores, and
        # while any is queued the former wakes on every step (``patch_queue.py``).
        self._is_forming_patches = is_forming_patches

    def build(
        self, spec: SaveSpec, tensors: dict[str, torch.Tensor]
    ) -> list[tuple[str, Any]]:
        """Entries for one saved chunk (runs on the writer thread): the conditioned entry (and the
        canonical). The patches it allows (``patching.py``: this ordering's and the orbit's when B's
        canonical is stored, or, when this chunk *is* B's canonical, the patches of the conditioned
        entries of B stored so far) are queued, formed at low priority (``patch_queue.py``)."""
        items = [(key, self._entry(kind, spec, tensors)) for kind, key in spec.keys.items()]
        if spec.lineage:
            return items  # canonicals and patches are formed from exact KV only
        queue, former = self._queue, self.patches
        jobs = []
        if spec.is_patch_wanted:
            held = self._held_back(spec, items)
            items = [(k, e) for k, e in items if all(k != h for h, _ in held)]
            jobs.append((lambda held=held: former.in_place_of(former.for_computed_chunk(
                spec.cid, spec.antecedent, spec.start_pos, tensors, spec.canonical_key
            ), held), held, tensors_nbytes(tensors) + sum(entry_nbytes(e) for _, e in held)))
        canonical = dict(spec.keys).get("canonical")
        if canonical is not None and self._is_forming_patches:
            entry = next(e for k, e in items if k == canonical)
            jobs.append((lambda: former.drop_replaced(former.for_canonical(spec.cid, entry)), [],
                         entry_nbytes(entry)))
        for job, held, nbytes in jobs:
            if not queue.submit(job, nbytes):
                items += held
        return items

    def _held_back(self, spec: SaveSpec, items: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
        """With ``patch_replaces_conditioned`` and B's canonical stored, the conditioned entry
        waits with its patch job instead of being stored now: stored, then deleted when the patch
        forms, it would take its bytes from the budget meanwhile and evict older entries for them
        (``bench bytes``: both arms then served the same tokens). It is stored after all when no
        smaller patch is formed, or when the job is dropped."""
        if not self.patches.is_replacing or not self.patches.has_canonical(spec.canonical_key):
            return []
        key = spec.keys.get("conditioned")
        return [(k, e) for k, e in items if k == key]

    def _entry(self, kind: str, spec: SaveSpec, tensors: dict[str, torch.Tensor]):
        ident = self._identity
        return make_entry(
            kind,
            tensors,
            model_fingerprint=ident.model_fingerprint,
            layout=ident.layout,
            start_pos=spec.start_pos,
            rope_hash=ident.rope_hash,
            antecedent=spec.antecedent,
            antecedent_key=spec.antecedent_hash,
            dtype=str(ident.cache_dtype).removeprefix("torch."),
            lineage=spec.lineage if kind == "conditioned" else "",
        )


def tensors_nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.nbytes for t in tensors.values())


def entry_nbytes(entry: Entry) -> int:
    return tensors_nbytes(entry.tensors)


@dataclass(slots=True)
class GatheredKV:
    """A step's saved tokens from every layer: ``stacked()[i]`` is layer ``layer_ids[i]``'s K and V
    (``[L, 2, N, H, D]``, or ``[L, 1, N, D]`` for MLA). A chunk's tensors are sliced from it on the
    writer thread (``chunk``), not on the forward pass: a step saving 10 chunks of a 16-layer
    model would take 320 slices there. ``copying``: the gather still running on the save copier's
    thread (``saving.py``); ``stacked`` waits for it."""

    layer_ids: list[int]
    is_mla: bool
    # One token's bytes over every layer, K and V: a chunk's size is known before its copy is done.
    token_nbytes: int
    tensor: torch.Tensor | None = None
    copying: Future[tuple[torch.Tensor, float]] | None = None

    def stacked(self) -> torch.Tensor:
        if self.tensor is None:
            assert self.copying is not None, "GatheredKV holds neither a tensor nor a copy"
            self.tensor, _ = self.copying.result()
        return self.tensor

    def chunk_nbytes(self, lo: int, hi: int) -> int:
        return (hi - lo) * self.token_nbytes

    def chunk(self, lo: int, hi: int) -> dict[str, torch.Tensor]:
        stacked = self.stacked()
        sides = ("kv",) if self.is_mla else ("k", "v")
        return {f"{side}.{li}": stacked[i, j, lo:hi]
                for i, li in enumerate(self.layer_ids) for j, side in enumerate(sides)}


def save_slots(meta: OrbitKVMetadata, device: torch.device) -> torch.Tensor:
    """Every saved chunk of the step in one slot mapping, in ``meta.saves`` order."""
    joined = array("q")
    for spec in meta.saves:
        joined.extend(spec.slots)  # arrays join as one copy each, not int by int
    return slot_tensor(joined, device)


def gather_stacked(
    caches: list[torch.Tensor], slots: torch.Tensor, layout: PagedLayout, *, is_mla: bool,
    is_cpu: bool, num_threads: int | None = None,
) -> torch.Tensor:
    """The tokens at ``slots`` of every cache (``GatheredKV``'s tensor): one gather where the
    native op runs (else one per layer), every chunk of the step at once (a call costs more in
    dispatch than a short chunk's bytes: measured 46 ms of gathers on a 45-chunk step, one call
    each)."""
    stacked = (
        gather_many(caches, slots, layout, num_threads=num_threads)
        if not is_mla and is_cpu else None
    )
    if stacked is None:
        per_layer = [gather_chunk(cache, slots, layout) for cache in caches]
        # Stacked where the cache is, then one copy to the host.
        stacked = torch.stack(
            [torch.stack([k] if is_mla else [k, v]) for k, v in per_layer]
        ).to("cpu")
    return stacked


def token_nbytes(cache: torch.Tensor, layout: PagedLayout, num_layers: int, *, is_mla: bool) -> int:
    """One token's gathered bytes over ``num_layers`` layers of caches like ``cache``."""
    views = cache_views(cache, layout)
    sides = 1 if is_mla else 2
    return num_layers * sides * views.num_kv_heads * views.head_dim * cache.element_size()


@dataclass(slots=True)
class EntryJob:
    """Runs on the writer thread: turn one chunk's gathered tokens (``lo:hi`` of ``gathered``)
    into entries."""

    builder: EntryBuilder
    spec: SaveSpec
    gathered: GatheredKV
    lo: int
    hi: int

    def __call__(self) -> list[tuple[str, Any]]:
        return self.builder.build(self.spec, self.gathered.chunk(self.lo, self.hi))
