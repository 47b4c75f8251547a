"""Bad caches and bad load arguments fail with an error that names the problem."""

from __future__ import annotations

import pytest
import torch
from kernels_testlib import make_spec
from orbitkv.kernels.paged import PagedLayout, check_cache, gather_chunk, load_chunk

NB, BS, H, D = 2, 32, 2, 16


def _vec_cache(dtype=torch.float32):
    return torch.zeros(NB, H, BS, 2 * D, dtype=dtype)


@pytest.mark.parametrize(
    "call, error, words",
    [
        (lambda: check_cache(_vec_cache(), "amx"), ValueError, "amx"),
        (lambda: check_cache(_vec_cache(), PagedLayout.CPU_VEC, isa="amx"), ValueError, "amx"),
        (lambda: check_cache(_vec_cache(), PagedLayout.CPU_VEC, isa="neon"), ValueError, "neon"),
        (lambda: check_cache(_vec_cache(), PagedLayout.FLASH, isa="vec"), ValueError, "isa"),
        (lambda: check_cache(_vec_cache(torch.float8_e4m3fn), "cpu_vec"), TypeError, "fp8"),
        (lambda: check_cache(_vec_cache().to(torch.uint8), "cpu_vec"), TypeError, "integer"),
        (lambda: check_cache(_vec_cache(), "paged_attention"), ValueError, "unknown paged layout"),
        (lambda: check_cache(_vec_cache(), 3), TypeError, "layout"),
        (lambda: check_cache(_vec_cache(), "cpu_vec", num_kv_heads=4), ValueError, "num_kv_heads=2"),
        (lambda: check_cache(_vec_cache(), "cpu_vec", head_dim=32), ValueError, "head_dim=16"),
        (lambda: check_cache(_vec_cache(), "cpu_vec", block_size=16), ValueError, "block_size=32"),
        (lambda: check_cache(_vec_cache(), "cpu_vec", dtype=torch.bfloat16), TypeError, "dtype"),
        (lambda: check_cache(torch.zeros(NB, H, BS, 2 * D + 1), "cpu_vec"), ValueError, "2*D"),
        (lambda: check_cache(torch.zeros(NB, 3, BS, H, D), "flash"), ValueError, "dim 1 == 2"),
        (lambda: check_cache(torch.zeros(NB, BS, H, D), "mla"), ValueError, "MLA cache"),
        (lambda: check_cache(torch.zeros(NB, BS, H, 2 * D).transpose(1, 2), "cpu_vec"),
         ValueError, "contiguous"),
        (lambda: check_cache([1, 2], "flash"), TypeError, "torch.Tensor"),
    ],
)
def test_check_cache_errors(call, error, words):
    with pytest.raises(error) as info:
        call()
    assert words in str(info.value)


def test_check_cache_accepts_good_caches():
    check_cache(_vec_cache(), "vec", num_kv_heads=H, head_dim=D, block_size=BS,
                dtype=torch.float32, isa="vec")
    views = check_cache(torch.zeros(NB, 2, BS, H, D), PagedLayout.FLASH, num_kv_heads=H, head_dim=D)
    assert views.num_slots == NB * BS
    mla = check_cache(torch.zeros(NB, BS, 40), "mla", num_kv_heads=1, head_dim=40)
    assert mla.v is None


def _args(**over):
    n = 5
    args = dict(cache=_vec_cache(), slot_mapping=torch.arange(n), layout="cpu_vec",
                k=torch.randn(n, H, D), v=torch.randn(n, H, D))
    args.update(over)
    return args


def _load(**over):
    a = _args(**over)
    extra = {key: a.pop(key) for key in ("spec", "delta", "patch_k", "patch_v", "backend") if key in a}
    load_chunk(a["cache"], a["slot_mapping"], a["layout"], a["k"], a["v"], **extra)


@pytest.mark.parametrize(
    "over, error, words",
    [
        (dict(k=torch.randn(5, H, 8), v=torch.randn(5, H, 8)), ValueError, "[N, 2, 16]"),
        (dict(k=torch.randn(5, H, D).bfloat16()), TypeError, "cache dtype"),
        (dict(v=None), ValueError, "need v"),
        (dict(v=torch.randn(5, H, D).double()), TypeError, "dtype"),
        (dict(v=torch.randn(4, H, D)), ValueError, "must match k"),
        (dict(slot_mapping=torch.arange(5, dtype=torch.int32)), TypeError, "int64"),
        (dict(slot_mapping=torch.arange(6)), ValueError, "6 slots for 5 tokens"),
        (dict(slot_mapping=torch.arange(5)[:, None]), ValueError, "1-D"),
        (dict(slot_mapping=torch.tensor([0, 1, 2, 3, NB * BS])), ValueError, "past the cache end"),
        (dict(slot_mapping=torch.tensor([0, 1, 2, 1, 4])), ValueError, "repeats a slot"),
        (dict(delta=3), ValueError, "RopeSpec"),
        (dict(delta=3, spec=make_spec("neox", 32, 32)), ValueError, "head_dim"),
        (dict(delta=0, spec=make_spec("neox", 32, 32)), ValueError, "head_dim"),
        (dict(delta=torch.arange(3), spec=make_spec("neox", D, D)), ValueError, "[N]"),
        (dict(patch_k=(torch.randn(5, 2), torch.randn(2, 31))), ValueError, "F=32"),
        (dict(patch_v=torch.randn(5, 2)), TypeError, "(u, w) pair"),
        (dict(cache=torch.zeros(NB, BS, 40), layout="mla", k=torch.randn(5, 40)), ValueError,
         "v=None"),
        (dict(backend="cuda"), ValueError, "backend"),
    ],
)
def test_load_chunk_errors(over, error, words):
    with pytest.raises(error) as info:
        _load(**over)
    assert words in str(info.value)


def test_failed_load_writes_nothing():
    cache = _vec_cache()
    with pytest.raises(ValueError):
        _load(cache=cache, slot_mapping=torch.tensor([0, 1, 2, 3, NB * BS]))
    assert not cache.any()


def test_gather_errors():
    with pytest.raises(ValueError, match="past the cache end"):
        gather_chunk(_vec_cache(), torch.tensor([NB * BS]), "cpu_vec")
    with pytest.raises(TypeError, match="int64"):
        gather_chunk(_vec_cache(), torch.tensor([0.0]), "cpu_vec")
