"""A replica's score for a request, as every ranking of ``orbitkv route`` returns it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Score:
    replica: str
    # The tokens of the request its tiers save, each weighted by its tier (``scorer.TIER_WEIGHTS``).
    score: float
    num_tokens_by_medium: dict[str, int]
