"""Content-defined cut points for text: the same text cuts the same way wherever it sits.

Fixed-size text chunks only match when a moved text starts a text stretch at the same offset and
its tail is unchanged. Like rsync's and LBFS's chunking of byte streams, a cut is placed where a
rolling hash of the last ``WINDOW`` token ids hits a pattern: it depends on those tokens alone, so
text that recurs behind other text, or followed by other text, produces the same interior chunks
(and the same CIDs). Sizes stay bounded: no cut closer than ``min_len`` to the previous one (this
also keeps each window inside the chunk it ends), a forced cut at ``max_len``.

Pure numpy on the token ids, a few vector operations per prompt: the scheduler chunks every
prompt it admits, so this runs on the engine's critical path.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np

WINDOW = 16
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_P = np.uint64(0x100000001B3)  # FNV prime: the window's positional multiplier


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, elementwise (uint64 arithmetic wraps)."""
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


def window_hashes(token_ids: Sequence[int] | np.ndarray, window: int = WINDOW) -> np.ndarray:
    """``h[i]``: a 64-bit hash of ``token_ids[i - window + 1 : i + 1]`` (shorter at the start):
    ``mix(sum_j mix(t[i - j] + GOLDEN) * P**j)`` over the window, mod 2**64."""
    if window < 1:
        raise ValueError(f"window must be at least 1, got {window}")
    tokens = np.asarray(token_ids, dtype=np.int64).astype(np.uint64)
    n = int(tokens.size)
    if n == 0:
        return tokens
    width = min(window, n)
    # P is odd, so invertible mod 2**64: the window sum is P**i times a difference of prefix
    # sums of g[k] * P**-k. A few vector operations per prompt, whatever the window.
    p_pow, q_pow = _powers(n)
    with np.errstate(over="ignore"):
        sums = np.cumsum(_mix(tokens + _GOLDEN) * q_pow, dtype=np.uint64)
        sums[width:] -= sums[:-width].copy()
        return _mix(sums * p_pow)


_P_INV = np.uint64(pow(int(_P), -1, 1 << 64))
_POWERS: list[np.ndarray] = [np.ones((2, 0), dtype=np.uint64)]


def _powers(n: int) -> tuple[np.ndarray, np.ndarray]:
    """``P**k`` and ``P**-k`` mod 2**64 for ``k < n`` (kept, grown by doubling)."""
    table = _POWERS[0]
    if table.shape[1] < n:
        size = max(n, 2 * table.shape[1], 1024)
        table = np.empty((2, size), dtype=np.uint64)
        table[:, 0] = 1
        table[0, 1:] = _P
        table[1, 1:] = _P_INV
        with np.errstate(over="ignore"):
            np.multiply.accumulate(table, axis=1, out=table)
        _POWERS[0] = table
    return table[0, :n], table[1, :n]


def candidate_ends(hashes: np.ndarray, avg_gap: int) -> list[int]:
    """Where a chunk may end: after token ``i`` when ``hashes[i]`` has its low ``log2(avg_gap)``
    bits clear. A list: the walk in ``content_cuts`` bisects it once per cut."""
    mask = np.uint64((1 << max(0, int(avg_gap).bit_length() - 1)) - 1)
    return (np.flatnonzero((hashes & mask) == 0) + 1).tolist()


def content_cuts(
    ends: Sequence[int], start: int, end: int, *, min_len: int, max_len: int
) -> list[int]:
    """Chunk ends in ``(start, end]`` for the text ``[start, end)``, the last one ``end``.

    ``ends`` (sorted, from ``candidate_ends``) may hold ends of the whole prompt: a chunk ends at
    the first one at least ``min_len`` past the previous end, or at ``max_len``.
    """
    if min_len < 1 or max_len < min_len:
        raise ValueError(f"need 1 <= min_len <= max_len, got {min_len}, {max_len}")
    cuts: list[int] = []
    pos = start
    k = 0
    while pos < end:
        k = bisect.bisect_left(ends, pos + min_len, k)
        limit = min(pos + max_len, end)
        cut = ends[k] if k < len(ends) and ends[k] <= limit else limit
        cuts.append(cut)
        pos = cut
    return cuts
