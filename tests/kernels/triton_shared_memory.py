"""Compile OrbitKV's Triton kernels for NVIDIA targets ahead of time (no GPU needed: Triton's
own ``ptxas``) and print each launch configuration's shared memory, as JSON.

Run in a fresh process without ``TRITON_INTERPRET`` (an interpreted kernel cannot be compiled).
Each case is a configuration the wrappers really launch: its ``BLOCK_*`` and ``num_stages`` come
from the wrappers' own constants and ``patch_tiling``. Pointer dtypes are the widest a caller
passes (fp32 patch factors, as ``bench kernels`` uses), so the figure is an upper bound.
"""

from __future__ import annotations

import json
import sys

import triton
from orbitkv.kernels import paged_triton, patch_triton, relocate_triton
from triton.backends.compiler import GPUTarget

POINTER_DTYPES = {"slot_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32",
                  "uk_ptr": "*fp32", "wk_ptr": "*fp32", "uv_ptr": "*fp32", "wv_ptr": "*fp32",
                  "u_ptr": "*fp32", "w_ptr": "*fp32"}

# innermost strides, 1 in every real launch (Triton specialises a 1 into a constant)
UNIT_STRIDES = {"stride_kd", "stride_vd", "stride_kcd", "stride_vcd", "stride_ukm", "stride_uvm",
                "stride_wkf", "stride_wvf", "stride_um", "stride_wf"}


def compile_shared_nbytes(fn, constexprs: dict, num_stages: int, capability: int) -> int:
    signature, values = {}, {}
    for index, param in enumerate(fn.params):
        if param.is_constexpr:
            signature[param.name] = "constexpr"
            values[(index,)] = constexprs[param.name]
        elif param.name.endswith("_ptr"):
            signature[param.name] = POINTER_DTYPES.get(param.name, "*bf16")
        elif param.name in UNIT_STRIDES:
            signature[param.name] = "constexpr"
            values[(index,)] = 1
        else:
            signature[param.name] = "i32"
    src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=values)
    kernel = triton.compile(src, target=GPUTarget("cuda", capability, 32),
                            options={"num_stages": num_stages})
    return int(kernel.metadata.shared)


def cases():
    rope = {"ROPE_OFFSET": 0, "IS_NEOX": True, "HAS_ROPE": True}
    for head_dim, has_v, rot in ((128, True, 128), (256, True, 256), (576, False, 64)):
        block_d = max(16, paged_triton.next_pow2(head_dim))
        tiling = paged_triton.patch_tiling(block_d)
        yield (f"load D={head_dim} patched", paged_triton._load_kernel, {
            **rope, "ROT_DIM": rot, "BLOCK_N": paged_triton.BLOCK_TOKENS, "BLOCK_D": block_d,
            "BLOCK_M": tiling["BLOCK_M"], "HAS_V": has_v, "HAS_PATCH_K": True,
            "HAS_PATCH_V": has_v, "IS_FULL_BAND": rot == head_dim,
            "IS_EVEN_D": head_dim == block_d}, tiling["num_stages"])
    yield ("apply_patch", patch_triton._apply_patch_kernel, {
        "BLOCK_N": patch_triton.BLOCK_ROWS, "BLOCK_F": patch_triton.BLOCK_COLS,
        "BLOCK_M": patch_triton.BLOCK_RANK}, 3)
    for head_dim, rot in ((576, 64), (128, 128)):
        yield (f"relocate D={head_dim}", relocate_triton._relocate_kernel, {
            **rope, "ROT_DIM": rot, "BLOCK_N": relocate_triton.BLOCK_TOKENS,
            "BLOCK_D": max(16, paged_triton.next_pow2(head_dim)),
            "IS_FULL_BAND": rot == head_dim, "IS_EVEN_D": rot == head_dim}, 3)


def main(capabilities: list[int]) -> None:
    rows = [{"case": name, "capability": cc, "shared_nbytes": compile_shared_nbytes(fn, cx, ns, cc)}
            for name, fn, cx, ns in cases() for cc in capabilities]
    print(json.dumps(rows))


if __name__ == "__main__":
    main([int(x) for x in sys.argv[1:]] or [80, 90])
