"""The encoder connector's scheduler half: which items' encoder outputs come from the store.

vLLM's scheduler asks, per step and per request with multimodal items: ``ensure_cache_available``
(the request is about to be scheduled), then ``has_cache_item(mm_hash)`` for each item it would
otherwise encode, then ``update_state_after_alloc`` for each item it gave encoder-cache space
(computed or loaded), then ``build_connector_meta`` once.

An item is announced as cached only once its output has been read from the store and verified
(checksums, model fingerprint, number of embeddings); the verified tensor travels to the worker in
the step's metadata. vLLM's model runner has no way to fall back to the encoder once an item was
announced, so the worker must never find the output missing: a corrupt or missing entry, a down
Redis or any store error is a "no" here, and the encoder runs. The reads run on the scheduler's
thread: a lookup bounded by ``remote_lookup_timeout_s`` (and Redis' circuit breaker), then, on a
hit only, the read. Items whose KV OrbitKV loads are never asked for: vLLM (and, for holes,
OrbitKV's scheduler extension) schedules no encoder input for tokens it does not compute.

``has_cache_item`` names the item only; its key also needs the request's tenant and salt, so
``ensure_cache_available`` records each upcoming item of the request vLLM considers next, and its
key is made when vLLM asks for it: a new request's items that vLLM's prefix cache then covers (most
of an agent's window) are never keyed.

An encoder-cache consumer makes vLLM accept pre-computed embedding items that carry only their
placeholder metadata, the embedding itself to come through the connector. Such an item has nothing
the encoder could run on: when the store cannot serve it, the request is reported unavailable
(``take_unavailable_requests``) and vLLM fails it, rather than meeting a missing encoder output in
the model runner, which would stop the engine.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..mm_identity import identifiers
from ..scheduler.options import RequestRules
from ..vllm_ext.mm_hashes import vouched
from . import summary
from .entries import encoder_key, output_of
from .metadata import EncoderLoad, OrbitKVECMetadata, OrbitKVECWorkerMeta
from .stats import OrbitKVECStats

if TYPE_CHECKING:
    from orbitkv.store.tiered import TieredStore
    from vllm.multimodal.inputs import MultiModalFeatureSpec
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import ECConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ItemKey:
    key: str
    name: str  # the item's store identity (its content, unless client ids are trusted)
    num_embeds: int
    is_load_enabled: bool
    is_save_enabled: bool


@dataclass(slots=True)
class RequestKeys:
    """What decides a request's encoder keys and whether it loads and saves them."""

    tenant: str
    cache_salt: str
    is_load_enabled: bool
    is_save_enabled: bool
    # Where its last item's placeholder ends: once computed past it, vLLM's questions (every
    # step, decode included) have nothing to look at.
    items_end: int = 0
    # placeholder offset -> the item's key (None: not cacheable), made once when first asked for;
    # and whether it carries an input the encoder can run on: vLLM asks every step the request
    # waits or prefills.
    items: dict[int, ItemKey | None] = field(default_factory=dict)
    has_input: dict[int, bool] = field(default_factory=dict)
    # Its item hashes vLLM's front end made from content (``vllm_ext/mm_hashes.py``).
    vouched: frozenset[str] = frozenset()


class ECSchedulerHalf:
    def __init__(
        self,
        store: TieredStore,
        model_fingerprint: str,
        rules: RequestRules,
        *,
        is_load_enabled: bool,
        is_save_enabled: bool,
        metadata_fields: Callable[[str], set[str]] = lambda modality: set(),
        is_client_trusted: bool = False,
        is_vllm_hash_used: bool = False,
    ) -> None:
        self._store = store
        # True: an item vLLM hashed from content is keyed by that hash (``use_vllm_mm_hashes``).
        self._is_vllm_hash_used = is_vllm_hash_used
        # False: an item's key names its processed inputs, not vLLM's identifier, which may be a
        # client's uuid (connector/mm_identity.py).
        self._is_client_trusted = is_client_trusted
        # modality -> the item fields that only size its placeholder (vLLM's data parser).
        self._metadata_fields = metadata_fields
        self._unavailable: set[str] = set()
        self._fingerprint = model_fingerprint
        # The deployment's rules for a request's options (its tenant must be an allowed one).
        self._rules = rules
        self._is_load_enabled = is_load_enabled
        self._is_save_enabled = is_save_enabled
        self._requests: dict[str, RequestKeys] = {}
        # This step's state: the upcoming items of the request vLLM considers (keyed when vLLM
        # asks), the store's answer per key (a verified output or None), and what the worker loads
        # and saves.
        self._items: dict[str, tuple[Request, MultiModalFeatureSpec]] = {}
        self._answers: dict[str, torch.Tensor | None] = {}
        self._loads: dict[str, torch.Tensor] = {}
        self._saves: dict[str, list[str]] = {}
        self._stats = OrbitKVECStats()

    # -- per request ------------------------------------------------------------------------------

    def _request_keys(self, request: Request) -> RequestKeys:
        found = self._requests.get(request.request_id)
        if found is None:
            opts = self._rules.options(request.kv_transfer_params, getattr(request, "cache_salt", None))
            found = RequestKeys(
                opts.tenant,
                str(getattr(request, "cache_salt", None) or ""),
                opts.is_load_enabled and self._is_load_enabled,
                opts.is_save_enabled and self._is_save_enabled,
                max((f.mm_position.offset + f.mm_position.length
                     for f in request.mm_features or ()), default=0),
                vouched=(vouched(request.kv_transfer_params) if self._is_vllm_hash_used
                         else frozenset()),
            )
            self._requests[request.request_id] = found
        return found

    def _item_key(self, request: Request, feature: MultiModalFeatureSpec) -> ItemKey | None:
        """The item's key (None: not cacheable), made once per request."""
        keys = self._request_keys(request)
        offset = int(feature.mm_position.offset)
        if offset in keys.items:
            return keys.items[offset]
        item = None
        if (keys.is_load_enabled or keys.is_save_enabled) and feature.identifier:
            name = identifiers(
                [feature], is_client_trusted=self._is_client_trusted,
                metadata_fields=self._metadata_fields, vouched=keys.vouched,
            )[0]
            if name is not None:
                key = encoder_key(self._fingerprint, keys.tenant, keys.cache_salt, name)
                item = ItemKey(key, name, feature.mm_position.get_num_embeds(),
                               keys.is_load_enabled, keys.is_save_enabled)
        keys.items[offset] = item
        return item

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        """Record the request's items not yet behind ``num_computed_tokens``.

        True, except for a request with an item the encoder cannot run on and the store cannot
        serve (see the module docstring): it is reported unavailable. Reads otherwise happen in
        ``has_cache_item``, for the items vLLM would encode."""
        keys = self._requests.get(request.request_id)
        if keys is not None and num_computed_tokens >= keys.items_end:
            return True
        if keys is None:
            keys = self._request_keys(request)
        for feature in request.mm_features or ():
            position = feature.mm_position
            if position.offset + position.length <= num_computed_tokens:
                continue
            self._items[feature.identifier] = (request, feature)
            has_input = keys.has_input.get(position.offset)
            if has_input is None:
                has_input = keys.has_input[position.offset] = self._has_local_input(feature)
            if not has_input and not self.has_cache_item(feature.identifier):
                logger.error(
                    "OrbitKV: request %s sends item %s without an input to encode and the store "
                    "has no output for it; failing the request",
                    request.request_id,
                    feature.identifier,
                )
                self._unavailable.add(request.request_id)
                return False
        return True

    def _has_local_input(self, feature: MultiModalFeatureSpec) -> bool:
        """Whether the item carries something the encoder can run on (vLLM's own rule in its CPU
        EC connector). An item without data here is taken to have it: vLLM's processor cache
        may hold its input on the worker."""
        data = feature.data
        if data is None:
            return True
        metadata = self._metadata_fields(feature.modality)
        return any(getattr(v, "data", v) is not None for k, v in data.items() if k not in metadata)

    def take_unavailable_requests(self) -> set[str]:
        out, self._unavailable = self._unavailable, set()
        return out

    def has_cache_item(self, identifier: str) -> bool:
        upcoming = self._items.get(identifier)
        item = self._item_key(*upcoming) if upcoming is not None else None
        if item is None or not item.is_load_enabled:
            return False
        if item.key not in self._answers:
            self._answers[item.key] = self._fetch(item)
        return self._answers[item.key] is not None

    def _fetch(self, item: ItemKey) -> torch.Tensor | None:
        """The item's verified output from the store, or None (the encoder runs)."""
        started = time.perf_counter()
        try:
            if self._store.lookup([item.key])[0] is None:
                return None
            entry = self._store.get([item.key], expect_fingerprint=self._fingerprint)[0]
            output = output_of(entry, item.num_embeds)
        except Exception:
            # The store answers faults with misses; anything else is a bug to log, not a crash.
            logger.exception("OrbitKV: reading an encoder output failed; the encoder runs")
            output = None
        self._stats.observe("fetch_latency_s", time.perf_counter() - started)
        if output is None:
            self._stats.add("unreadable_entries", 1)
        return output

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        feature = request.mm_features[index]
        item = self._item_key(request, feature)
        output = self._answers.get(item.key) if item is not None and item.is_load_enabled else None
        summary.record(request.request_id, is_loaded=output is not None)
        if output is not None:
            self._loads[feature.identifier] = output
            self._stats.add("items.loaded", 1)
            self._stats.add("loaded_bytes", output.numel() * output.element_size())
            return
        self._stats.add("items.computed", 1)
        if item is not None and item.is_save_enabled:
            keys = self._saves.setdefault(feature.identifier, [])
            if item.key not in keys:
                keys.append(item.key)

    # -- per step ---------------------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> OrbitKVECMetadata:
        meta = OrbitKVECMetadata(
            [EncoderLoad(mm_hash, output) for mm_hash, output in self._loads.items()], self._saves
        )
        # Outputs read but not allocated (the request was not scheduled after all) are read again
        # next step, from the memory tier the read promoted them to.
        self._items, self._answers, self._loads, self._saves = {}, {}, {}, {}
        return meta

    def update_connector_output(self, connector_output: ECConnectorOutput) -> None:
        meta = getattr(connector_output, "ec_connector_worker_meta", None)
        if isinstance(meta, OrbitKVECWorkerMeta):
            for name, value in meta.counters.items():
                self._stats.add(name, value)

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        self._requests.pop(request.request_id, None)
        return False, {"orbitkv": summary.forget(request.request_id)}

    def take_stats(self) -> OrbitKVECStats | None:
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, OrbitKVECStats()
        return stats

    @property
    def model_fingerprint(self) -> str:
        return self._fingerprint

    @property
    def num_tracked_requests(self) -> int:
        return len(self._requests)
