"""Content-defined cut points for text: the same text cuts the same way wherever it sits.

Fixed-size text chunks only match when a moved text starts a text stretch at the same offset and
its tail is unchanged. Like rsync's and LBFS's chunking of byte streams, a cut is placed where a
rolling hash of the last ``WINDOW`` token ids hits a pattern: it depends on those tokens alone, so
text that recurs behind other text, or followed by other text, produces the same interior chunks
(and the same CIDs). Sizes stay bounded: no cut closer than ``min_len`` to the previous one (this
also keeps each window inside the chunk it ends), a forced cut at ``max_len``.

Pure numpy on the token ids (one vector pass per window position): cheap next to the scheduler's
other work on a prompt.
"""

from __future__ import annotations

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
    """``h[i]``: a 64-bit hash of ``token_ids[i - window + 1 : i + 1]`` (shorter at the start)."""
    tokens = np.asarray(token_ids, dtype=np.int64).astype(np.uint64)
    if tokens.size == 0:
        return tokens
    g = _mix(tokens + _GOLDEN)
    h = np.zeros_like(g)
    weight = np.uint64(1)
    with np.errstate(over="ignore"):
        for j in range(min(window, g.size)):
            h[j:] += g[: g.size - j] * weight
            weight = weight * _P
    return _mix(h)


def content_cuts(
    hashes: np.ndarray, start: int, end: int, *, min_len: int, max_len: int, avg_gap: int
) -> list[int]:
    """Chunk ends in ``(start, end]`` for the text ``[start, end)``, the last one ``end``.

    A chunk ends after token ``i`` when ``hashes[i]`` has its low ``log2(avg_gap)`` bits clear and
    the chunk is at least ``min_len`` long, or when it reaches ``max_len``.
    """
    if min_len < 1 or max_len < min_len:
        raise ValueError(f"need 1 <= min_len <= max_len, got {min_len}, {max_len}")
    mask = np.uint64((1 << max(0, int(avg_gap).bit_length() - 1)) - 1)
    hits = np.flatnonzero((hashes[start:end] & mask) == 0) + start + 1  # candidate chunk ends
    cuts: list[int] = []
    pos = start
    k = 0
    while pos < end:
        k += int(np.searchsorted(hits[k:], pos + min_len))
        limit = min(pos + max_len, end)
        cut = int(hits[k]) if k < hits.size and hits[k] <= limit else limit
        cuts.append(cut)
        pos = cut
    return cuts
