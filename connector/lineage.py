"""Lineage: is a request's KV what a full prefill computes (*exact*), or approximate under a policy?

A request's *policy* is the approximate KV it accepts: the approximate reuse modes it allows
(survivor, transfer, patched, orbit, blind), the patch rank they are served at and the modalities
blind is narrowed to. Two requests share approximate KV only under the same policy (the same tag); a
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

from .planner import APPROXIMATE_MODES, BLIND, PATCH_MODES, TRANSFER

EXACT_LINEAGE = ""


@dataclass(frozen=True, slots=True)
class Policy:
    """The approximate KV a request accepts. ``modes`` holds approximate modes only."""

    modes: frozenset[str] = frozenset()
    patch_rank: int = 0
    # Modalities blind reuse is narrowed to ("*": every chunk); empty when blind is off.
    blind_modalities: tuple[str, ...] = ()
    # The same for transfer.
    transfer_modalities: tuple[str, ...] = ()

    @classmethod
    def of(
        cls,
        modes: frozenset[str],
        patch_rank: int,
        blind_modalities: tuple[str, ...],
        transfer_modalities: tuple[str, ...] = ("*",),
    ) -> Policy:
        """The policy of a request allowed ``modes`` (exact ones included, ignored here)."""
        approx = frozenset(modes) & APPROXIMATE_MODES
        return cls(
            modes=approx,
            patch_rank=patch_rank if approx & PATCH_MODES else 0,
            blind_modalities=tuple(sorted(blind_modalities)) if BLIND in approx else (),
            transfer_modalities=tuple(sorted(transfer_modalities)) if TRANSFER in approx else (),
        )

    @property
    def is_exact(self) -> bool:
        return not self.modes

    @property
    def tag(self) -> str:
        """32 hex chars naming the policy ("" when exact): part of approximate keys and hashes."""
        if self.is_exact:
            return EXACT_LINEAGE
        h = xxhash.xxh3_128()
        for part in ("orbitkv-policy-v1", *sorted(self.modes), str(self.patch_rank),
                     *self.blind_modalities):  # fmt: skip
            h.update(part.encode())
            h.update(b"\x00")
        # Only a policy with transfer names its scope, so earlier policies keep their tags.
        for part in (f"transfer:{m}" for m in self.transfer_modalities):
            h.update(part.encode())
            h.update(b"\x00")
        return h.hexdigest()


EXACT_POLICY = Policy()


def first_approximate(begins_and_modes) -> int | None:
    """The first token served approximately, given ``(begin, mode)`` pairs; None if none is."""
    return min((begin for begin, mode in begins_and_modes if mode in APPROXIMATE_MODES), default=None)


def earliest(*points: int | None) -> int | None:
    """The earliest of some token indexes (None: no such point)."""
    found = [p for p in points if p is not None]
    return min(found) if found else None


def is_exact_chunk(chunk_end: int, approx_from: int | None) -> bool:
    """A chunk's KV is exact when nothing before its end is approximate."""
    return approx_from is None or chunk_end <= approx_from
