"""The vLLM internals ``connector/vllm_ext/`` overrides or reaches into still exist in the installed
vLLM, with the parameters OrbitKV passes.

vLLM does not keep its scheduler's private methods stable between releases. Were one renamed, the
subclass would silently stop overriding it (holes never capped, failed blocks left in the prefix
cache), so each is checked here by name and parameters, without starting an engine.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest
from orbitkv.connector.vllm_ext import hole_scheduler
from orbitkv.connector.vllm_ext.hole_scheduler import _OrbitKVMixin
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request

# The mixin's own helpers (not overrides).
OWN_METHODS = {"_init_orbitkv", "_cap"}


def _overrides() -> list[str]:
    return sorted(
        name for name, value in vars(_OrbitKVMixin).items()
        if callable(value) and not name.startswith("__") and name not in OWN_METHODS
    )


def _named_params(fn) -> list[str]:
    return [
        p.name for p in inspect.signature(fn).parameters.values()
        if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]


def test_the_mixin_overrides_the_private_methods_it_expects():
    """A guard on the guard: the list below is the mixin's, so a new override is checked too."""
    assert set(_overrides()) >= {
        "_get_local_prefix_cache_hit", "_update_requests_with_invalid_blocks",
        "_build_kv_connector_meta", "_try_schedule_encoder_inputs", "_reserve_prefill_lookahead",
        "update_from_output", "schedule",
    }


@pytest.mark.parametrize("base", [Scheduler, AsyncScheduler], ids=lambda c: c.__name__)
@pytest.mark.parametrize("name", _overrides())
def test_each_override_exists_in_vllm_with_the_parameters_it_passes(base, name):
    assert hasattr(base, name), f"vLLM's {base.__name__} has no {name}: the override is dead"
    ours = _named_params(getattr(_OrbitKVMixin, name))
    theirs = _named_params(getattr(base, name))
    # The override names a prefix of vLLM's parameters (the rest goes through *args / **kwargs).
    assert theirs[: len(ours)] == ours, (name, ours, theirs)


def test_the_scheduler_state_the_extension_reads_is_set_by_vllm():
    src = inspect.getsource(Scheduler.__init__)
    for attr in ("kv_cache_manager", "kv_cache_config", "block_size", "use_v2_model_runner",
                 "model_uses_mrope", "requests", "running", "connector", "vllm_config"):
        assert f"self.{attr} =" in src or f"self.{attr}:" in src, attr


def test_the_cache_manager_calls_of_the_exact_guard_exist():
    assert _named_params(KVCacheManager.truncate_computed_blocks) == [
        "self", "blocks", "num_computed_tokens"
    ]
    assert _named_params(KVCacheManager.evict_blocks) == ["self", "block_ids"]
    assert _named_params(KVCacheManager.get_block_ids)[:2] == ["self", "request_id"]
    assert _named_params(BlockPool.get_cached_block) == [
        "self", "block_hash", "kv_cache_group_ids"
    ]


def test_the_request_hasher_the_prefix_lineage_replaces_exists():
    src = inspect.getsource(Request.__init__)
    assert "self._block_hasher" in src and "self.block_hashes" in src


def test_a_request_carried_as_new_is_built_from_vllms_own_types():
    """``carry_as_new`` rebuilds ``CachedRequestData`` field by field and ``NewRequestData`` from
    the request: both must still take what it passes."""
    fields = {f.name for f in dataclasses.fields(CachedRequestData)}
    src = inspect.getsource(hole_scheduler.carry_as_new)
    passed = {name for name in fields if f"{name}=" in src}
    assert passed == fields, f"CachedRequestData fields not carried: {fields - passed}"
    assert _named_params(NewRequestData.from_request)[:2] == ["request", "block_ids"]
    assert "uses_mrope" in inspect.signature(NewRequestData.from_request).parameters
    assert "has_sync_kv_loads" in {f.name for f in dataclasses.fields(SchedulerOutput)}


def test_the_front_end_methods_the_media_hash_tags_wrap_exist():
    """``vllm_ext/mm_hashes.py`` wraps these; were one renamed, no hash would be vouched for and
    every engine would hash its items' inputs again (correct, but slower)."""
    from vllm.multimodal.processing.inputs import ProcessorInputs
    from vllm.v1.engine.input_processor import InputProcessor

    assert _named_params(ProcessorInputs.get_mm_hashes)[:1] == ["self"]
    assert "mm_uuid_items" in {f.name for f in dataclasses.fields(ProcessorInputs)}
    assert _named_params(InputProcessor.process_inputs)[:3] == ["self", "request_id", "prompt"]
    src = inspect.getsource(InputProcessor.process_inputs)
    assert 'decoder_input["mm_hashes"]' in src and "mm_hash=base_mm_hash" in src
