"""A prompt's chunk keys in one native call: every chunk's cid and every prefix's antecedent hash.

The definition is ``store/keys.py``'s (``prompt_cids``, ``antecedent_hashes``), which
``chunk_keys_ref`` calls; ``chunk_keys`` computes the same strings with ``kernels/csrc/keys.cpp``
(xxHash's own C, the library Python's ``xxhash`` wraps). The scheduler keys every prompt it admits,
right after the engine sat idle: there Python's two hashes a chunk (a join and an ``xxhash`` call
each, then a slice of the joined cids) cost several microseconds each on cold caches, and a prompt
has tens of chunks. Without the native library (no compiler) or on a big-endian machine (the op
hashes the tokens' bytes as they lie in memory) the reference runs instead.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

from orbitkv.kernels import native
from orbitkv.store.keys import (
    VERSION_FIELD,
    antecedent_hashes,
    cid_prefix_bytes,
    prompt_cids,
    token_array,
)

# (start, end, item hash or None for text): one chunk of the prompt, as ``keys.prompt_cids`` takes.
Run = tuple[int, int, "str | None"]
_IS_LITTLE_ENDIAN = sys.byteorder == "little"


def chunk_keys(
    model_fingerprint: str, layout: str, tenant: str, token_ids: array | Sequence[int],
    runs: Sequence[Run], *, cache_salt: str = "", lora: str = "",
) -> tuple[list[str], list[str]]:
    """``(cids, antecedents)``: ``keys.prompt_cids`` of the runs (the same arguments) and
    ``antecedents[i]``, the antecedent hash of ``cids[:i]`` for ``i`` in ``0..len(runs)``.
    ``token_ids``: ideally ``chunking.prompt_tokens``' ``array('q')``. A run outside the prompt
    raises ``ValueError``, as the reference does."""
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
            return objects(token_ids, runs, prefix, VERSION_FIELD)
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
    return keys[:num_runs], keys[num_runs:]


def chunk_keys_ref(
    model_fingerprint: str, layout: str, tenant: str, token_ids: array | Sequence[int],
    runs: Sequence[Run], *, cache_salt: str = "", lora: str = "",
) -> tuple[list[str], list[str]]:
    """``chunk_keys`` by the definition (``store/keys.py``), from the same arguments."""
    cids = prompt_cids(model_fingerprint, layout, tenant, token_ids, runs, cache_salt=cache_salt,
                       lora=lora)
    return cids, antecedent_hashes(cids)


def _bad_run(runs: Sequence[Run], num_tokens: int) -> str:
    start, end = next((s, e) for s, e, _ in runs if not 0 <= s < e <= num_tokens)
    return f"bad chunk [{start}, {end}) for {num_tokens} tokens"  # as keys.prompt_cids says
