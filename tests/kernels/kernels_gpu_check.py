"""Compiled Triton kernels on a CUDA device vs the torch reference on the CPU.

Run by ``test_kernels_gpu.py`` in a fresh process: the interpreter flag the other kernel tests set
would otherwise turn these kernels into interpreted ones. Exits non-zero on the first mismatch.
"""

from __future__ import annotations

import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
from kernels_testlib import assert_ulp_close, make_spec  # noqa: E402
from orbitkv.kernels.paged import gather_chunk, load_chunk  # noqa: E402
from orbitkv.kernels.patch import apply_patch  # noqa: E402
from orbitkv.kernels.relocate import relocate  # noqa: E402


def _check(got_cuda: torch.Tensor, want_cpu: torch.Tensor, what: str, patch_scale: float = 0.0):
    ulps = 0.0 if want_cpu.dtype == torch.float32 else 1.0
    # GPU FMA contraction and dot ordering differ from torch at the fp32 level.
    atol = 16 * torch.finfo(torch.float32).eps * (4.0 + patch_scale)
    assert_ulp_close(got_cuda.cpu(), want_cpu, ulps=max(ulps, 1.0), atol=atol, msg=what)


def main() -> int:
    torch.manual_seed(0)
    dev = torch.device("cuda")
    for dtype in (torch.float32, torch.bfloat16):
        for spec, shape in ((make_spec("neox", 128, 128), (300, 4, 128)),
                            (make_spec("gptj", 128, 64), (300, 4, 128)),
                            (make_spec("gptj", 576, 64, rope_offset=512), (300, 576))):
            k = torch.randn(shape).to(dtype)
            delta = torch.randint(-5000, 5000, (shape[0],))
            _check(relocate(k.to(dev), delta.to(dev), spec), relocate(k, delta, spec),
                   f"relocate {spec.style} {dtype}")
        x = torch.randn(300, 512).to(dtype)
        u, w = torch.randn(300, 64), torch.randn(64, 512) / 8
        _check(apply_patch(x.to(dev), u.to(dev), w.to(dev)), apply_patch(x, u, w),
               f"apply_patch {dtype}", patch_scale=float((u.abs() @ w.abs()).max()))
        for layout, cache in (("flash", torch.randn(40, 2, 16, 4, 128)),
                              ("cpu_vec", torch.randn(20, 4, 32, 256)),
                              ("mla", torch.randn(40, 16, 576))):
            cache = cache.to(dtype)
            n = 300
            is_mla = layout == "mla"
            k = torch.randn((n, 576) if is_mla else (n, 4, 128)).to(dtype)
            v = None if is_mla else torch.randn(n, 4, 128).to(dtype)
            spec = make_spec("gptj", 576, 64, rope_offset=512) if is_mla else make_spec("neox", 128, 128)
            f = k[0].numel()
            pk = (torch.randn(n, 16), torch.randn(16, f) / 8)
            pv = None if is_mla else (torch.randn(n, 16), torch.randn(16, f) / 8)
            slots = torch.randperm(cache.shape[0] * (16 if layout != "cpu_vec" else 32))[:n]
            want = cache.clone()
            load_chunk(want, slots, layout, k, v, spec=spec, delta=77, patch_k=pk, patch_v=pv)
            got = cache.to(dev)

            def on_dev(p):
                return None if p is None else (p[0].to(dev), p[1].to(dev))

            load_chunk(got, slots.to(dev), layout, k.to(dev), None if v is None else v.to(dev),
                       spec=spec, delta=77, patch_k=on_dev(pk), patch_v=on_dev(pv))
            _check(got, want, f"load_chunk {layout} {dtype}", patch_scale=4.0)
            back, _ = gather_chunk(got, slots.to(dev), layout)
            ref, _ = gather_chunk(got.cpu(), slots, layout)
            assert torch.equal(back.cpu(), ref), f"gather_chunk {layout} {dtype}"
    print("gpu check ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
