"""CPU_AMX caches (vLLM's CPU backend, bf16 on CPUs with AMX tiles): the packed layout against vLLM's
own ``amx`` writer, loads with relocation and patch byte-equal to the same load into a CPU_VEC cache,
and gathers that invert them. Packing is plain data movement: where vLLM's op refuses to pack (a
build without its CPU ops), the tests skip."""

from __future__ import annotations

import pytest
import torch
from kernels_testlib import make_spec
from orbitkv.kernels.paged import PagedLayout, check_cache, gather_chunk, load_chunk

NB, BS, H, D = 4, 32, 2, 64
DT = torch.bfloat16


def _vllm_op():
    from orbitkv.kernels._common import vllm_amx_writer

    op = vllm_amx_writer()  # probed once: a one-token amx write
    if op is None:
        pytest.skip("vLLM's CPU op does not pack amx caches here (no AMX, or no CPU ops)")
    return op


@pytest.fixture(autouse=True)
def _needs_vllm_amx_writer():
    _vllm_op()


def _cache(seed=0, nb=NB, bs=BS):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(nb, H, bs, 2 * D, generator=g).to(DT)


def _chunk(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, H, D, generator=g).to(DT), torch.randn(n, H, D, generator=g).to(DT))


def _slots(case: str) -> torch.Tensor:
    if case == "whole_blocks":
        return torch.cat([torch.arange(2 * BS, 3 * BS), torch.arange(0, BS)])
    if case == "partial":
        return torch.arange(BS - 5, 2 * BS + 7)
    if case == "scattered":
        return torch.randperm(NB * BS, generator=torch.Generator().manual_seed(3))[:45]
    return torch.tensor([5, -1, 40, 41, -1, 100])  # padded


SLOT_CASES = ["whole_blocks", "partial", "scattered", "padded"]


@pytest.mark.parametrize("case", SLOT_CASES)
def test_reference_writes_what_vllm_writes(case):
    """The packed views put every token where vLLM's own ``amx`` writer puts it, and nothing else."""
    op = _vllm_op()
    slots = _slots(case)
    k, v = _chunk(slots.shape[0])
    ours, theirs = _cache(), _cache()
    load_chunk(ours, slots, PagedLayout.CPU_AMX, k, v, backend="torch")
    kc, vc = theirs.view(NB, H, 2 * BS, D).chunk(2, dim=2)
    op(k, v, kc, vc, slots, "amx", k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
    assert torch.equal(ours.view(torch.int16), theirs.view(torch.int16))


@pytest.mark.parametrize("case", SLOT_CASES)
@pytest.mark.parametrize("is_patched", [False, True])
def test_load_equals_the_same_load_into_a_vec_cache(case, is_patched):
    """Relocated (+ patched) tokens carry the bytes the CPU_VEC path writes; gather reads them back."""
    slots = _slots(case)
    n = slots.shape[0]
    k, v = _chunk(n)
    spec = make_spec("neox", D, D // 2)
    g = torch.Generator().manual_seed(7)
    patch_k = (torch.randn(n, 4, generator=g), torch.randn(4, H * D, generator=g) * 0.01) if is_patched else None
    patch_v = (torch.randn(n, 4, generator=g), torch.randn(4, H * D, generator=g) * 0.01) if is_patched else None
    amx, vec = _cache(), _cache()
    kw = dict(spec=spec, delta=37, patch_k=patch_k, patch_v=patch_v)
    load_chunk(amx, slots, PagedLayout.CPU_AMX, k, v, **kw)
    load_chunk(vec, slots, PagedLayout.CPU_VEC, k, v, **kw)
    ref = _cache()
    load_chunk(ref, slots, PagedLayout.CPU_AMX, k, v, backend="torch", **kw)
    assert torch.equal(amx.view(torch.int16), ref.view(torch.int16)), "vLLM's writer != reference"
    got_k, got_v = gather_chunk(amx, slots, PagedLayout.CPU_AMX)
    want_k, want_v = gather_chunk(vec, slots, PagedLayout.CPU_VEC)
    assert torch.equal(got_k.view(torch.int16), want_k.view(torch.int16))
    assert torch.equal(got_v.view(torch.int16), want_v.view(torch.int16))
    if case == "padded":
        assert not got_k[slots < 0].any() and not got_v[slots < 0].any()


def test_untouched_tokens_keep_their_bytes():
    slots = _slots("partial")
    before = _cache()
    after = before.clone()
    load_chunk(after, slots, PagedLayout.CPU_AMX, *_chunk(slots.shape[0]))
    everything = torch.arange(NB * BS)
    others = everything[~torch.isin(everything, slots)]
    old = gather_chunk(before, others, PagedLayout.CPU_AMX)
    new = gather_chunk(after, others, PagedLayout.CPU_AMX)
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(old, new, strict=True))


@pytest.mark.parametrize(
    "cache, words",
    [
        (_cache().float(), "bf16"),
        (torch.zeros(NB, H, 16, 2 * D, dtype=DT), "multiples of 32"),
        (torch.zeros(NB, H, BS, 2 * 16, dtype=DT), "head_dim=16"),
    ],
)
def test_caches_vllm_never_packs_are_refused(cache, words):
    with pytest.raises(ValueError, match=words):
        check_cache(cache, "amx")


def test_isa_names_its_layout():
    assert check_cache(_cache(), PagedLayout.CPU_AMX, isa="amx", head_dim=D).block_size == BS
    with pytest.raises(ValueError, match="cpu_amx"):
        check_cache(_cache(), PagedLayout.CPU_VEC, isa="amx")
    with pytest.raises(ValueError, match="Triton"):
        slots = _slots("partial")
        load_chunk(_cache(), slots, PagedLayout.CPU_AMX, *_chunk(slots.shape[0]), backend="triton")


def test_gather_from_a_strided_cache():
    """A cache that is a view into a larger buffer (not what vLLM allocates) still reads right."""
    slots = _slots("scattered")
    k, v = _chunk(slots.shape[0])
    base = torch.zeros(NB, H + 1, BS, 2 * D, dtype=DT)
    strided = base[:, 1:]
    load_chunk(strided, slots, PagedLayout.CPU_AMX, k, v, backend="torch")
    plain = _cache()
    load_chunk(plain, slots, PagedLayout.CPU_AMX, k, v, backend="torch")
    got, want = gather_chunk(strided, slots, PagedLayout.CPU_AMX), gather_chunk(plain, slots, PagedLayout.CPU_AMX)
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(got, want, strict=True))
    assert torch.equal(got[0].view(torch.int16), k.view(torch.int16))
