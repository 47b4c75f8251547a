"""Which stored antecedents of a chunk can serve it behind the current one, relocated.

The store keeps, per chunk id, the antecedents it holds conditioned entries for
(``store/antecedents.py``). Two relations to the current antecedent make such an entry usable,
both approximate:

- *survivor*: the stored antecedent is the current one with chunks inserted (chunks have been
  removed since: a window slid); the entry still carries their influence, which the paper finds
  near-lossless (KL 0.015 on GQA);
- *transfer*: any other stored antecedent that shares chunks with the current one, in order
  (a window rotated, an image came back behind a new window): the entry lacks the influence of
  the chunks inserted since and keeps that of the chunks removed since; the closest one serves.

A third relation serves the *orbit* mode: the stored antecedent is another ordering of the current
one's chunks (a reordered set). Its own patch is the orbit patch of a set seen in one order
(``reordering_candidates``); an orbit entry is stored only once two orderings are averaged.

``orbitkv check window``'s ``relocate`` arm (the entry from the window the item was last computed
in) measures both.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

# A chunk reachable from many stored antecedents is checked against the few closest ones only.
MAX_SURVIVOR_CANDIDATES = 4


def is_subsequence(short: Sequence[str], long: Sequence[str]) -> bool:
    """True when ``short`` is ``long`` with some elements removed, order kept."""
    it = iter(long)
    return all(any(x == y for y in it) for x in short)


def survivor_candidates(
    current: tuple[str, ...], stored: Sequence[tuple[str, ...]]
) -> list[tuple[str, ...]]:
    """Stored antecedents that reduce to ``current``, fewest removed chunks first.

    Fewer removed chunks means less context lost, so the relocated entry is closer to exact.
    The sort is total (length, then the cids) so the choice does not depend on store order.
    """
    found = {tuple(s) for s in stored if len(s) > len(current) and is_subsequence(current, s)}
    return sorted(found, key=lambda s: (len(s), s))[:MAX_SURVIVOR_CANDIDATES]


def common_length(a: Sequence[str], b: Sequence[str]) -> int:
    """Length of the longest common subsequence of ``a`` and ``b`` (Hunt-Szymanski: a longest
    increasing run of ``b``'s positions over ``a``; near-linear for antecedents, whose chunks
    rarely repeat)."""
    where: dict[str, list[int]] = {}
    for j, x in enumerate(b):
        where.setdefault(x, []).append(j)
    tails: list[int] = []
    for x in a:
        for j in reversed(where.get(x, ())):
            k = bisect.bisect_left(tails, j)
            if k == len(tails):
                tails.append(j)
            else:
                tails[k] = j
    return len(tails)


def transfer_candidates(
    current: tuple[str, ...], stored: Sequence[tuple[str, ...]]
) -> list[tuple[str, ...]]:
    """Stored antecedents that share chunks with ``current`` (in order) but do not reduce to it,
    fewest chunks inserted or removed first, then most chunks shared.

    A rotated window (``[a, b, c] -> [c, a, b]``) puts ``a`` and ``b`` behind ``c``, where they
    were never computed; their entries behind ``(sys)`` and ``(sys, a)`` transfer, lacking only
    ``c``'s influence. An image back behind a new window transfers from the window it was
    computed in. An antecedent sharing nothing is left out: that entry is as far from this
    context as the blind canonical, its own mode.
    """
    scored = []
    for s in {tuple(s) for s in stored}:
        if s == current or (len(s) > len(current) and is_subsequence(current, s)):
            continue  # the exact entry; a survivor
        num_common = common_length(s, current)
        if num_common:
            num_edits = len(s) + len(current) - 2 * num_common
            scored.append((num_edits, -num_common, s))
    return [s for *_, s in sorted(scored)[:MAX_SURVIVOR_CANDIDATES]]


def reordering_candidates(
    current: tuple[str, ...], stored: Sequence[tuple[str, ...]]
) -> list[tuple[str, ...]]:
    """Stored antecedents that are other orderings of ``current``'s chunks (the same multiset),
    in a fixed order."""
    want = sorted(current)
    found = {tuple(s) for s in stored if len(s) == len(current) and tuple(s) != tuple(current)}
    return sorted(s for s in found if sorted(s) == want)[:MAX_SURVIVOR_CANDIDATES]
