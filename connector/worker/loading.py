"""What a step loads, and whether it may: staged entries, their checks, short loads batched.

The worker half (``half.py``) fetches a step's entries and loads them layer by layer; this module
holds the data it stages and the pure parts: an entry (or a patch) is loaded only when it fits the
model, the load and its key, and the short unpatched loads of a step share one fused call per layer.
"""

from __future__ import annotations

import functools
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from orbitkv.kernels.paged import PagedLayout, load_chunk, load_many
from orbitkv.kernels.paged_stacked import (
    CacheGroup,
    StackedRows,
    cache_group,
    load_stacked_rows,
    stacked_rows,
)

from ..identity import ModelIdentity
from ..metadata import LoadSpec

if TYPE_CHECKING:
    from orbitkv.store.entry import Entry

# Loads up to this long (and without a patch) share one fused call per layer (small_batch).
SMALL_LOAD_TOKENS = 256


@dataclass(slots=True)
class Staged:
    spec: LoadSpec
    entry: Any
    patch: Any
    delta: int
    # The slots as a tensor on ``device`` (``slots_of``): made when a path needs one; the one
    # native call for every layer reads the scheduler's array as it came.
    slots: torch.Tensor | None
    # The slots' host-side checks ran at the first layer loaded; later layers skip them.
    is_checked: bool = False
    device: torch.device | None = None


def slots_of(st: Staged) -> torch.Tensor:
    """The load's slot tensor, made on first use."""
    if st.slots is None:
        st.slots = slot_tensor(st.spec.slots, st.device or torch.device("cpu"))
    return st.slots


def slot_tensor(slots: Sequence[int], device: torch.device) -> torch.Tensor:
    """A slot mapping as an int64 tensor on ``device``. An ``array('q')`` (what the scheduler
    ships, ``metadata.slots_for``) is taken as is, sharing its bytes; other sequences go through
    one: ``torch.tensor`` of a list of ints costs about three times as much, and ``np.asarray``
    about 1.4 times on the cold caches a step starts on (11 loads' slots: 200 against 280 us)."""
    if len(slots) == 0:
        return torch.empty(0, dtype=torch.int64, device=device)
    if not (isinstance(slots, array) and slots.typecode == "q"):
        slots = array("q", slots)
    host = torch.frombuffer(slots, dtype=torch.int64)
    return host if device.type == "cpu" else host.to(device)


@dataclass(slots=True)
class Batch:
    """Short unpatched loads of one step."""

    members: list[Staged]
    slots: torch.Tensor | None
    delta: int | torch.Tensor
    is_checked: bool = False



def check_entry(
    spec: LoadSpec, entry: Entry | None, patch: Entry | None, ident: ModelIdentity
) -> str | None:
    """Why this stored entry (and patch) must not be loaded for ``spec``, or None."""
    if entry is None:
        return "missing"
    meta = entry.meta
    if meta.num_tokens < spec.offset + len(spec.slots):
        return f"entry has {meta.num_tokens} tokens, need {spec.offset + len(spec.slots)}"
    if meta.num_layers != ident.num_layers:
        return f"entry has {meta.num_layers} layers, model {ident.num_layers}"
    if meta.rope_hash != ident.rope_hash:
        return "stored with another RoPE"
    if spec.position != meta.start_pos and ident.rope is None:
        return "moving a chunk needs the model's RoPE spec"
    memo = entry.memo
    if memo is None:
        problem = _tensors_problem(entry, ident)
    else:
        # A memory-tier buffer's tensors never change: checked at its first load for this
        # model, not at every step that loads it (about 50 us an entry on a step's cold caches).
        shape_key = (ident.num_layers, ident.num_kv_heads, ident.head_dim, ident.is_mla,
                     ident.cache_dtype)
        problem = memo.get(shape_key, _UNCHECKED)
        if problem is _UNCHECKED:
            problem = memo[shape_key] = _tensors_problem(entry, ident)
    if problem:
        return problem
    if spec.patch_key:
        return patch_problem(spec, patch, ident, entry)
    return None


def _tensors_problem(entry: Entry, ident: ModelIdentity) -> str | None:
    """Why the entry's tensors do not fit this model's cache, or None. Every tensor is checked
    before any is touched: an entry is untrusted bytes (another replica, a forger), and a shape
    the load kernels do not expect must be a miss, not an exception in the forward pass."""
    num_tokens = entry.meta.num_tokens
    shape = (num_tokens, ident.head_dim) if ident.is_mla else (
        num_tokens, ident.num_kv_heads, ident.head_dim
    )
    wanted = _tensor_names(ident.num_layers, ident.is_mla)
    tensors = entry.tensors
    if tensors.keys() != wanted:
        return f"entry has tensors {sorted(set(tensors) ^ wanted)[:4]} the model does not"
    dtype = ident.cache_dtype
    # Decode's stacks (``store/entry_stacks.py``) are the tensors: one check a side.
    stacks = [entry.stacks.get(side) for side in _SIDES[ident.is_mla]]
    if all(s is not None and s.dtype == dtype and s.shape[1:] == shape for s in stacks):
        return None
    # One pass over the tensors; the one at fault is named only when there is one.
    if all(t.dtype == dtype and t.shape == shape for t in tensors.values()):
        return None
    for name in sorted(wanted):
        t = tensors[name]
        if t.dtype != dtype:
            return f"tensor {name} is {t.dtype}, the cache {dtype}"
        if tuple(t.shape) != shape:
            return f"tensor {name} has shape {tuple(t.shape)}, the model needs {shape}"
    return None


_SIDES = {False: ("k", "v"), True: ("kv",)}
_UNCHECKED = object()


@functools.lru_cache(maxsize=8)
def _tensor_names(num_layers: int, is_mla: bool) -> frozenset[str]:
    """The tensors an entry of this model holds (``k.<layer>``, ``v.<layer>``; MLA ``kv.<layer>``)."""
    return frozenset(f"{n}.{li}" for li in range(num_layers) for n in _SIDES[is_mla])


def patch_problem(
    spec: LoadSpec, patch: Entry, ident: ModelIdentity, canonical: Entry
) -> str | None:
    """Why this patch must not be applied to this load, or None. A patch is only ever applied to
    the canonical it was formed against (by content), for the antecedent (or orbit) and rank its
    key names, this model, RoPE and shape."""
    from orbitkv.store.keys import EntryKey

    if patch is None:
        return "patch missing"
    meta = patch.meta
    if not meta.canonical_checksum or meta.canonical_checksum != canonical.meta.checksum:
        return "patch formed against another canonical"
    want = EntryKey.parse(spec.patch_key)
    if meta.kind != "patch" or meta.antecedent_hash != want.antecedent or meta.rank != want.rank:
        return "patch of another antecedent, orbit or rank"
    if meta.rope_hash != ident.rope_hash:
        return "patch formed under another RoPE"
    if meta.num_tokens < spec.offset + len(spec.slots):
        return "patch too short"
    features = ident.head_dim if ident.is_mla else ident.num_kv_heads * ident.head_dim
    sides = ("k",) if ident.is_mla else ("k", "v")
    layers: set[str] = set()
    for name, u in patch.tensors.items():
        prefix, _, layer = name.partition(".")
        if not layer.isdigit() or int(layer) >= ident.num_layers or prefix[1:] not in sides:
            return f"patch tensor {name} does not fit the model"
        if not u.is_floating_point():
            return f"patch tensor {name} is {u.dtype}"
        layers.add(layer)
        if prefix[0] != "u":
            continue
        w = patch.tensors.get(f"w{prefix[1:]}.{layer}")
        # A factorisation's rank is at most the key's (a short chunk has fewer singular values).
        rank = u.shape[1] if u.dim() == 2 else -1
        if (
            w is None
            or not 0 <= rank <= meta.rank
            or tuple(u.shape) != (meta.num_tokens, rank)
            or tuple(w.shape) != (rank, features)
        ):
            got = (tuple(u.shape), None if w is None else tuple(w.shape))
            return f"patch factors {name} {got} do not fit [{meta.num_tokens}, m] x [m, {features}]"
    # A patched layer has both factors of every side (the worker reads them all).
    for layer in layers:
        if any(f"{f}{side}.{layer}" not in patch.tensors for f in "uw" for side in sides):
            return f"patch layer {layer} lacks a factor"
    return None


def small_batch(staged: list[Staged], max_tokens: int | None = SMALL_LOAD_TOKENS) -> Batch:
    """The step's short unpatched loads, as one load per layer (``members`` empty: nothing to
    batch).

    Text lines and small images make many short chunks; one fused call per chunk and layer
    costs more in dispatch than in bytes, so they go together: their slots and per-token
    shifts concatenated once, their K/V rows per layer. ``max_tokens``: longer loads go alone
    (None: every unpatched load joins; for a layout whose writer gains nothing from whole
    blocks)."""
    members = [
        st for st in staged
        if st.patch is None and (max_tokens is None or len(st.spec.slots) <= max_tokens)
    ]
    if len(members) < 2:
        return Batch([], None, 0)
    slots = torch.cat([slots_of(st) for st in members])
    deltas = [st.delta for st in members]
    if len(set(deltas)) == 1:
        delta: int | torch.Tensor = deltas[0]
    else:
        delta = torch.cat(
            [torch.full((len(st.spec.slots),), st.delta, dtype=torch.int64) for st in members]
        )
    return Batch(members, slots, delta)


def load_one(
    st: Staged, li: int, cache: torch.Tensor, layout: PagedLayout, ident: ModelIdentity
) -> None:
    """Layer ``li`` of one staged load (with its patch's layer, where it has one) into ``cache``."""
    lo, hi = st.spec.offset, st.spec.offset + len(st.spec.slots)
    t = st.entry.tensors
    k = t[f"kv.{li}"] if ident.is_mla else t[f"k.{li}"]
    v = None if ident.is_mla else t[f"v.{li}"]
    patch_k = patch_v = None
    if st.patch is not None and f"uk.{li}" in st.patch.tensors:
        # A patch may skip shallow layers (patch_first_layer_fraction): those load as is.
        p = st.patch.tensors
        dev = cache.device
        # Factors may be stored narrower (patch_dtype): the product is formed in fp32.
        f32 = torch.float32
        patch_k = (p[f"uk.{li}"][lo:hi].to(dev, f32), p[f"wk.{li}"].to(dev, f32))
        if not ident.is_mla:
            patch_v = (p[f"uv.{li}"][lo:hi].to(dev, f32), p[f"wv.{li}"].to(dev, f32))
    load_chunk(
        cache, slots_of(st), layout, k[lo:hi].to(cache.device),
        None if v is None else v[lo:hi].to(cache.device),
        spec=ident.rope, delta=st.delta, patch_k=patch_k, patch_v=patch_v,
        check_slots=not st.is_checked,
    )
    st.is_checked = True


def load_batch(
    batch: Batch, li: int, cache: torch.Tensor, layout: PagedLayout, ident: ModelIdentity
) -> None:
    """Layer ``li`` of a batch of short unpatched loads (``small_batch``) in one call."""
    ranges = [(st, st.spec.offset, st.spec.offset + len(st.spec.slots)) for st in batch.members]
    name = "kv" if ident.is_mla else "k"
    k = torch.cat([st.entry.tensors[f"{name}.{li}"][lo:hi] for st, lo, hi in ranges])
    v = None
    if not ident.is_mla:
        v = torch.cat([st.entry.tensors[f"v.{li}"][lo:hi] for st, lo, hi in ranges])
    load_chunk(
        cache, batch.slots, layout, k.to(cache.device), None if v is None else v.to(cache.device),
        spec=ident.rope, delta=batch.delta, check_slots=not batch.is_checked,
    )
    batch.is_checked = True


def load_jobs(
    staged: list[Staged], caches: dict[str, torch.Tensor], layer_index: dict[str, int]
) -> tuple[list, list, list, list, list]:
    """``load_many``'s arguments for every layer of these unpatched loads: per (layer, load), the
    layer's cache, the load's slots, its K and V rows of that layer, its shift."""
    jobs: tuple[list, list, list, list, list] = ([], [], [], [], [])
    cache_of, slot_list, k_of, v_of, delta_of = jobs
    for name, cache in caches.items():
        li = layer_index.get(name)
        if li is None:
            continue
        for st in staged:
            lo, hi = st.spec.offset, st.spec.offset + len(st.spec.slots)
            k, v = st.entry.tensors[f"k.{li}"], st.entry.tensors[f"v.{li}"]
            if lo or hi != k.shape[0]:
                k, v = k[lo:hi], v[lo:hi]
            cache_of.append(cache)
            slot_list.append(slots_of(st))
            k_of.append(k)
            v_of.append(v)
            delta_of.append(st.delta)
    return jobs


def load_unpatched(
    staged: list[Staged], caches: dict[str, torch.Tensor], layer_index: dict[str, int],
    layer_caches: CacheGroup | list[torch.Tensor] | None, layout: PagedLayout,
    ident: ModelIdentity,
) -> bool:
    """Every layer of these unpatched loads in one native call: ``load_stacked_rows`` where each
    load's layers are one view (its rows checked once an entry, ``entry_rows``), else
    ``load_many`` (once a layer and load). False where the op cannot take them.
    ``layer_caches``: the caches in layer order, best as the worker's ``CacheGroup`` (checked
    once)."""
    if layer_caches:
        group = layer_caches if isinstance(layer_caches, CacheGroup) else cache_group(
            layer_caches, layout)
        rows = [entry_rows(st, group, ident.num_layers) for st in staged]
        if all(rows):  # None where the group's caches take no native call, too
            slots = [st.spec.slots if _is_slot_array(st.spec.slots) else slots_of(st)
                     for st in staged]
            return load_stacked_rows(group, rows, slots, spec=ident.rope,
                                     deltas=[st.delta for st in staged])
    caches_of, slots, ks, vs, deltas = load_jobs(staged, caches, layer_index)
    return load_many(caches_of, layout, slots, ks, vs, spec=ident.rope, deltas=deltas)


def entry_rows(st: Staged, group: CacheGroup, num_layers: int) -> StackedRows | None:
    """The load's rows of every layer as ``load_stacked_rows`` takes them (None where the entry's
    layers are no one view a side, ``layer_stacks``). A whole memory-tier entry's are checked at
    its first load and kept in its memo (its buffer never changes), not checked every step."""
    memo = st.entry.memo
    is_whole = st.spec.offset == 0 and st.entry.meta.num_tokens == len(st.spec.slots)
    key = None
    if memo is not None and is_whole and group.views is not None:
        views = group.views
        key = ("stacked_rows", len(group.caches), group.caches[0].dtype, views.num_kv_heads,
               views.head_dim)
        found = memo.get(key)
        if found is not None:
            return found
    stacks = layer_stacks(st, num_layers)
    if stacks is None or group.views is None:
        return None
    rows = stacked_rows(group, *stacks)
    if key is not None:
        memo[key] = rows
    return rows


def _is_slot_array(slots: Any) -> bool:
    return isinstance(slots, array) and slots.typecode == "q"


def caches_by_layer(
    caches: dict[str, torch.Tensor], layer_index: dict[str, int], num_layers: int
) -> list[torch.Tensor] | None:
    """The caches in layer order, where they are the model's layers 0 .. num_layers - 1 once
    each (``load_stacked``'s caches); None otherwise (loads then go job by job)."""
    by_layer: dict[int, torch.Tensor] = {}
    for name, cache in caches.items():
        li = layer_index.get(name)
        if li is None or li in by_layer:
            return None
        by_layer[li] = cache
    if sorted(by_layer) != list(range(num_layers)):
        return None
    return [by_layer[li] for li in range(num_layers)]


def layer_stacks(
    st: Staged, num_layers: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A staged entry's loaded rows of every layer as two ``[num_layers, n, H, D]`` views (K, V),
    from the stacks decode found (``store/entry_stacks.py``: each side's tensors one run, layer
    ``i`` the entry's own ``k.i`` / ``v.i``); None where a side has none."""
    k, v = st.entry.stacks.get("k"), st.entry.stacks.get("v")
    if k is None or v is None or k.shape[0] != num_layers or v.shape[0] != num_layers:
        return None
    lo, hi = st.spec.offset, st.spec.offset + len(st.spec.slots)
    if lo == 0 and hi == k.shape[1]:
        return k, v
    return k[:, lo:hi], v[:, lo:hi]
