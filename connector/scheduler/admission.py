"""What a request may reuse, decided when vLLM admits it: options, chunks, lineage and the plan.

vLLM calls ``get_num_new_matched_tokens`` again and again while a request waits (and again after a
preemption), so planning only reads: the store through its batched lookups, and memo tables keyed by
request id (the request's options and chunks, a pure function of the request; the last plan,
overwritten on every call). Planning also sets the lineage of the request's blocks in vLLM's prefix
cache (``prefix_lineage.py``): it must happen before vLLM allocates and caches them, which is right
after this call.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from orbitkv.store.keys import RequestKeys, anchor_context

from .. import cdc
from ..chunking import Chunk, KeyContext, UnkeyableItem, chunk_prompt, mm_spans_from_features
from ..identity import ModelIdentity, line_end_ids
from ..mm_identity import metadata_resolver
from ..vllm_ext.mm_hashes import vouched
from ..vllm_ext.prefix_lineage import LineageHasher
from .calibration import ModeGate
from .lineage import earliest
from .options import RequestOptions, RequestRules
from .planner import EXACT, Plan, plan_request

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.lora.request import LoRARequest
    from vllm.v1.request import Request

    from orbitkv.config import OrbitKVConfig

    from ..timing import PartSeconds
    from .audit import AuditVerdicts
    from .planner import StoreView

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Admission:
    """A request's plan at its latest admission, and where the KV of vLLM's prefix hit stops
    being exact (``hit_approx_from``; None: the hit is exact)."""

    plan: Plan
    hit_approx_from: int | None

    def accepted(self, plan: Plan) -> int | None:
        """Where KV stops being exact once vLLM accepted ``plan`` (maybe fewer loads)."""
        return earliest(self.hit_approx_from, plan.first_approximate_token)


class Admissions:
    def __init__(
        self, vllm_config: VllmConfig, config: OrbitKVConfig, identity: ModelIdentity,
        view: StoreView,
        verdicts: AuditVerdicts | None = None,
        seconds: PartSeconds | None = None,
    ) -> None:
        self._block_size = int(vllm_config.cache_config.block_size)
        self._config = config
        self._identity = identity
        self._view = view
        self._rules = RequestRules(config, ModeGate(config, identity.model_fingerprint, verdicts))
        self._line_end_ids = (
            line_end_ids(vllm_config) if config.text_chunking == "content" else frozenset()
        )
        if config.text_chunking == "content":
            cdc.prepare()
        self._hash_fn = _prefix_hash_fn(vllm_config)
        self._mm_metadata_fields = metadata_resolver(vllm_config)
        self._is_vllm_hash_used = bool(getattr(config, "use_vllm_mm_hashes", True))
        self._seconds = seconds
        self._has_warned_unkeyable = False
        self._chunk_memo: dict[str, tuple[RequestOptions, list[Chunk], list[int] | None]] = {}
        self._keys_memo: dict[str, RequestKeys] = {}
        self._admissions: dict[str, Admission] = {}
        self._hashers: dict[str, LineageHasher] = {}
        # The first token of vLLM's latest prefix hit that came from approximate blocks, by
        # request (absent: the hit is exact), as the scheduler extension's lookup found it.
        self._hit_approx_from: dict[str, int] = {}
        # Set by the scheduler extension when it can serve holes (0: prefix runs only).
        self.min_hole_tokens = 0

    # -- per request, pure ------------------------------------------------------------------------

    def _vouched(self, request: Request) -> frozenset[str]:
        """The request's item hashes vLLM made from content (``vllm_ext/mm_hashes.py``)."""
        if not self._is_vllm_hash_used or not getattr(request, "mm_features", None):
            return frozenset()
        return vouched(getattr(request, "kv_transfer_params", None))

    def options(self, request: Request) -> RequestOptions:
        opts = self._rules.options(request.kv_transfer_params, getattr(request, "cache_salt", None))
        if getattr(request, "prompt_embeds", None) is not None:
            # vLLM hashes prompt embeddings into its block hashes; placeholder token ids alone
            # would make two prompts with other embeddings one chunk.
            opts = replace(opts, is_load_enabled=False, is_save_enabled=False,
                           modes=opts.modes & {EXACT}, refusal="prompt embeddings")
        return opts

    def chunks(self, request: Request) -> tuple[RequestOptions, list[Chunk], list[int] | None]:
        """Options, chunks and each chunk's start position in the model's units (None: this
        prompt cannot be placed, so chunks are served only where they were stored)."""
        memo = self._chunk_memo.get(request.request_id)
        if memo is not None:
            return memo
        opts = self.options(request)
        ctx = KeyContext(
            self._identity.model_fingerprint,
            self._identity.layout,
            opts.tenant,
            str(getattr(request, "cache_salt", None) or ""),
            lora_key(getattr(request, "lora_request", None)),
        )
        token_ids = request.prompt_token_ids or ()  # read, never changed: no copy
        try:
            chunks = chunk_prompt(
                token_ids,
                mm_spans_from_features(
                    getattr(request, "mm_features", None),
                    is_client_trusted=bool(getattr(self._config, "trust_client_mm_ids", False)),
                    metadata_fields=self._mm_metadata_fields,
                    seconds=self._seconds,
                    vouched=self._vouched(request),
                ),
                self._config.chunk_size,
                ctx,
                anchor_ids=self._identity.anchor_ids,
                boundaries=opts.chunk_boundaries,
                text_chunking=self._config.text_chunking,
                line_end_ids=self._line_end_ids,
            )
        except UnkeyableItem:
            # Expected on every image request under vLLM's shm processor cache: said once.
            log = logger.debug if self._has_warned_unkeyable else logger.warning
            self._has_warned_unkeyable = True
            log("OrbitKV: request %s has a multimodal item without its inputs on the scheduler "
                "(mm_processor_cache_type shm?): not cached (deploy/README.md, Security)",
                request.request_id)
            chunks = []
        except (TypeError, ValueError):
            # A prompt the chunker cannot split (e.g. overlapping items) is simply not cached.
            logger.exception("OrbitKV: cannot chunk request %s", request.request_id)
            chunks = []
        position_of = self._identity.positions.for_request(
            token_ids, getattr(request, "mm_features", None) or ()
        )
        positions = [position_of(c.start) for c in chunks] if position_of is not None else None
        self._chunk_memo[request.request_id] = memo = (opts, chunks, positions)
        return memo

    def keys(self, request: Request) -> RequestKeys:
        """The entry keys this request names: its policy's lineage, the anchor's context its
        canonicals are keyed in (per tenant, salt and adapter), the rank of its patches."""
        memo = self._keys_memo.get(request.request_id)
        if memo is not None:
            return memo
        opts, _, _ = self.chunks(request)
        context = canonical_context(
            self._identity, opts.tenant, str(getattr(request, "cache_salt", None) or ""),
            lora_key(getattr(request, "lora_request", None)),
        )
        keys = RequestKeys(
            lineage=opts.policy.tag, canonical_context=context,
            patch_rank=opts.patch_rank or self._config.patch_rank,
        )
        self._keys_memo[request.request_id] = keys
        return keys

    # -- vLLM's prefix cache ----------------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        """Give the request its namespace in vLLM's prefix cache (``prefix_lineage.py``)."""
        opts, _, _ = self.chunks(request)
        base_tag = "" if opts.tenant == self._config.tenant else f"tenant:{opts.tenant}"
        approx_tag = opts.policy.tag
        if approx_tag:
            approx_tag = f"{approx_tag}:{opts.tenant}"
        if (base_tag or approx_tag) and self._hash_fn is not None:
            self._hashers[request.request_id] = LineageHasher.install(
                request, self._hash_fn, base_tag, approx_tag
            )

    def hasher(self, req_id: str) -> LineageHasher | None:
        return self._hashers.get(req_id)

    def note_prefix_hit(self, req_id: str, approx_from: int | None) -> None:
        """vLLM's prefix lookup for this request just ran: its hit holds approximate KV from token
        ``approx_from`` on (None: the hit is exact). The next ``match`` plans after that hit."""
        if approx_from is None:
            self._hit_approx_from.pop(req_id, None)
        else:
            self._hit_approx_from[req_id] = approx_from

    # -- planning ----------------------------------------------------------------------------------

    def match(
        self, request: Request, num_computed_tokens: int, *, is_load_allowed: bool
    ) -> int | None:
        """External tokens vLLM may skip (None: ask again next step), or 0; remembers the plan."""
        req_id = request.request_id
        hasher = self._hashers.get(req_id)
        hit_approx = self._hit_approx_from.get(req_id)
        if hit_approx is not None and hit_approx >= num_computed_tokens:
            hit_approx = None  # the hit was cut before its approximate blocks
        opts, chunks, positions = self.chunks(request)
        plan = None
        if is_load_allowed and opts.is_load_enabled and chunks and not _skips_prefix_cache(request):
            plan = self._plan(request, opts, chunks, positions, num_computed_tokens)
            if plan is None:
                return None
        if plan is None:
            plan = Plan(num_computed_tokens, 0, (), ())
        approx_from = earliest(hit_approx, plan.first_approximate_token)
        if hasher is not None:
            hasher.set_lineage(request, approx_from, self._block_size)
        self._admissions[req_id] = Admission(plan, hit_approx)
        return plan.num_external_tokens

    def _plan(
        self, request: Request, opts: RequestOptions, chunks: list[Chunk],
        positions: list[int] | None, num_computed_tokens: int,
    ) -> Plan | None:
        # Unplaceable (positions unknown): an exact entry has this very antecedent, so it sits at
        # the same position; every other mode would move the chunk.
        modes = opts.modes if positions is not None else opts.modes & {EXACT}
        return plan_request(
            chunks,
            self._view,
            num_computed_tokens=num_computed_tokens,
            num_tokens=int(request.num_tokens),
            modes=modes,
            min_hole_tokens=self.min_hole_tokens,
            mode_filter=opts.policy.mode_filter(),
            keys=self.keys(request),
            recompute_fraction=opts.policy.recompute_fraction,
        )

    def admission(self, req_id: str) -> Admission | None:
        return self._admissions.get(req_id)

    def drop_plan(self, req_id: str) -> None:
        self._admissions.pop(req_id, None)

    def forget(self, req_id: str) -> None:
        self._chunk_memo.pop(req_id, None)
        self._keys_memo.pop(req_id, None)
        self._admissions.pop(req_id, None)
        self._hashers.pop(req_id, None)
        self._hit_approx_from.pop(req_id, None)

    def tracked(self) -> set[str]:
        return (
            set(self._chunk_memo) | set(self._keys_memo) | set(self._admissions)
            | set(self._hashers) | set(self._hit_approx_from)
        )


def canonical_context(
    identity: ModelIdentity, tenant: str = "", cache_salt: str = "", lora: str = ""
) -> str:
    """The context this model's canonicals are keyed in (``store.keys.anchor_context``)."""
    return _anchor_context(
        identity.model_fingerprint, identity.layout, tuple(identity.anchor_ids), tenant,
        cache_salt, lora,
    )


@functools.lru_cache(maxsize=1024)
def _anchor_context(
    model_fingerprint: str, layout: str, anchor_ids: tuple[int, ...], tenant: str,
    cache_salt: str, lora: str,
) -> str:
    # Every request names it: hashing the anchor again each time cost about 0.1 ms a request on
    # the cold caches the scheduler runs on (``docs/performance.md``, ninth session).
    return anchor_context(
        model_fingerprint, layout, anchor_ids, tenant=tenant, cache_salt=cache_salt, lora=lora
    )


def lora_key(lora_request: LoRARequest) -> str:
    """The adapter a request's KV is computed with: its name and path ("" for the base model)."""
    if lora_request is None:
        return ""
    return f"{getattr(lora_request, 'lora_name', '')}\x00{getattr(lora_request, 'lora_path', '')}"


def _prefix_hash_fn(vllm_config: VllmConfig) -> Any:
    """vLLM's prefix-caching hash, so tagged block hashes are as collision-resistant as its own."""
    algo = getattr(getattr(vllm_config, "cache_config", None), "prefix_caching_hash_algo", None)
    if algo is None:
        return None
    from vllm.utils.hashing import get_hash_fn_by_name

    return get_hash_fn_by_name(algo)


def _skips_prefix_cache(request: Request) -> bool:
    """vLLM serves such a request nothing cached (prompt logprobs, all-token pooling): it must
    compute every prompt token, so OrbitKV serves it nothing either, holes included."""
    return bool(getattr(request, "skip_reading_prefix_cache", False))
