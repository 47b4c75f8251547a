"""A prompt's chunk keys in one native call: every chunk's cid, every prefix's antecedent hash and
every chunk's exact entry key.

The definition is ``store/keys.py``'s (``prompt_cids``, ``antecedent_hashes``,
``conditioned_key``), which ``chunk_keys_ref`` calls; ``chunk_keys`` computes the same strings with
``kernels/csrc/keys.cpp`` (xxHash's own C, the library Python's ``xxhash`` wraps). The scheduler
keys every prompt it admits, right after the engine sat idle: there Python's two hashes a chunk (a
join and an ``xxhash`` call each, then a slice of the joined cids) cost several microseconds each
on cold caches, and a prompt has tens of chunks; the planner, the save path and the awaited-saves
check each name every chunk's exact entry (a cached call a chunk, several microseconds each there
too). Without the native library (no compiler) or on a big-endian machine (the op hashes the
tokens' bytes as they lie in memory) the reference runs instead. ``layout_keys`` lays the prompt
out too (``chunking.chunk_prompt``).
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

from orbitkv.kernels import native
from orbitkv.store.keys import (
    CONDITIONED_KEY_HEAD,
    VERSION_FIELD,
    antecedent_hashes,
    cid_prefix_bytes,
    conditioned_key,
    prompt_cids,
    token_array,
)

from .cdc import walk_params

# (start, end, item hash or None for text): one chunk of the prompt, as ``keys.prompt_cids`` takes.
Run = tuple[int, int, "str | None"]
_IS_LITTLE_ENDIAN = sys.byteorder == "little"
_KEY_HEAD = CONDITIONED_KEY_HEAD.encode("ascii")


def chunk_keys(
    model_fingerprint: str, layout: str, tenant: str, token_ids: array | Sequence[int],
    runs: Sequence[Run], *, cache_salt: str = "", lora: str = "",
) -> tuple[list[str], list[str], list[str]]:
    """``(cids, antecedents, exact_keys)``: ``keys.prompt_cids`` of the runs (the same arguments),
    ``antecedents[i]``, the antecedent hash of ``cids[:i]`` for ``i`` in ``0..len(runs)``, and
    ``exact_keys[i]``, ``keys.conditioned_key(cids[i], antecedents[i])``. ``token_ids``: ideally
    ``chunking.prompt_tokens``' ``array('q')``. A run outside the prompt raises ``ValueError``, as
    the reference does."""
    lib = native.library()
    if lib is None or not _IS_LITTLE_ENDIAN:
        return chunk_keys_ref(model_fingerprint, layout, tenant, token_ids, runs,
                              cache_salt=cache_salt, lora=lora)
    if type(token_ids) is not array or token_ids.typecode != "q":
        token_ids = array("q", token_array(token_ids).tolist())
    prefix = cid_prefix_bytes(model_fingerprint, layout, tenant, cache_salt, lora)
    objects = getattr(lib, "chunk_keys", None)
    if objects is not None:  # the extension module: the runs read in C (module doc)
        try:
            return objects(token_ids, runs, prefix, VERSION_FIELD, _KEY_HEAD)
        except ValueError:
            raise ValueError(_bad_run(runs, len(token_ids))) from None
    num_runs = len(runs)
    spec = array("q", bytes(32 * num_runs))
    items = bytearray()
    for r, (start, end, item) in enumerate(runs):
        spec[4 * r] = start
        spec[4 * r + 1] = end
        if item is None:
            spec[4 * r + 3] = -1
        else:
            raw = item.encode("utf-8")
            spec[4 * r + 2] = len(items)
            spec[4 * r + 3] = len(raw)
            items += raw
    out = bytearray(33 * (2 * num_runs + 1) - 1)
    rc = lib.orbitkv_chunk_keys(
        token_ids, len(token_ids), spec, num_runs, prefix, len(prefix), bytes(items), len(items),
        VERSION_FIELD, len(VERSION_FIELD), out,
    )
    if rc != 0:
        raise ValueError(_bad_run(runs, len(token_ids)))
    keys = out.decode("ascii").split("\n")  # one call, not a slice a key
    cids, antecedents = keys[:num_runs], keys[num_runs:]
    return cids, antecedents, _exact_keys(cids, antecedents)


def layout_keys(
    model_fingerprint: str, layout: str, tenant: str, tokens: array | list[int],
    items: Sequence[tuple[int, int, str]], boundaries: Sequence[int], *, anchor_len: int,
    chunk_size: int, is_content: bool, line_end_table: bytes, cache_salt: str = "", lora: str = "",
) -> tuple[list[tuple[int, int, int]], list[str], list[str], list[str]] | None:
    """A prompt's layout and keys in one native call (``csrc/layout.cpp``): ``(spans, cids,
    antecedents, exact_keys)``, ``spans`` each chunk's ``(start, length, kind)`` as
    ``chunking.split_spans`` cuts them (kind -2: the anchor, -1: text, i: ``items[i]``, an item's
    ``(offset, length, name)``), the keys ``chunk_keys``' of those chunks. None where the call
    cannot run (no extension module, a big-endian machine) or refuses the prompt: the caller
    takes the Python path, which says why."""
    lay_out = getattr(native.library(), "chunk_prompt", None)
    if lay_out is None or not _IS_LITTLE_ENDIAN or chunk_size <= 0:
        return None
    min_len = max(1, chunk_size // 4)  # as chunking's cuts
    window, mask = walk_params(min_len)
    try:
        return lay_out(
            tokens, items, boundaries, anchor_len, chunk_size, int(is_content), line_end_table,
            window, min_len, mask,
            cid_prefix_bytes(model_fingerprint, layout, tenant, cache_salt, lora),
            VERSION_FIELD, _KEY_HEAD,
        )
    except (ValueError, TypeError, OverflowError):
        return None


def chunk_keys_ref(
    model_fingerprint: str, layout: str, tenant: str, token_ids: array | Sequence[int],
    runs: Sequence[Run], *, cache_salt: str = "", lora: str = "",
) -> tuple[list[str], list[str], list[str]]:
    """``chunk_keys`` by the definition (``store/keys.py``), from the same arguments."""
    cids = prompt_cids(model_fingerprint, layout, tenant, token_ids, runs, cache_salt=cache_salt,
                       lora=lora)
    antecedents = antecedent_hashes(cids)
    return cids, antecedents, _exact_keys(cids, antecedents)


def _exact_keys(cids: Sequence[str], antecedents: Sequence[str]) -> list[str]:
    """Each chunk's exact entry key, by the key scheme (the module's C names them itself)."""
    return [conditioned_key(c, antecedents[i]) for i, c in enumerate(cids)]


def _bad_run(runs: Sequence[Run], num_tokens: int) -> str:
    start, end = next((s, e) for s, e, _ in runs if not 0 <= s < e <= num_tokens)
    return f"bad chunk [{start}, {end}) for {num_tokens} tokens"  # as keys.prompt_cids says
