"""Lineage: is a request's KV what a full prefill computes (*exact*), or approximate under a policy?

A request's *policy* is the approximate KV it accepts: the approximate reuse modes it allows
(survivor, transfer, patched, orbit, blind, recompute), the patch rank they are served at, the share
of a chunk recompute computes, and the modalities blind is narrowed to. Two requests share approximate KV only under the same policy (the same tag); a
request whose policy allows no approximate mode is *exact*. Within a request, every token from the
first approximate one on is approximate (its KV attended to approximate KV): ``approx_from`` is that
token index, or None while the request is exact.

Where lineage lives:
- the store: a conditioned entry computed over approximate KV is keyed with its policy tag
  (``store/keys.py``); canonicals and patches are formed from exact KV only;
- vLLM's prefix cache: blocks hash under vLLM's own chain while they are exact, and under
  ``tag(policy, h)`` once approximate (``prefix_lineage.py``), so an exact request never finds them;
- the scheduler extension (``exact_guard.py``): blocks loaded in a step enter vLLM's prefix cache
  only once vLLM confirmed the step, and blocks whose load failed leave it with everything after.
"""

from __future__ import annotations

from dataclasses import dataclass

import xxhash

from .planner import (
    ALL_MODES,
    APPROXIMATE_MODES,
    PATCH_MODES,
    RECOMPUTE,
    TRANSFER,
    TRANSFER_ATTACHED,
)

EXACT_LINEAGE = ""
EVERY_MODALITY = "*"
# A modality in a transfer scope under this suffix: transfer only from a stored antecedent that ends
# with the same chunk (``transfer_attached_modalities``).
ATTACHED = "@attached"


@dataclass(frozen=True, slots=True)
class Policy:
    """The approximate KV a request accepts, resolved once per request (``options.RequestRules``):
    the approximate modes, the patch rank they are served at, and per mode the modalities it may
    serve (``"*"``: every chunk). ``modes`` holds approximate modes only; the planner takes the
    per-chunk view (``mode_filter``). ``recompute_fraction``: the share of a ``recompute`` chunk's
    tokens computed fresh (another share is another policy: other KV)."""

    modes: frozenset[str] = frozenset()
    patch_rank: int = 0
    recompute_fraction: float = 0.0
    # (mode, modalities) for every mode in ``modes``, sorted.
    scopes: tuple[tuple[str, tuple[str, ...]], ...] = ()

    @classmethod
    def of(
        cls, modes: frozenset[str], patch_rank: int, scopes: dict[str, tuple[str, ...]] | None = None,
        recompute_fraction: float = 0.0,
    ) -> Policy:
        """The policy of a request allowed ``modes`` (exact ones included, ignored here); a mode
        missing from ``scopes`` serves every modality, one with an empty scope is dropped."""
        scopes = scopes or {}
        approx = {m for m in frozenset(modes) & APPROXIMATE_MODES
                  if scopes.get(m, (EVERY_MODALITY,))}
        return cls(
            modes=frozenset(approx),
            patch_rank=patch_rank if approx & PATCH_MODES else 0,
            recompute_fraction=float(recompute_fraction) if RECOMPUTE in approx else 0.0,
            scopes=tuple(sorted((m, tuple(sorted(scopes.get(m, (EVERY_MODALITY,)))))
                                for m in approx)),
        )

    @property
    def is_exact(self) -> bool:
        return not self.modes

    def scope(self, mode: str) -> tuple[str, ...]:
        return next((s for m, s in self.scopes if m == mode), ())

    @property
    def tag(self) -> str:
        """32 hex chars naming the policy ("" when exact): part of approximate keys and hashes."""
        if self.is_exact:
            return EXACT_LINEAGE
        h = xxhash.xxh3_128()
        # The fraction only where recompute is on: every other policy keeps its tag.
        fraction = (f"recompute@{self.recompute_fraction!r}",) if RECOMPUTE in self.modes else ()
        for part in ("orbitkv-policy-v2", str(self.patch_rank), *fraction,
                     *(f"{m}:{','.join(s)}" for m, s in self.scopes)):
            h.update(part.encode())
            h.update(b"\x00")
        return h.hexdigest()

    def mode_filter(self):
        """Per chunk, the modes this policy allows for its modality (None: no mode is narrowed).
        A transfer scope entry ``text@attached`` gives text chunks the ``TRANSFER_ATTACHED``
        allowance instead of transfer from any antecedent."""
        narrowed = [(m, s) for m, s in self.scopes if EVERY_MODALITY not in s]
        if not narrowed:
            return None
        every = frozenset(ALL_MODES)
        attached = frozenset(x.removesuffix(ATTACHED) for x in self.scope(TRANSFER)
                             if x.endswith(ATTACHED))

        def modes_for(chunk) -> frozenset[str]:
            modality = chunk.modality if chunk.is_mm else "text"
            out = every - {m for m, s in narrowed if modality not in s}
            return out | {TRANSFER_ATTACHED} if modality in attached else out

        return modes_for


EXACT_POLICY = Policy()


def earliest(*points: int | None) -> int | None:
    """The earliest of some token indexes (None: no such point)."""
    found = [p for p in points if p is not None]
    return min(found) if found else None


def is_exact_chunk(chunk_end: int, approx_from: int | None) -> bool:
    """A chunk's KV is exact when nothing before its end is approximate."""
    return approx_from is None or chunk_end <= approx_from
