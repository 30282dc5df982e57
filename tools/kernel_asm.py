"""Compiles zerofuse's Triton optimizer kernels for a GPU target without a GPU and counts their
global memory instructions by width, from the PTX (triton ships the compiler and ptxas).

Why: a streaming kernel reaches memory bandwidth only with wide (16-byte) accesses, and whether
Triton emits them depends on what its analysis can prove about pointers and masks; this is checked
on a CPU machine by tests/test_optim.py, and shown to a developer by

    python tools/kernel_asm.py [--arch 90]

which prints one JSON line per kernel variant: {"kernel", "aligned" (null for the small kernels
that take no alignment promise), "loads": {width: count}, "stores": {...}}. Must run without TRITON_INTERPRET (the interpreter's functions do not compile).
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import sys
from collections import Counter


def _variants():
    import triton.language as tl

    from zerofuse.kernels import optim as K

    fp32 = dict(P_TY=tl.float32, G_TY=tl.float32)
    yield "adam", K._adam_kernel, dict(HAS_MASTER=False, HAS_MULT=True, HAS_FOUND=True, DECOUPLED=True,
                                       MAXIMIZE=False, EMULATE_RNE=False, **fp32)
    yield "adam_bf16_master", K._adam_kernel, dict(P_TY=tl.bfloat16, G_TY=tl.bfloat16, HAS_MASTER=True,
                                                   HAS_MULT=True, HAS_FOUND=True, DECOUPLED=True,
                                                   MAXIMIZE=False, EMULATE_RNE=False)
    yield "lamb_stage1", K._lamb_stage1_kernel, dict(HAS_MASTER=False, HAS_MULT=True, HAS_FOUND=True,
                                                     BIAS_CORRECTION=True, **fp32)
    yield "lamb_stage2", K._lamb_stage2_kernel, dict(P_TY=tl.float32, HAS_MASTER=False, HAS_FOUND=True,
                                                     BIAS_CORRECTION=True, PAPER=False, EMULATE_RNE=False)
    yield "lamb_fused", K._lamb_fused_kernel, dict(HAS_MASTER=False, HAS_MULT=True, HAS_FOUND=True,
                                                   BIAS_CORRECTION=True, PAPER=False, EMULATE_RNE=False,
                                                   BLOCK_P=1024, **fp32)
    yield "lars", K._lars_kernel, dict(HAS_MASTER=False, HAS_MULT=True, HAS_FOUND=True, EMULATE_RNE=False, **fp32)
    yield "sum_squares", K._sum_squares_kernel, dict(X_TY=tl.float32)
    # small kernels without an alignment variant (aligned: null in the output): compiled, counted
    yield "segment_sum", K._segment_sum_kernel, dict(HAS_FOUND=True, WIDTH=2, BLOCK_P=1024)
    yield "clip", K._clip_kernel, dict(HAS_SCALE=True, HAS_FOUND=True, BLOCK_P=1024)


_TYPES = {"META": "*i64", "OWN": "*i32", "SCHED": "*i32", "SYNC": "*i32", "CONSTS": "*fp64", "n": "i32", "nblocks": "i32", "max_norm": "fp32"}


def compile_ptx(kernel, constexprs: dict, arch: int, num_warps: int) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(inspect.signature(kernel.fn).parameters)
    signature = {name: "constexpr" if name in constexprs else _TYPES.get(name, "*fp32") for name in names}
    src = ASTSource(kernel, signature, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps}).asm["ptx"]


def widths(ptx: str, op: str) -> dict[str, int]:
    """{"v4.b32": count, "b32": count, ...} of the ld.global / st.global instructions."""
    return dict(Counter(m.group(1) for m in re.finditer(rf"{op}\.global\.((?:v\d\.)?b\d+)", ptx)))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability as one number (90: H100)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        sys.exit("tools/kernel_asm.py: unset TRITON_INTERPRET (interpreted kernels cannot be compiled)")
    from zerofuse.kernels import optim as K

    for name, kernel, constexprs in _variants():
        aligned_variants = (True, False) if "ALIGNED" in inspect.signature(kernel.fn).parameters else (None,)
        for aligned in aligned_variants:
            more = dict(ALIGNED=aligned, BLOCK=K.BLOCK) if aligned is not None else {}
            ptx = compile_ptx(kernel, dict(constexprs, **more), args.arch, K._NUM_WARPS)
            print(json.dumps({"kernel": name, "aligned": aligned, "loads": widths(ptx, "ld"),
                              "stores": widths(ptx, "st")}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
