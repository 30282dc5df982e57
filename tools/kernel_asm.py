"""Compiles zerofuse's Triton optimizer kernels for a GPU target without a GPU and counts their
global memory instructions by width, from the PTX (triton ships the compiler and ptxas).

Why: a streaming kernel reaches memory bandwidth only with wide (16-byte) accesses, and whether
Triton emits them depends on what its analysis can prove about pointers and masks; this is checked
on a CPU machine by tests/test_optim_flat.py, and shown to a developer by

    python tools/kernel_asm.py [--arch 90]
    python tools/kernel_asm.py --attention   # the attention kernels (tile access widths)
    python tools/kernel_asm.py --norms       # the norms' one-launch backward (atomics, spills)
    python tools/kernel_asm.py --norms-wide  # whole-row vs chunked norms on wide rows (spills)
    python tools/kernel_asm.py --bias-gelu   # bias + GELU forward and backward (widths, atomics)
    python tools/kernel_asm.py --cross-entropy  # the cross-entropy row kernel (barriers, shuffles)

which prints one JSON line per kernel variant: {"kernel", "aligned" (null for the small kernels
that take no alignment promise), "loads": {width: count}, "stores": {...}, "hints": {L1 eviction
qualifier: count}, "f64" (float64 instructions), and ptxas's "registers", "spill_stores",
"spill_loads"}. Must run without TRITON_INTERPRET (the interpreter's functions do not compile).
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
    yield "sum_squares", K._sum_squares_kernel, dict(X_TY=tl.float32, HAS_MULT=False, INVERT=False)
    # the clipping pass of a loss-scaled step: the grads unscaled before their squares
    yield "sum_squares_scaled", K._sum_squares_kernel, dict(X_TY=tl.float32, HAS_MULT=True, INVERT=True)
    yield "steps", K._steps_kernel, dict(B1_AT=1, LR_AT=0, ADVANCE=True, HAS_FOUND=True, BLOCK_K=128)
    # small kernels without an alignment variant (aligned: null in the output): compiled, counted
    yield "segment_sum", K._segment_sum_kernel, dict(HAS_FOUND=True, WIDTH=2, BLOCK_P=1024)
    yield "clip", K._clip_kernel, dict(HAS_SCALE=True, HAS_FOUND=True, TORCH_RULE=True, BLOCK_P=1024)


_TYPES = {"STEPS": "*i64", "k": "i32", "META": "*i64", "OWN": "*i32", "SCHED": "*i32", "SYNC": "*i32", "CONSTS": "*fp64", "n": "i32", "nblocks": "i32", "max_norm": "fp32", "eps": "fp32",
          "mult_from": "i32"}


def compile_ptx(kernel, constexprs: dict, arch: int, num_warps: int) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(inspect.signature(kernel.fn).parameters)
    signature = {name: "constexpr" if name in constexprs else _TYPES.get(name, "*fp32") for name in names}
    src = ASTSource(kernel, signature, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps}).asm["ptx"]


def async_copies(ptx: str) -> dict[str, int]:
    """{"16B": count, ...}: cp.async global-to-shared copies by size (Triton's pipelined tile loads)."""
    sizes = re.findall(r"cp\.async\.\w+\.shared\.global \[[^\]]*\], \[[^\]]*\], (0x[0-9a-fA-F]+|\d+)", ptx)
    return dict(Counter(f"{int(n, 0)}B" for n in sizes))


def attention(arch: int) -> None:
    """The attention kernels (forward, dq, dk/dv), causal and not, bf16, compiled with a GPU tile
    config (128 x 64, 8 warps, 3 stages) and specialised as a launch specialises them (pointers
    16-byte aligned; an int argument divisible by 16 marked so: the strides, and head_dim D when it
    is, as 64 and 80 are and 72 is not): one JSON line per (kernel, causal, head_dim, documents) with
    the PTX's global load / async-copy / store widths and its loops (a compile error raises)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from zerofuse.kernels import attention as A
    from zerofuse.kernels import attention_bwd as AB

    for kernel in (A._attn_fwd_kernel, AB._attn_bwd_dq_kernel, AB._attn_bwd_dkdv_kernel):
        for causal, d, docs in ((True, 64, False), (False, 64, False), (True, 80, False), (True, 72, False),
                                (True, 64, True), (True, 128, True)):
            cx = dict(CAUSAL=causal, BLOCK_M=128, BLOCK_N=64, BLOCK_D=A._block_d(d), UPCAST=False, DOCS=docs)
            sig = {}
            for name in inspect.signature(kernel.fn).parameters:
                ints = name.startswith("s") and name != "scale" or name in ("Hq", "Hkv", "G", "Nq", "Nk", "D")
                sig[name] = ("constexpr" if name in cx else "i32" if ints else "fp32" if name in ("scale", "qk_scale")
                             else "*fp32" if name in ("LSE", "DELTA") else "*i32" if name == "DOC" else "*bf16")
            divisible = {n for n, ty in sig.items() if ty.startswith("*") or (ty == "i32" and n.startswith("s"))}
            if d % 16 == 0:
                divisible.add("D")
            attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(sig) if n in divisible}
            ptx = triton.compile(ASTSource(kernel, sig, constexprs=cx, attrs=attrs), target=GPUTarget("cuda", arch, 32),
                                 options={"num_warps": 8, "num_stages": 3}).asm["ptx"]
            print(json.dumps({"kernel": kernel.fn.__name__, "causal": causal, "head_dim": d, "documents": docs,
                              "loads": widths(ptx, "ld"), "async_copies": async_copies(ptx),
                              "stores": widths(ptx, "st"), "loops": loops(ptx)}), flush=True)


def ptxas_info(ptx: str, arch: int) -> dict[str, int]:
    """{"registers", "spill_stores", "spill_loads"} from ptxas -v on the PTX (triton's ptxas)."""
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    suffix = "a" if arch >= 90 else ""
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        out = subprocess.run([get_ptxas(arch).path, f"-arch=sm_{arch}{suffix}", "-v", src, "-o", os.path.join(d, "k.cubin")],
                             check=True, capture_output=True, text=True)
    text = out.stdout + out.stderr
    return {"registers": int(re.search(r"Used (\d+) registers", text).group(1)),
            "spill_stores": int(re.search(r"(\d+) bytes spill stores", text).group(1)),
            "spill_loads": int(re.search(r"(\d+) bytes spill loads", text).group(1))}


def norms(arch: int) -> None:
    """The norms' backward, bf16 (LayerNorm with dh, weight and bias; RMSNorm with weight), at
    widths 768 and 4096 with the launcher's tile config, in one launch (its last program sums
    the weight/bias partials: kernels/colsum.py) and two: one JSON line each with the PTX's
    loops (barriers, shuffles a pass), atomics, fences, L2 (.cg) loads of the partials, global
    access widths and ptxas's registers and spills."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from zerofuse.kernels import colsum
    from zerofuse.kernels import norms as KN

    for n in (768, 4096):
        block_m, block_n, num_warps = KN._config(n)
        sum_p, sum_n = colsum.blocks(colsum.max_parts(n, 4 * 132), n)  # an H100's 132 SMs
        for is_rms, one in ((False, True), (True, True), (False, False)):
            cx = dict(HAS_DH=not is_rms, HAS_W=True, HAS_B=not is_rms, HAS_DR=not is_rms, IS_RMS=is_rms, BLOCK_M=block_m, BLOCK_N=block_n,
                      EMULATE_RNE=False, ONE_LAUNCH=one, SUM_P=sum_p, SUM_N=sum_n)
            sig, attrs = _norm_sig(KN._norm_bwd_kernel, cx)
            ptx = triton.compile(ASTSource(KN._norm_bwd_kernel, sig, constexprs=cx, attrs=attrs),
                                 target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps}).asm["ptx"]
            print(json.dumps({"kernel": "norm_bwd", "rms": is_rms, "n": n, "one_launch": one, "loops": loops(ptx),
                              "atomics": dict(Counter(re.findall(r"atom\.[\w.]+", ptx))),
                              "l2_loads": dict(Counter(re.findall(r"ld\.global\.cg\.([\w.]+)", ptx))),
                              "loads": widths(ptx, "ld"), "stores": widths(ptx, "st"), **ptxas_info(ptx, arch)}),
                  flush=True)


def _norm_sig(kernel, cx: dict) -> tuple[dict, dict]:
    """A norm kernel's signature as a launch specialises it (bf16 tensors, fp32 statistics and
    partials, pointers and N divisible by 16) and its divisibility attributes."""
    fp32 = ("Mean", "Rstd", "DW_part", "DB_part", "DR_part", "Terms")  # (and bias_gelu's DB_part)
    sig = {}
    for name in inspect.signature(kernel.fn).parameters:
        sig[name] = ("constexpr" if name in cx else "i32" if name in ("M", "N", "rows_per_program", "n_parts")
                     else "fp32" if name == "eps" else "*i32" if name == "Counter" else "*fp32" if name in fp32
                     else "*bf16")
    return sig, {(i,): [["tt.divisibility", 16]] for i, k in enumerate(sig) if sig[k].startswith("*") or k == "N"}


def norms_wide(arch: int) -> None:
    """LayerNorm with residual, weight and bias (bf16) on wide rows: the whole-row backward at
    16384 columns and the chunked kernels (kernels/norms_wide.py) at 16384 and 65536, with the
    launchers' warps: one JSON line each with ptxas's registers and spills."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from zerofuse.kernels import norms as KN
    from zerofuse.kernels import norms_wide as KW

    bwd = dict(HAS_DH=True, HAS_W=True, HAS_B=True, HAS_DR=False, IS_RMS=False, EMULATE_RNE=False, ONE_LAUNCH=False,
               SUM_P=128, SUM_N=32)
    fwd = dict(HAS_RES=True, HAS_W=True, HAS_B=True, IS_RMS=False, EMULATE_RNE=False)
    block_m, block_n, warps = KN._config(16384)
    cases = [("norm_bwd_whole_row", 16384, KN._norm_bwd_kernel, dict(bwd, BLOCK_M=block_m, BLOCK_N=block_n), warps)]
    for n in (16384, 65536):
        cases.append(("norm_bwd_chunked", n, KW._norm_bwd_wide_kernel, dict(bwd, CHUNK=KW.CHUNK), 8))
        cases.append(("norm_fwd_chunked", n, KW._norm_fwd_wide_kernel, dict(fwd, CHUNK=KW.CHUNK), 8))
    for name, n, kernel, cx, num_warps in cases:
        sig, attrs = _norm_sig(kernel, cx)
        ptx = triton.compile(ASTSource(kernel, sig, constexprs=cx, attrs=attrs), target=GPUTarget("cuda", arch, 32),
                             options={"num_warps": num_warps}).asm["ptx"]
        print(json.dumps({"kernel": name, "n": n, "num_warps": num_warps, "loads": widths(ptx, "ld"),
                          "stores": widths(ptx, "st"), **ptxas_info(ptx, arch)}), flush=True)


def bias_gelu(arch: int) -> None:
    """kernels/bias_gelu.py (bf16, 4 x 1024 tiles, 4 warps, pointers and widths divisible by 16): the
    forward, the backward and the plain column sum (GELU=False) in one launch and in two, one JSON
    line each with access widths, atomics and ptxas's registers and spills."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from zerofuse.kernels import bias_gelu as KB

    tiles = dict(BLOCK_M=4, BLOCK_N=1024, EMULATE_RNE=False)
    cases = [("bias_gelu_fwd", None, KB._bias_gelu_fwd_kernel, tiles)]
    for one in (True, False):
        cases.append(("bias_gelu_bwd", one, KB._bias_gelu_bwd_kernel, dict(tiles, ONE_LAUNCH=one, SUM_P=128, SUM_N=32)))
        cases.append(("column_sum", one, KB._bias_gelu_bwd_kernel,
                      dict(tiles, ONE_LAUNCH=one, SUM_P=128, SUM_N=32, GELU=False)))
    for name, one, kernel, cx in cases:
        sig, attrs = _norm_sig(kernel, cx)
        ptx = triton.compile(ASTSource(kernel, sig, constexprs=cx, attrs=attrs), target=GPUTarget("cuda", arch, 32),
                             options={"num_warps": 4}).asm["ptx"]
        print(json.dumps({"kernel": name, "one_launch": one, "loads": widths(ptx, "ld"), "stores": widths(ptx, "st"),
                          "atomics": dict(Counter(re.findall(r"atom\.[\w.]+", ptx))), **ptxas_info(ptx, arch)}),
              flush=True)


def cross_entropy(arch: int) -> None:
    """kernels/cross_entropy.py's row kernel as the fused linear cross-entropy launches it for a
    GPT-2 vocabulary of 50304 (bf16 logits, BLOCK_V 4096, 8 warps, statistics and gradient in one launch),
    with and without label smoothing: one JSON line each with the CTA barriers (each cross-warp
    reduction takes barriers; the vocabulary loop runs 13 times a row at 50304), warp shuffles,
    access widths and ptxas's registers and spills."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from zerofuse.kernels import cross_entropy as KC

    kernel = KC._ce_kernel
    params = inspect.signature(kernel.fn).parameters
    for smoothing in (False, True):
        cx = dict(STATS=True, GRAD=True, HAS_SOFTCAP=False, BLOCK_V=4096, EMULATE_RNE=False)
        if "HAS_SMOOTHING" in params:
            cx["HAS_SMOOTHING"] = smoothing
        ints = ("stride_z", "stride_t", "V", "V_total", "vocab_start")
        sig = {n: ("constexpr" if n in cx else "i32" if n in ints else "fp32" if n in ("smoothing", "z_loss", "softcap")
                   else "*i64" if n == "Target" else "*bf16" if n == "Z" else "*fp32") for n in params}
        # as a launch specialises them at 50304 (a multiple of 16): pointers, the row stride, V, V_total
        attrs = {(i,): [["tt.divisibility", 16]] for i, k in enumerate(sig)
                 if sig[k].startswith("*") or k in ("stride_z", "V", "V_total")}
        ptx = triton.compile(ASTSource(kernel, sig, constexprs=cx, attrs=attrs), target=GPUTarget("cuda", arch, 32),
                             options={"num_warps": 8}).asm["ptx"]
        print(json.dumps({"kernel": "ce", "smoothing": smoothing, "barriers": len(re.findall(r"\bbar\.sync\b", ptx)),
                          "shuffles": len(re.findall(r"\bshfl\.", ptx)), "loops": loops(ptx), "loads": widths(ptx, "ld"),
                          "stores": widths(ptx, "st"), **ptxas_info(ptx, arch)}), flush=True)


def loops(ptx: str) -> list[dict[str, int]]:
    """Per loop of the PTX (a label and the branch back to it), in order: its instructions'
    "barriers" (bar.sync), "shuffles" (shfl) and "exp2" (ex2) counts, those of one iteration."""
    lines = ptx.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^\s*(\$L__\w+):", line))}
    out = []
    for i, line in enumerate(lines):
        m = re.search(r"\bbra(?:\.uni)?\s+(\$L__\w+);", line)
        if m and labels.get(m.group(1), i) < i:
            body = "\n".join(lines[labels[m.group(1)]:i + 1])
            out.append({"barriers": len(re.findall(r"\bbar\.sync\b", body)),
                        "shuffles": len(re.findall(r"\bshfl\.", body)), "exp2": len(re.findall(r"\bex2\.", body))})
    return out


def widths(ptx: str, op: str) -> dict[str, int]:
    """{"v4.b32": count, "b32": count, ...} of the ld.global / st.global instructions, with or
    without cache qualifiers (ld.global.L1::evict_first.L2::cache_hint.v4.b32 counts as v4.b32)."""
    return dict(Counter(m.group(1) for m in re.finditer(rf"\b{op}\.global(?:\.[\w:]+?)*?\.((?:v\d\.)?b\d+)\b", ptx)))


def hints(ptx: str) -> dict[str, int]:
    """{"evict_first": count, ...}: the L1 eviction qualifiers of global loads and stores."""
    return dict(Counter(re.findall(r"\b(?:ld|st)\.global[\w.:]*?\.L1::(\w+)", ptx)))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability as one number (90: H100)")
    modes = {"attention": (attention, "the attention kernels"), "norms": (norms, "the norms' backward"),
             "norms_wide": (norms_wide, "whole-row vs chunked norms on wide rows"),
             "bias_gelu": (bias_gelu, "the bias + GELU kernels"),
             "cross_entropy": (cross_entropy, "the cross-entropy row kernel")}
    for name, (_, what) in modes.items():
        parser.add_argument("--" + name.replace("_", "-"), action="store_true", help=f"{what} instead")
    args = parser.parse_args(argv)
    from zerofuse import kernels

    if kernels.interpreted():  # (any value Triton takes for it: 1, true, on, yes)
        sys.exit("tools/kernel_asm.py: unset TRITON_INTERPRET (interpreted kernels cannot be compiled)")
    for name, (run, _) in modes.items():
        if getattr(args, name):
            run(args.arch)
            return 0
    from zerofuse.kernels import optim as K

    for name, kernel, constexprs in _variants():
        aligned_variants = (True, False) if "ALIGNED" in inspect.signature(kernel.fn).parameters else (None,)
        for aligned in aligned_variants:
            more = dict(ALIGNED=aligned, BLOCK=K.BLOCK) if aligned is not None else {}
            ptx = compile_ptx(kernel, dict(constexprs, **more), args.arch, K._NUM_WARPS)
            print(json.dumps({"kernel": name, "aligned": aligned, "loads": widths(ptx, "ld"), "stores": widths(ptx, "st"),
                              "hints": hints(ptx), "f64": len(re.findall(r"\.f64\b", ptx)), **ptxas_info(ptx, args.arch)}),
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
