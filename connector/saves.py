"""What the scheduler half asks the worker to save, and what a canonicalize request did.

Every chunk a request computes is saved once it is complete: as a conditioned entry always; as the
canonical when it sat right after the anchor (or when the request canonicalizes it); with a patch
wanted when it has an antecedent (formed on the writer thread if B's canonical exists by then).
Chunks loaded from the store, held exactly already, or computed before this request are skipped. A
canonicalize request (``role: canonicalize``) saves only its item, and says what it did.
"""

from __future__ import annotations

from typing import Any

from .chunking import Chunk
from .metadata import OrbitKVMetadata, SaveSpec, slots_for
from .planner import default_key_fn
from .request_state import ReqState


def emit_saves(
    state: ReqState, num_done: int, meta: OrbitKVMetadata, config: Any, block_size: int
) -> None:
    """Save every chunk that is complete once this step's tokens are computed."""
    if not state.options.is_save_enabled:
        return
    limit = min(num_done, state.num_prompt_tokens)
    is_canonicalize = state.options.role == "canonicalize"
    while state.next_save < len(state.chunks) and state.chunks[state.next_save].end <= limit:
        c = state.chunks[state.next_save]
        state.next_save += 1
        if (
            c.index in state.served
            or c.index in state.has_exact
            or c.end <= state.num_local_tokens
            # A canonicalize request stores B's canonical only, not its template's tail.
            or (is_canonicalize and not c.is_canonical_slot)
        ):
            continue
        keys = {"conditioned": default_key_fn(c.cid, "conditioned", c.antecedent_hash, 0)}
        if c.is_canonical_slot and (config.save_canonical or is_canonicalize):
            keys["canonical"] = default_key_fn(c.cid, "canonical", "", 0)
        meta.saves.append(
            SaveSpec(
                req_id=state.req_id,
                cid=c.cid,
                start=c.start,
                slots=slots_for(state.block_ids, block_size, c.start, c.end),
                antecedent=c.antecedent,
                antecedent_hash=c.antecedent_hash,
                keys=keys,
                is_patch_wanted=(
                    config.patch_rank > 0 and not c.is_anchor and not c.is_canonical_slot
                ),
                start_pos=state.positions[c.index],
            )
        )
        state.num_saved_chunks += 1


def check_canonicalize(
    request: Any, chunks: list[Chunk], anchor_ids: Any, view: Any
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
    stored = view.lookup([default_key_fn(b.cid, "canonical", "", 0)])[0] is not None
    return {"status": "already stored" if stored else "formed", "cid": b.cid,
            "modality": b.modality, "num_tokens": b.length}
