"""Content-defined cut points for text: the same text cuts the same way wherever it sits.

Fixed-size text chunks only match when a moved text starts a text stretch at the same offset and
its tail is unchanged. Like rsync's and LBFS's chunking of byte streams, a cut is placed where a
rolling hash of the last ``WINDOW`` token ids hits a pattern: it depends on those tokens alone, so
text that recurs behind other text, or followed by other text, produces the same interior chunks
(and the same CIDs). Sizes stay bounded: no cut closer than ``min_len`` to the previous one (this
also keeps each window inside the chunk it ends), a forced cut at ``max_len``.

The scheduler chunks every prompt it admits, on the engine's critical path: ``text_cuts`` finds
a prompt's cuts in one native pass (``kernels/csrc/cdc.cpp``), ``text_cuts_ref`` in numpy (the
definition; and the path without a compiler).
"""

from __future__ import annotations

import bisect
from array import array
from collections.abc import Sequence

import numpy as np
from orbitkv.kernels import native

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
    mask = np.uint64(_mask(avg_gap))
    return (np.flatnonzero((hashes & mask) == 0) + 1).tolist()


def text_cuts(
    tokens: np.ndarray | array,
    stretches: Sequence[tuple[int, int]],
    *,
    min_len: int,
    max_len: int,
    line_end_table: np.ndarray | bytes | None = None,
) -> list[int]:
    """A prompt's text cuts, sorted and distinct: in each text stretch ``(start, end)`` the chunk
    ends ``content_cuts`` walks to over the prompt's candidate ends (window ``min(WINDOW,
    min_len)``, average gap ``min_len``), and a cut after every token ``t`` but the last with
    ``line_end_table[t + 1]`` (ids clipped into the table; None: no line ends).

    ``tokens``: 1-D int64, C-contiguous (an ``array('q')`` or a numpy array); ``line_end_table``
    one byte an entry (``bytes``, or a bool or uint8 array). The same list as ``text_cuts_ref``.
    The scheduler's path (an ``array('q')`` and ``bytes``) makes no numpy call: on the cold caches
    it runs on between two forwards, each costs tens of microseconds.
    """
    lib = _library()
    if lib is None:
        return text_cuts_ref(np.asarray(tokens, dtype=np.int64), stretches, min_len=min_len,
                             max_len=max_len, line_end_table=_table_array(line_end_table))
    _check_lengths(min_len, max_len)  # before the kernel, whose -1 could not say which
    if type(tokens) is array:
        assert tokens.typecode == "q", "tokens must be an array('q')"
        address, n = tokens.buffer_info()
    else:
        assert tokens.dtype == np.int64 and tokens.ndim == 1, "tokens must be a 1-D int64 array"
        assert tokens.flags.c_contiguous, "tokens must be C-contiguous"
        address, n = tokens.ctypes.data, int(tokens.size)
    table = _table_bytes(line_end_table)
    window, mask = walk_params(min_len)
    bounds = array("q", [start for start, _ in stretches])
    bounds.extend([end for _, end in stretches])
    cuts = array("q", bytes(8 * (n + 1)))
    num_cuts = lib.orbitkv_cdc_cuts(
        address, bounds.buffer_info()[0] if stretches else None, table, cuts.buffer_info()[0],
        n, len(stretches), window, min_len, max_len, len(table), mask,
    )
    if num_cuts == -2:
        raise MemoryError(f"no memory for the cut marks of a {n}-token prompt")
    if num_cuts < 0:
        raise ValueError(f"text stretches {list(stretches)} do not fit a {n}-token prompt")
    return cuts[:num_cuts].tolist()


def _table_bytes(table: np.ndarray | bytes | None) -> bytes:
    if table is None:
        return b""
    if type(table) is bytes:
        return table
    assert table.dtype.itemsize == 1 and table.ndim == 1, "line_end_table must be 1-D bytes"
    return table.tobytes()


def _table_array(table: np.ndarray | bytes | None) -> np.ndarray | None:
    if table is None or type(table) is not bytes:
        return table
    return np.frombuffer(table, dtype=np.uint8) if table else None


def text_cuts_ref(
    tokens: np.ndarray,
    stretches: Sequence[tuple[int, int]],
    *,
    min_len: int,
    max_len: int,
    line_end_table: np.ndarray | None = None,
) -> list[int]:
    """``text_cuts`` in numpy: the window hashes, the candidate ends and the walk, as defined."""
    _check_lengths(min_len, max_len)  # as text_cuts, before a window of min_len is formed
    n = int(tokens.size)
    if any(not 0 <= start <= end <= n for start, end in stretches):
        raise ValueError(f"text stretches {list(stretches)} do not fit a {n}-token prompt")
    ends = candidate_ends(window_hashes(tokens, window=min(WINDOW, min_len)), avg_gap=min_len)
    cuts: set[int] = set()
    for start, end in stretches:
        cuts.update(content_cuts(ends, start, end, min_len=min_len, max_len=max_len))
    if line_end_table is not None and n > 1:
        is_end = line_end_table.take(tokens[:-1] + 1, mode="clip")
        cuts.update((np.flatnonzero(is_end) + 1).tolist())
    return sorted(cuts)


def _check_lengths(min_len: int, max_len: int) -> None:
    if min_len < 1 or max_len < min_len:
        raise ValueError(f"need 1 <= min_len <= max_len, got {min_len}, {max_len}")


def walk_params(min_len: int) -> tuple[int, int]:
    """The window and the candidate-end mask the native pass walks with for ``min_len``."""
    return min(WINDOW, min_len), _mask(min_len)


def _mask(avg_gap: int) -> int:
    return (1 << max(0, int(avg_gap).bit_length() - 1)) - 1


def _library():
    return native.library()


def prepare() -> bool:
    """Load (or build) the native pass now, at start-up, not during the first request; False:
    ``text_cuts`` takes the numpy path."""
    return _library() is not None


def content_cuts(
    ends: Sequence[int], start: int, end: int, *, min_len: int, max_len: int
) -> list[int]:
    """Chunk ends in ``(start, end]`` for the text ``[start, end)``, the last one ``end``.

    ``ends`` (sorted, from ``candidate_ends``) may hold ends of the whole prompt: a chunk ends at
    the first one at least ``min_len`` past the previous end, or at ``max_len``.
    """
    _check_lengths(min_len, max_len)
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
