"""vLLM's own media hashes, vouched for across its processes, so the engine need not hash again.

vLLM's front end names each multimodal item by a BLAKE3 (or SHA-2) hash of its media and the
processor's arguments, unless the client sent a uuid for it (``multimodal/processing/inputs.py``).
The engine cannot tell the two apart (``connector/mm_identity.py``), so OrbitKV hashed every new
item's processed inputs once more there, on the scheduler's path: 0.3-0.9 ms an image on the
bench model, more than the rest of a request's connector time on large images.

Here the front end says which hashes it made itself:

- ``ProcessorInputs.get_mm_hashes`` knows, item by item, whether a client gave a uuid. Its result
  carries the hashes vLLM computed from content, less any value a client's uuid also produced.
- ``InputProcessor.process_inputs``, on a server with an OrbitKV connector, tags each of the
  request's items whose hash is in that set. The tag is a keyed BLAKE3 of the hash under the
  launch key (``orbitkv.config.launch_key``), put in ``kv_transfer_params["orbitkv_mm_tags"]``.
  Whatever a client put there is dropped first.
- The engine (``vouched``) keys an item by vLLM's hash only when its tag checks out.

A client cannot make a tag without the key, and a tag says only "vLLM hashed this content".
Anything else leaves the tag off, and the inputs are hashed as before: a process without the key,
a vLLM that copies the hashes on the way or builds requests another way, a model that rewrites its
hashes (Qwen3-VL's videos). ``use_vllm_mm_hashes: false`` turns the engine's side off: an image then
has one id whether a client names it or not.

The two hooks wrap vLLM methods, which vLLM does not keep stable; ``tests/connector/
test_vllm_ext_overrides.py`` checks that both still exist.
"""

from __future__ import annotations

import functools
import hmac
import logging
from collections.abc import Callable, Mapping
from typing import Any

from blake3 import blake3

from orbitkv.config import launch_key

from ..plugin import CONNECTOR_NAME, EC_CONNECTOR_NAME

logger = logging.getLogger(__name__)

TAGS_PARAM = "orbitkv_mm_tags"
_DOMAIN = b"orbitkv-vllm-mm-hash-1\0"
_NONE: frozenset[str] = frozenset()


def tag(key: bytes, mm_hash: str) -> str:
    """The launch key's tag on a hash vLLM computed from content."""
    return blake3(_DOMAIN + mm_hash.encode("utf-8"), key=key).hexdigest(16)


class VllmHashes(dict):
    """``get_mm_hashes``' result (modality -> hashes), with ``computed``: the hashes vLLM made
    from content."""

    __slots__ = ("computed",)

    def __init__(self, hashes: Mapping[str, list[str]], computed: frozenset[str]) -> None:
        super().__init__(hashes)
        self.computed = computed


def computed_hashes(hashes: Mapping[str, list[str]], uuids: Mapping[str, Any] | None) -> frozenset[str]:
    """The hashes of the items without a client uuid, less any value an item with one produced
    (a client naming its picture by another item's hash must not ride on that item's tag)."""
    computed, named = set(), set()
    uuids = uuids or {}
    for modality, values in hashes.items():
        given = uuids.get(modality)
        for i, value in enumerate(values):
            is_named = given is not None and i < len(given) and given[i] is not None
            (named if is_named else computed).add(value)
    return frozenset(computed - named)


# The last answer, by the tags and key it was for: both schedulers (KV and encoder) check each
# request's tags, one after the other, on cold caches (about 55 us a check on the bench model).
_last: tuple[tuple[Any, ...], bytes | None, frozenset[str]] = ((), None, _NONE)


def vouched(kv_transfer_params: Mapping[str, Any] | None, key: bytes | None = None) -> frozenset[str]:
    """The item hashes vLLM's front end vouched for in this request (none without the key)."""
    global _last
    tags = kv_transfer_params.get(TAGS_PARAM) if isinstance(kv_transfer_params, Mapping) else None
    if not tags or not isinstance(tags, Mapping):
        return _NONE
    key = key if key is not None else engine_key()
    if key is None:
        return _NONE
    items = tuple(tags.items())
    last_items, last_key, last = _last
    if items == last_items and key == last_key:
        return last
    found = frozenset(
        h for h, t in items
        if isinstance(h, str) and isinstance(t, str) and hmac.compare_digest(t, tag(key, h))
    )
    _last = (items, key, found)
    return found


@functools.cache
def engine_key() -> bytes | None:
    """This process's launch key, read once (inherited from vLLM's first process)."""
    return launch_key()


# -- the front end's hooks ---------------------------------------------------------------------


def install() -> None:
    """Wrap vLLM's hashing and request building (idempotent; a vLLM without either method gets
    no tags, and its engines hash inputs as before)."""
    try:
        from vllm.multimodal.processing.inputs import ProcessorInputs
        from vllm.v1.engine.input_processor import InputProcessor
    except ImportError:
        logger.info("OrbitKV: this vLLM has no ProcessorInputs/InputProcessor; media hashes are "
                    "not vouched for")
        return
    _wrap(ProcessorInputs, "get_mm_hashes", _get_mm_hashes)
    _wrap(InputProcessor, "process_inputs", _process_inputs)


def _wrap(cls: type, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    original = getattr(cls, name, None)
    if original is None or getattr(original, "_orbitkv_wrapped", False):
        return
    wrapped = make(original)
    wrapped._orbitkv_wrapped = True  # type: ignore[attr-defined]
    setattr(cls, name, wrapped)


def _get_mm_hashes(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def get_mm_hashes(self: Any, *args: Any, **kwargs: Any) -> Any:
        hashes = original(self, *args, **kwargs)
        try:
            return VllmHashes(hashes, computed_hashes(hashes, self.mm_uuid_items))
        except Exception:
            logger.exception("OrbitKV: reading vLLM's media hashes failed; none is vouched for")
            return hashes

    return get_mm_hashes


def _process_inputs(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def process_inputs(self: Any, request_id: str, prompt: Any, *args: Any, **kwargs: Any) -> Any:
        request = original(self, request_id, prompt, *args, **kwargs)
        try:
            _tag_request(_frontend_key(self), prompt, request)
        except Exception:
            # A tag left off costs the engine a hash; a client's tag never verifies without the key.
            logger.exception("OrbitKV: tagging request %s's media hashes failed", request_id)
        return request

    return process_inputs


def _frontend_key(processor: Any) -> bytes | None:
    """The launch key where this server runs an OrbitKV connector (else None: no tags)."""
    found = getattr(processor, "_orbitkv_launch_key", False)
    if found is not False:
        return found
    config = getattr(processor, "vllm_config", None)
    kv = getattr(config, "kv_transfer_config", None)
    ec = getattr(config, "ec_transfer_config", None)
    has_orbitkv = (getattr(kv, "kv_connector", None) == CONNECTOR_NAME
                   or getattr(ec, "ec_connector", None) == EC_CONNECTOR_NAME)
    key = launch_key() if has_orbitkv else None
    processor._orbitkv_launch_key = key
    return key


def _tag_request(key: bytes | None, prompt: Any, request: Any) -> None:
    """Drop a client's tags from the request; add the front end's where vLLM hashed the item."""
    params = getattr(request, "sampling_params", None)
    if params is None:
        return
    extra = params.extra_args or {}
    kv = extra.get("kv_transfer_params")
    if isinstance(kv, Mapping) and TAGS_PARAM in kv:
        kv = {k: v for k, v in kv.items() if k != TAGS_PARAM}
        params.extra_args = extra = {**extra, "kv_transfer_params": kv}
    hashes = prompt.get("mm_hashes") if isinstance(prompt, Mapping) else None
    computed = getattr(hashes, "computed", None)
    if key is None or not computed or not request.mm_features:
        return
    if kv is not None and not isinstance(kv, Mapping):
        return  # the client's own malformed value stays, for the connector to report
    tags = {f.mm_hash: tag(key, f.mm_hash) for f in request.mm_features if f.mm_hash in computed}
    if tags:
        kv = dict(kv) if isinstance(kv, Mapping) else {}
        kv[TAGS_PARAM] = tags
        params.extra_args = {**extra, "kv_transfer_params": kv}
