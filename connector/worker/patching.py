"""Forming conditioning patches from stored (or just computed) KV, off the forward pass.

A patch for chunk B after antecedent A is the rank-m factorisation, per layer and for K and V (MLA:
the latent row, ``k_pe`` band included), of ``KV(B|A) - R(delta) KV(B|anchor)``: the conditioned KV
minus the canonical relocated to A's positions. Two keys hold patches:

- ``(cid, antecedent_hash(A), m)``: this ordering's own patch (the ``patched`` mode);
- ``(cid, orbit_key(A), m)``: the *orbit* patch, the mean of the patches of every ordering of A's
  multiset stored so far (the ``orbit`` mode, for a reorder), re-truncated to rank m
  (``kernels.patch.combine_patches``). It is stored once two orderings are seen: of one ordering
  it would be a copy of that ordering's own patch, which the planner serves as the orbit's
  (``relocation.reordering_candidates``); ``bench bytes`` found those copies taking a sixth of the
  store.

Patches are formed when both inputs exist, whichever comes last: a chunk computed after A when B's
canonical is stored (the writer, on the save), or B's canonical arriving when conditioned entries of
B are stored (the writer, on the canonicalize; ``orbitkv store compile`` does a whole store). No
forward runs for it. Both inputs are exact KV (approximate conditioned entries are never read
here), and every patch records the checksum of the canonical it was formed against: a load applies
it to that canonical only, and the orbit patch averages only patches of one canonical.

Policy: a patch costs ``m * (N + H*D)`` numbers per layer and side; one larger than
``patch_max_bytes_fraction`` of the chunk's own KV is not worth storing (short chunks: keep the
conditioned entry), and ``patch_first_layer_fraction`` skips the shallow layers.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from orbitkv.kernels.patch import PatchFactors, combine_patches, form_layer_patch
from orbitkv.store.keys import (
    EntryKey,
    RequestKeys,
    antecedent_hash,
    conditioned_key,
    orbit_key,
)

if TYPE_CHECKING:
    from orbitkv.store.entry import Entry
    from orbitkv.store.tiered import TieredStore

    from orbitkv.config import OrbitKVConfig

    from ..identity import ModelIdentity

logger = logging.getLogger(__name__)

PATCH_NAMES = ("uk", "wk", "uv", "wv")


def patch_nbytes(
    num_tokens: int, num_features: int, rank: int, num_sides: int, itemsize: int = 4
) -> int:
    """Bytes of one layer's patch factors: ``m (N + F)`` numbers per side."""
    return itemsize * rank * (num_tokens + num_features) * num_sides


class PatchFormer:
    """Forms and combines patches for one model (its identity) into entries for the store."""

    def __init__(self, store: TieredStore, identity: ModelIdentity, config: OrbitKVConfig) -> None:
        self._store = store
        self._identity = identity
        self.rank = int(config.patch_rank)
        self._max_fraction = float(config.patch_max_bytes_fraction)
        self._dtype = getattr(torch, config.patch_dtype)
        self._is_replacing = bool(config.patch_replaces_conditioned)
        num_layers = identity.num_layers
        self._first_layer = min(num_layers, int(config.patch_first_layer_fraction * num_layers))

    # -- keys ------------------------------------------------------------------------------------

    def keys(self, cid: str, antecedent: Sequence[str]) -> tuple[str, str]:
        """This ordering's patch key and the orbit patch key of ``cid`` behind ``antecedent``."""
        keys = RequestKeys(patch_rank=self.rank)
        return keys.patch(cid, antecedent_hash(antecedent)), keys.orbit_patch(cid, antecedent)

    # -- forming ---------------------------------------------------------------------------------

    def is_worth_it(self, num_tokens: int) -> bool:
        ident = self._identity
        features = ident.head_dim if ident.is_mla else ident.num_kv_heads * ident.head_dim
        sides = 1 if ident.is_mla else 2
        kv_nbytes = num_tokens * features * sides * ident.cache_dtype.itemsize
        nbytes = patch_nbytes(num_tokens, features, self.rank, sides, self._dtype.itemsize)
        return nbytes <= self._max_fraction * kv_nbytes

    def exact_patch(
        self,
        tensors: dict[str, torch.Tensor],
        start_pos: int,
        canonical: Entry | None,
        antecedent: tuple[str, ...],
    ) -> Any | None:
        """The patch entry of KV ``tensors`` (at ``start_pos``) against ``canonical``, or None when
        the canonical does not fit (another length or RoPE) or the patch is not worth storing."""
        from orbitkv.kernels.relocate import relocate
        from orbitkv.store.entry import checksum_of

        ident = self._identity
        num_tokens = next(iter(tensors.values())).shape[0]
        if self.rank <= 0 or canonical is None or canonical.meta.num_tokens != num_tokens:
            return None
        if canonical.meta.rope_hash != ident.rope_hash or not self.is_worth_it(num_tokens):
            return None
        delta = start_pos - canonical.meta.start_pos
        if delta and ident.rope is None:
            return None
        factors: dict[str, torch.Tensor] = {}
        # The canonical is relocated in fp32 and not rounded: a load computes
        # round(R(delta) canonical + u @ w) from the same fp32 rotation, so a full-rank patch
        # gives back the conditioned KV exactly.
        for li in range(self._first_layer, ident.num_layers):
            if ident.is_mla:
                can = canonical.tensors[f"kv.{li}"].float()
                moved = relocate(can, delta, ident.rope) if delta else can
                pk, _ = form_layer_patch(tensors[f"kv.{li}"], moved, self.rank)
                factors.update({f"uk.{li}": pk.u, f"wk.{li}": pk.w})
                continue
            can_k = canonical.tensors[f"k.{li}"].float()
            moved = relocate(can_k, delta, ident.rope) if delta else can_k
            pk, pv = form_layer_patch(
                tensors[f"k.{li}"], moved, self.rank, tensors[f"v.{li}"], canonical.tensors[f"v.{li}"]
            )
            factors.update({f"uk.{li}": pk.u, f"wk.{li}": pk.w, f"uv.{li}": pv.u, f"wv.{li}": pv.w})
        if not factors:
            return None
        return self._entry(factors, start_pos, antecedent, canonical_checksum=checksum_of(canonical))

    def orbit_patch(
        self,
        cid: str,
        antecedent: tuple[str, ...],
        own: Entry,
        fresh: dict[tuple[str, ...], Any] | None = None,
    ) -> tuple[str, Any] | None:
        """The orbit patch of ``antecedent``'s multiset: ``own`` (this ordering's patch) averaged
        with the patches of the other orderings of that multiset seen for ``cid`` (``fresh``: ones
        formed in this batch, not stored yet)."""
        fresh = fresh or {}
        orderings = {tuple(antecedent)} | set(fresh)
        try:
            (seen,) = self._store.batch_antecedents([cid])
        except Exception:
            seen = []
        want = sorted(antecedent)
        orderings = {a for a in orderings | {tuple(a) for a in seen} if sorted(a) == want}
        others = sorted(orderings - {tuple(antecedent)})
        stored = [a for a in others if a not in fresh]
        got = dict(zip(stored, self._get([self.keys(cid, a)[0] for a in stored]), strict=True))
        got.update({a: fresh[a] for a in others if a in fresh})
        patches = [own] + [
            got[a] for a in others
            if got[a] is not None and got[a].meta.rank == self.rank
            and got[a].meta.canonical_checksum == own.meta.canonical_checksum
        ]
        if len(patches) < 2:
            return None  # one ordering: its own patch is the orbit's (the planner finds it)
        parts_by_layer: dict[str, list[PatchFactors]] = {}
        for patch in patches:
            for name in patch.tensors:
                if name.startswith(("uk.", "uv.")):
                    side, layer = name.split(".")
                    w = patch.tensors[f"w{side[1]}.{layer}"]
                    parts_by_layer.setdefault(name, []).append(PatchFactors(patch.tensors[name], w, 1.0))
        factors: dict[str, torch.Tensor] = {}
        for name, parts in parts_by_layer.items():
            if len(parts) != len(patches):
                continue  # a layer some orderings lack (another layer policy): leave it out
            side, layer = name.split(".")
            combined = combine_patches(parts, self.rank) if len(parts) > 1 else parts[0]
            factors[name], factors[f"w{side[1]}.{layer}"] = combined.u, combined.w
        if not factors:
            return None
        _, orbit_key_str = self.keys(cid, antecedent)
        # Addressed by the orbit key; the stored antecedent is the sorted multiset it hashes.
        entry = self._entry(factors, own.meta.start_pos, tuple(sorted(antecedent)),
                            antecedent_key=orbit_key(antecedent),
                            canonical_checksum=own.meta.canonical_checksum)
        return orbit_key_str, entry

    def for_computed_chunk(
        self,
        cid: str,
        antecedent: tuple[str, ...],
        start_pos: int,
        tensors: dict[str, torch.Tensor],
        canonical_key: str,
    ) -> list[tuple[str, Any]]:
        """Patch entries for a chunk whose exact KV was just computed after ``antecedent``, if B's
        canonical (``canonical_key``: in the anchor's context) is stored."""
        if self.rank <= 0 or not antecedent:
            return []
        (canonical,) = self._get([canonical_key])
        own = self.exact_patch(tensors, start_pos, canonical, antecedent)
        if own is None:
            return []
        exact_key, _ = self.keys(cid, antecedent)
        out = [(exact_key, own)]
        orbit = self.orbit_patch(cid, antecedent, own)
        if orbit is not None:
            out.append(orbit)
        return out

    def for_canonical(self, cid: str, canonical: Entry) -> list[tuple[str, Any]]:
        """Patch entries for every stored conditioned entry of ``cid``, now that its canonical
        exists (each formed once: an existing patch is kept)."""
        if self.rank <= 0:
            return []
        try:
            (seen,) = self._store.batch_antecedents([cid])
        except Exception:
            return []
        todo = [tuple(a) for a in seen if a]
        exact_keys = [self.keys(cid, a)[0] for a in todo]
        present = self._store.lookup(exact_keys) if todo else []
        todo = [a for a, tier in zip(todo, present, strict=True) if tier is None]
        cond_keys = [conditioned_key(cid, antecedent_hash(a)) for a in todo]
        fresh: dict[tuple[str, ...], Any] = {}
        for antecedent, entry in zip(todo, self._get(cond_keys), strict=True):
            if entry is None:
                continue
            own = self.exact_patch(entry.tensors, entry.meta.start_pos, canonical, antecedent)
            if own is not None:
                fresh[antecedent] = own
        out = [(self.keys(cid, a)[0], p) for a, p in fresh.items()]
        orbits = {}
        for antecedent, own in fresh.items():
            orbit = self.orbit_patch(cid, antecedent, own, fresh)
            if orbit is not None:
                orbits[orbit[0]] = orbit[1]  # one per multiset: every ordering gives the same mean
        return out + list(orbits.items())

    @property
    def is_replacing(self) -> bool:
        return self._is_replacing and self.rank > 0

    def has_canonical(self, canonical_key: str) -> bool:
        try:
            return self._store.lookup([canonical_key])[0] is not None
        except Exception:
            return False

    def drop_replaced(self, items: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
        """With ``patch_replaces_conditioned``: drop the conditioned entry KV(B|A) of each patch
        of B after A formed here that is smaller than it (orbit patches replace nothing). The
        store then serves B after A as canonical + patch (``patched``, approximate). Returns
        ``items`` (the patches to store)."""
        self._delete(self._replaced_keys(items))
        return items

    def in_place_of(
        self, items: list[tuple[str, Any]], held: list[tuple[str, Any]]
    ) -> list[tuple[str, Any]]:
        """The patches ``items`` and, of the conditioned entries ``held`` back from the store
        until they were formed, those no patch here replaces: a held entry never takes the
        store's bytes (nor evicts anything for them) when its patch does its job."""
        doomed = self._replaced_keys(items)
        self._delete(doomed)
        return items + [(k, e) for k, e in held if k not in doomed]

    def _delete(self, keys: list[str]) -> None:
        if keys:
            self._store.delete(keys)

    def _replaced_keys(self, items: list[tuple[str, Any]]) -> list[str]:
        if not self.is_replacing:
            return []
        doomed = []
        for key, entry in items:
            meta = entry.meta
            if meta.kind != "patch" or meta.antecedent_hash != antecedent_hash(meta.antecedent):
                continue
            if _entry_nbytes(entry) < self._kv_nbytes(meta.num_tokens):
                doomed.append(conditioned_key(EntryKey.parse(key).cid, meta.antecedent_hash))
        return doomed

    def _kv_nbytes(self, num_tokens: int) -> int:
        ident = self._identity
        features = ident.head_dim if ident.is_mla else ident.num_kv_heads * ident.head_dim
        sides = 1 if ident.is_mla else 2
        return num_tokens * features * sides * ident.cache_dtype.itemsize * ident.num_layers

    # -- helpers ---------------------------------------------------------------------------------

    def _get(self, keys: list[str]) -> list[Any]:
        if not keys:
            return []
        try:
            return self._store.get(keys, expect_fingerprint=self._identity.model_fingerprint)
        except Exception:
            logger.exception("OrbitKV: reading entries for a patch failed")
            return [None] * len(keys)

    def _entry(
        self,
        factors: dict[str, torch.Tensor],
        start_pos: int,
        antecedent: tuple[str, ...],
        antecedent_key: str | None = None,
        canonical_checksum: str = "",
    ) -> Any:
        from orbitkv.store.entry import make_entry

        ident = self._identity
        return make_entry(
            "patch",
            {name: t.to(self._dtype) for name, t in factors.items()},
            model_fingerprint=ident.model_fingerprint,
            layout=ident.layout,
            start_pos=start_pos,
            rope_hash=ident.rope_hash,
            antecedent=antecedent,
            antecedent_key=antecedent_key,
            rank=self.rank,
            canonical_checksum=canonical_checksum,
        )


def _entry_nbytes(entry: Entry) -> int:
    return sum(t.numel() * t.element_size() for t in entry.tensors.values())
