"""A multimodal item's fleet-wide identity: a hash of what the encoder runs on, not a client's name.

vLLM names an item by its ``mm_hash``: a content hash of the raw media, unless the client gave the
chat part a ``uuid``, which vLLM then takes as the hash as given (``multimodal/processing/
inputs.py``). A client name is fine inside one engine (vLLM's own caches trust it, and a client
that reuses one only fools itself there), but OrbitKV's store is shared by every replica and
every user for days: a client sending its own picture under a known image's uuid would poison
that image's KV and encoder output for everyone, or read another user's image by naming it. The
identifier alone cannot tell a client's uuid from vLLM's hash (a uuid may be any string).

So by default the store keys an item by ``content_id``: a hash of the item's processed
inputs (``feature.data``: pixel values, grid sizes, ... exactly what the encoder is given, so
the same inputs give the same KV), with the modality and the LoRA prefix vLLM puts in front of
the hash when a LoRA changes the vision tower. A cryptographic hash, not xxh3: the inputs are the
client's to choose, so it must resist crafted collisions; BLAKE3 (vLLM's own media hash, so
already installed), several threads on large inputs: a 19 MB ``pixel_values`` hashes in about
10 ms where BLAKE2b took 110 ms. The KV scheduler and the encoder scheduler ask for the same
item: the digest is kept while the item's data lives, so each item is hashed once. An item whose processed inputs the
scheduler does not hold (vLLM's ``shm`` processor cache sends only an address) has no content
identity: it is not cached by OrbitKV.

An item whose hash vLLM's front end made from content, and vouched for with the launch key
(``vllm_ext/mm_hashes.py``), is keyed by that hash instead (``vllm_hashed_id``): vLLM hashed its
media already, so the engine does not hash its inputs again.

``trust_client_mm_ids: true`` keys items by vLLM's identifier as before (no hashing), for a
deployment whose clients are one trust domain or whose uuids a trusted gateway assigns.
"""

from __future__ import annotations

import functools
import time
import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from blake3 import blake3

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.multimodal.inputs import MultiModalFeatureSpec

    from .timing import PartSeconds

# A content id is never a plausible vLLM hash or uuid, so the two kinds of name cannot meet.
PREFIX = "okv-content:"
_DOMAIN = b"orbitkv-mm-1\0"
_VLLM_DOMAIN = b"orbitkv-mm-vllm-1\0"
# Inputs at least this large are hashed on several threads (BLAKE3's advice: only big inputs gain).
_THREADED_NBYTES = 1 << 20
MetadataFields = Callable[[str], set[str]]
# id(feature.data) -> (a weak reference to it, the hash of its fields, the fields with tensors,
# its names: (modality, identifier, mm_hash, metadata_fields) -> content_id).
_DIGESTS: dict[int, tuple[weakref.ref, str, frozenset[str], dict[tuple, str | None]]] = {}
# The names one item's data is given (one a modality and LoRA prefix: a handful in practice).
_MAX_NAMES_PER_ITEM = 16


def content_id(
    feature: MultiModalFeatureSpec, metadata_fields: MetadataFields | None = None,
    seconds: PartSeconds | None = None,
) -> str | None:
    """The item's content identity, or None when the scheduler holds no inputs to hash.

    ``metadata_fields`` (modality -> field names) names the fields that only size a placeholder:
    an item holding nothing else (an embedding an encoder-cache consumer is to be handed by
    name) has no content to hash. ``seconds``: where hashing inputs not seen before counts, as
    ``mm_hash`` (a recurring item costs a lookup)."""
    data = getattr(feature, "data", None)
    modality = str(getattr(feature, "modality", ""))
    # A recurring item (vLLM's processor cache hands the same data again) is named from its
    # data's entry: one lookup where the steps below cost about 10 us an item on cold caches.
    named_as = (modality, getattr(feature, "identifier", None), getattr(feature, "mm_hash", None),
                metadata_fields)
    found = _DIGESTS.get(id(data))
    if found is not None and found[0]() is data and named_as in found[3]:
        return found[3][named_as]
    metadata = metadata_fields(modality) if metadata_fields else set()
    if data is None or not hasattr(data, "items"):
        return None
    if "address" in data:  # vLLM's shm processor cache: a pointer, not the inputs
        return None
    digest, tensor_fields = _inputs_id(data, seconds)
    name = None
    if tensor_fields - metadata:
        name = _named(modality, _lora_prefix(feature), digest)
    found = _DIGESTS.get(id(data))
    if found is not None and found[0]() is data and len(found[3]) < _MAX_NAMES_PER_ITEM:
        found[3][named_as] = name
    return name


@functools.lru_cache(maxsize=4096)
def _named(modality: str, lora_prefix: str, digest: str) -> str:
    """The id of inputs ``digest`` as a ``modality`` item under a LoRA prefix; a recurring item
    (vLLM's processor cache hands the same inputs again) costs a lookup, not a hash."""
    h = _hasher()
    _update_str(h, modality)
    _update_str(h, lora_prefix)
    _update_str(h, digest)
    return PREFIX + h.hexdigest(16)


def _inputs_id(data: Any, seconds: PartSeconds | None = None) -> tuple[str, frozenset[str]]:
    """The hash of an item's fields and the names of those holding a tensor; kept while
    ``data`` lives (vLLM never changes a processed item)."""
    key = id(data)
    found = _DIGESTS.get(key)
    if found is not None and found[0]() is data:
        return found[1], found[2]
    started = time.perf_counter()
    h = _hasher()
    tensor_fields = set()
    for name in sorted(data):
        _update_str(h, str(name))
        if _update(h, getattr(data[name], "data", data[name])):
            tensor_fields.add(str(name))
    digest = h.hexdigest(16)
    if seconds is not None:
        seconds.add("mm_hash", time.perf_counter() - started)
    try:
        ref = weakref.ref(data, lambda _: _DIGESTS.pop(key, None))
    except TypeError:  # a container without weak references: hashed again when asked again
        return digest, frozenset(tensor_fields)
    _DIGESTS[key] = (ref, digest, frozenset(tensor_fields), {})
    return digest, frozenset(tensor_fields)


def _hasher() -> Any:
    return blake3(_DOMAIN)


def identifiers(
    features: Iterable[Any], *, is_client_trusted: bool,
    metadata_fields: MetadataFields | None = None, seconds: PartSeconds | None = None,
    vouched: frozenset[str] = frozenset(),
) -> list[str | None]:
    """Per feature, the identity the store keys it by (None: not cacheable). ``vouched``: the
    request's hashes vLLM's front end made from content (``vllm_ext.mm_hashes.vouched``)."""
    if is_client_trusted:
        return [str(f.identifier) if f.identifier else None for f in features]
    return [vllm_hashed_id(f) if vouched and getattr(f, "mm_hash", None) in vouched
            else content_id(f, metadata_fields, seconds) for f in features]


def vllm_hashed_id(feature: MultiModalFeatureSpec) -> str:
    """The id of an item vLLM hashed from its media (its ``mm_hash``, vouched for by the front
    end). vLLM's hash covers the model, the media and the processor's arguments; the versions of
    vLLM and transformers are added, since a new processor may turn the same media into other
    inputs."""
    return _named_by_vllm(str(getattr(feature, "modality", "")), _lora_prefix(feature),
                          str(feature.mm_hash))


@functools.lru_cache(maxsize=4096)
def _named_by_vllm(modality: str, lora_prefix: str, mm_hash: str) -> str:
    h = blake3(_VLLM_DOMAIN)
    for part in (modality, lora_prefix, mm_hash, *_processor_versions()):
        _update_str(h, part)
    return PREFIX + h.hexdigest(16)


@functools.cache
def _processor_versions() -> tuple[str, str]:
    import transformers
    import vllm

    return str(vllm.__version__), str(transformers.__version__)


# id(model config) -> (it, its resolver): one resolver per model in a process, so that the KV and
# encoder connectors name an item with the same function and the second finds the first's name
# in ``content_id``'s memo (whose key holds the function).
_RESOLVERS: dict[int, tuple[Any, MetadataFields]] = {}


def metadata_resolver(vllm_config: VllmConfig, *, is_strict: bool = False) -> MetadataFields | None:
    """vLLM's modality -> placeholder-only fields, or None where it cannot tell (no mm model;
    ``is_strict``: raise instead)."""
    model_config = getattr(vllm_config, "model_config", None)
    if model_config is None and not is_strict:  # a stand-in config: no model to ask
        return None
    found = _RESOLVERS.get(id(model_config))
    if found is not None and found[0] is model_config:
        return found[1]
    try:
        from vllm.distributed.ec_transfer.ec_connector.utils import PlaceholderMetadataResolver

        fields_for = PlaceholderMetadataResolver(model_config).fields_for
    except Exception:  # a text model or a stand-in config: every field counts as an input
        if is_strict:
            raise
        return None
    _RESOLVERS[id(model_config)] = (model_config, fields_for)
    return fields_for


def _lora_prefix(feature: MultiModalFeatureSpec) -> str:
    """What vLLM put before the item's hash in ``identifier`` (a LoRA that changes the tower)."""
    identifier = str(getattr(feature, "identifier", "") or "")
    mm_hash = getattr(feature, "mm_hash", None)
    if mm_hash and identifier.endswith(mm_hash):
        return identifier[: len(identifier) - len(mm_hash)]
    return ""


def _update_str(h: Any, value: str) -> None:
    data = value.encode("utf-8")
    h.update(len(data).to_bytes(8, "little"))
    h.update(data)


def _update(h: Any, value: Any) -> int:
    """Hash a nested field value (tensors, lists, scalars); the number of tensors hashed."""
    if isinstance(value, torch.Tensor):
        t = value.detach().to("cpu").contiguous()
        _update_str(h, f"T{t.dtype}{tuple(t.shape)}")
        raw = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b""
        if len(raw) >= _THREADED_NBYTES:
            h.update(blake3(raw, max_threads=blake3.AUTO).digest())
        else:
            h.update(raw)
        return 1
    if isinstance(value, np.ndarray):
        return _update(h, torch.from_numpy(np.ascontiguousarray(value)))
    if isinstance(value, (list, tuple)):
        _update_str(h, f"L{len(value)}")
        return sum(_update(h, v) for v in value)
    _update_str(h, f"S{type(value).__name__}:{value!r}")
    return 0
