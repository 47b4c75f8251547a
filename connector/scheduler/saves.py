"""What the scheduler half asks the worker to save, and what a canonicalize request did.

Every chunk a request computes is saved once it is complete, under its lineage
(``lineage.py``): a chunk whose KV is exact (nothing before its end was approximate) as an exact
conditioned entry, and also as the canonical when it sits right after the anchor and the store has
no canonical yet, with a patch wanted when it has an antecedent; a chunk computed over approximate
KV as a conditioned entry of the request's policy, and nothing else (canonicals and patches are
formed from exact KV only). Chunks loaded from the store, held already under that key, or computed
before this request are skipped, and so is a conditioned entry the admission policy declines
(``save_admission.py``: by default, one not seen computed before nor registered). A canonicalize request (``role: canonicalize``) saves only its
item's canonical, and says what it did.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from orbitkv.store.keys import RequestKeys

from ..chunking import Chunk
from ..metadata import OrbitKVMetadata, SaveSpec, slots_for
from .lineage import is_exact_chunk
from .request_state import ReqState
from .save_admission import SaveAdmission

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from orbitkv.config import OrbitKVConfig

    from .options import RequestOptions
    from .planner import StoreView


def emit_saves(
    state: ReqState, num_done: int, meta: OrbitKVMetadata, config: OrbitKVConfig, block_size: int,
    admission: SaveAdmission,
) -> None:
    """Save every chunk that is complete once this step's tokens are computed."""
    if not state.options.is_save_enabled:
        return
    limit = min(num_done, state.num_prompt_tokens)
    while state.next_save < len(state.chunks) and state.chunks[state.next_save].end <= limit:
        c = state.chunks[state.next_save]
        state.next_save += 1
        if c.index in state.served or c.end <= state.num_local_tokens:
            # Served by OrbitKV up to a whole block past vLLM's own hit: this lineage comes back
            # after vLLM lost it. Not the few tokens between vLLM's last block and a fresh item
            # (a chat template's turn marker): that partial block vLLM's prefix cache never
            # holds, so OrbitKV serves it on every request, lost or not.
            if c.index in state.served and c.end >= state.num_local_tokens + block_size:
                state.is_recurring_lineage = True
            continue
        spec = _save_spec(state, c, config, block_size, admission)
        if spec is not None:
            meta.saves.append(spec)
            state.num_saved_chunks += 1


def _save_spec(
    state: ReqState, c: Chunk, config: OrbitKVConfig, block_size: int, admission: SaveAdmission
) -> SaveSpec | None:
    is_canonicalize = state.options.role == "canonicalize"
    if is_canonicalize and not c.is_canonical_slot:
        return None  # a canonicalize request stores B's canonical only, not its template's tail
    is_exact = is_exact_chunk(c.end, state.approx_from)
    lineage = "" if is_exact else state.options.policy.tag
    if not is_exact and not lineage:
        return None  # cannot happen: approximate KV comes only with a policy; never save it exact
    decision = state.decisions.get(c.index)
    keys: dict[str, str] = {}
    is_stored = decision is not None and (
        decision.has_exact_entry if is_exact else decision.has_inherited_entry
    )
    has_canonical = (decision is not None and decision.has_canonical) or (
        (state.canonicalize or {}).get("status") == "already stored"
    )
    if not is_stored and not is_canonicalize:
        key = c.exact_key if is_exact else state.keys.conditioned(
            c.cid, c.antecedent_hash, is_inherited=True
        )
        # What recurs: this very entry for an exact-only request; the content for one that
        # accepts approximate KV (survivor and transfer serve it behind any antecedent).
        seen_key = key if state.options.policy.is_exact else c.cid
        is_seen = admission.remember(seen_key)
        # Past vLLM's hit by a whole block, as for a served chunk (``emit_saves``): a short chunk
        # in the partial block after it (a turn marker) is computed again on every request.
        past_hit = state.num_local_tokens
        if is_seen and c.start >= past_hit and c.end >= past_hit + block_size:
            state.is_recurring_lineage = True
        is_tail = c.end >= state.num_prompt_tokens
        if admission.admit(is_seen or has_canonical or (state.is_recurring_lineage and not is_tail)):
            keys["conditioned"] = key
        else:
            state.num_declined_saves += 1
    if (
        c.is_canonical_slot
        and is_exact
        and not has_canonical
        and (config.save_canonical or is_canonicalize)
    ):
        # The canonical slot's antecedent is the anchor: its context is the request's.
        keys["canonical"] = state.keys.canonical(c.cid)
    if not keys:
        return None
    return SaveSpec(
        req_id=state.req_id,
        cid=c.cid,
        start=c.start,
        slots=slots_for(state.block_ids, block_size, c.start, c.end),
        antecedent=c.antecedent,
        antecedent_hash=c.antecedent_hash,
        keys=keys,
        # A server that serves exact KV only never reads a patch: none is formed for it.
        is_patch_wanted=(
            config.is_forming_patches
            and is_exact and "conditioned" in keys
            and not c.is_anchor and not c.is_canonical_slot
        ),
        start_pos=state.positions[c.index],
        lineage=lineage,
        canonical_key=state.keys.canonical(c.cid),
    )


def check_canonicalize(
    request: Request, chunks: list[Chunk], anchor_ids: Sequence[int], view: StoreView,
    keys: RequestKeys,
) -> dict[str, Any]:
    """A canonicalize request must be ``[anchor . B]`` (B: one item or text chunk; the
    template's tail after it is allowed). Its answer says what it did, or why not."""
    anchor = list(anchor_ids)
    if len(chunks) < 2 or not chunks[0].is_anchor or not chunks[1].is_canonical_slot:
        head = list(request.prompt_token_ids or ())[: max(len(anchor), 1) + 4]
        return {
            "status": "error",
            "error": (
                f"canonicalize: the prompt must be the anchor then one item; configured "
                f"anchor_tokens={anchor}, the prompt starts {head}"
            ),
        }
    b = chunks[1]
    stored = view.lookup([keys.canonical(b.cid)])[0] is not None
    return {"status": "already stored" if stored else "formed", "cid": b.cid,
            "modality": b.modality, "num_tokens": b.length}


def awaited_saves(
    opts: RequestOptions, keys: RequestKeys, chunks: Sequence[Chunk], num_local_tokens: int,
    num_tokens: int,
) -> list[str]:
    """What a waiting request should wait for while saves are in flight (``SaveWriter`` tracks
    each save by its cid and by the keys it writes): nothing for the chunks vLLM's prefix cache
    already holds, nor for a chunk at the prompt's last token (neither is ever loaded); for an
    exact-only request, only an exact entry of the chunk in this very context, since a save of the
    same content behind other chunks cannot serve it (waiting for one held every step after a
    computed step in the queue, 40-60 ms on the bench); for a request that accepts approximate KV,
    any save of the chunk's content."""
    if not opts.is_load_enabled:
        return []
    beyond = [c for c in chunks if c.end > num_local_tokens and c.start < num_tokens - 1]
    if not opts.policy.is_exact:
        return [c.cid for c in beyond]
    awaited = [c.exact_key for c in beyond]
    # Only the canonical slot's chunk is saved as a canonical (in this request's context).
    return awaited + [keys.canonical(c.cid) for c in beyond if c.is_canonical_slot]
