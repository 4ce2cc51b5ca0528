"""Instructions per weight in the main loop of the dequant-GEMVs (models/kernels/cuda/qlinear.py;
qplanar.py's for INT4P, Q4KP, Q5KP and Q6KP, AWQ/GPTQ and K-quant weights repacked; fp8.py's for FP8),
read from its sm_90 SASS: a measure of the kernel's arithmetic that needs no GPU.

    python bench/sass_loop.py [--n 10240] [--k 5120] [--config 4x4x1024] [--fp8-form f16] [FORMAT ...]

Needs Triton (its ptxas and nvdisasm compile and disassemble for Hopper; no device). For each
format, compiles `_qgemv_kernel` as `gemv` would launch it on an [n, k] weight (plain input, no
norm, bias or SwiGLU), finds the main loop (the longest backward branch) and prints its
instructions per thread, the weights a program decodes per iteration, instructions per weight
(loop instructions x threads / weights), the loop's global loads, the kernel's registers a thread
(cuobjdump: 64 Ki registers an SM, so REG:228 leaves room for 8 warps, REG:111 for 18), and its
commonest opcodes.

Why it matters: an H200 issues ~3.3e13 thread-instructions a second (132 SMs x 4 schedulers x 32
lanes x 1.98 GHz), and its bandwidth delivers ~8.6e12 4-bit weights a second, so a 4-bit GEMV
bound by bandwidth can afford ~4 instructions a weight, all of them issuing. BAR/LDS/STS in the
loop are layout conversions through shared memory (each a barrier for the program's warps).
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

ADDR = re.compile(r"/\*([0-9a-f]{4,})\*/")



def weight(fmt: str, n: int, k: int):
    """A random [n, k] QWeight of `fmt` on the CPU (GGUF types, AWQ for INT4, FP8), as the loaders
    and bench/shapes.py build them: the strides the kernel is launched with are its own."""
    import torch

    from models.formats import gguf_blocks
    from models.quant import layers as quant
    from shapes import _GGUF_SCALES, _random_blocks, random_quant_linear
    gen = torch.Generator().manual_seed(0)
    if fmt in ("INT4", "AWQ", "FP8"):
        return random_quant_linear("AWQ" if fmt == "INT4" else fmt, n, k, "cpu", gen).qweight()
    if fmt not in _GGUF_SCALES:
        raise SystemExit(f"no random weight for {fmt!r} (formats: {', '.join(sorted(_GGUF_SCALES))}, INT4, FP8)")
    return quant.BlockLinear(_random_blocks(fmt, n, k, "cpu", gen), gguf_blocks.TYPES[fmt]).qweight()


def compile_sass(fmt: str, n: int, k: int, bn: int, warps: int, most: int, int8: bool = False) -> tuple[str, int]:
    """(the SASS text, weights a program decodes per iteration of its main loop), for the launch
    qlinear.gemv makes on that weight (its constants, and the integer arguments the launcher
    specializes as divisible by 16)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from models.kernels.cuda import qlinear
    if fmt in PLANAR:
        return _compile_planar(fmt, n, k, bn, warps, most, int8=int8)
    if fmt == "FP8":
        return _compile_fp8(n, k, bn, warps, most)
    qw = weight(fmt, n, k)
    whole = qlinear.launch_config(qw, config=(bn, warps, most))[3]
    (sc, z, stride_s), const = qlinear._args(qw, most, whole=whole)
    dtype = {"float8_e4m3fn": "fp8e4nv", "uint8": "u8", "float16": "fp16", "float32": "fp32"}
    sig = dict(x="*bf16", w="*" + dtype[str(qw.data.dtype).split(".")[1]], sc_ptr="*" + dtype[str(sc.dtype).split(".")[1]],
               z_ptr="*" + dtype[str(z.dtype).split(".")[1]], bias="*bf16", out="*bf16", N="i32", K="i32",
               stride_w="i32", stride_s="i32", res="*bf16", norm_w="*bf16", sum_out="*bf16", eps="fp32")
    const.update(HAS_BIAS=False, SWIGLU=False, NORM=False, HAS_RES=False, STEPS=triton.cdiv(qw.k, const["W"]),
                 BLOCK_N=bn, PDL=True)
    ints = dict(N=qw.n, K=qw.k, stride_w=qw.data.stride(0), stride_s=stride_s)
    names = list(sig)  # pointers are 16-byte aligned (torch's allocations); ints where they divide
    aligned = ["x", "w", "sc_ptr", "z_ptr", "out"] + [x for x, v in ints.items() if v % 16 == 0]
    attrs = {(names.index(x),): [["tt.divisibility", 16]] for x in aligned}
    src = ASTSource(fn=qlinear._qgemv_kernel, signature={**sig, **{c: "constexpr" for c in const}}, constexprs=const,
                    attrs=attrs)
    cubin = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps)).asm["cubin"]
    return _disassemble(cubin), const["W"] * bn


# qplanar.py's layouts: the stored format of the random weight each is repacked from, and the repack
PLANAR = {"INT4P": ("INT4", "repack_int4p"), "Q4KP": ("Q4_K", "repack_q4k"), "Q5KP": ("Q5_K", "repack_q5k"),
          "Q6KP": ("Q6_K", "repack_q6k")}


def _compile_planar(fmt: str, n: int, k: int, rows: int, warps: int, kw: int, split: int = 1,
                    int8: bool = False) -> tuple[str, int]:
    """qplanar.py's GEMV on the `fmt` repack of a random [n, k] weight (PLANAR: INT4P of AWQ's,
    Q4KP of Q4_K's, Q5KP of Q5_K's, Q6KP of Q6_K's), its loop with or without the read ahead as
    qplanar.PREFETCH has it (config: rows a program, num_warps, words a step); int8: on
    quantize_input's int8 inputs."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from models.quant import planar
    from models.kernels.cuda import qplanar
    stored, repack = PLANAR[fmt]
    pw = getattr(planar, repack)(weight(stored, n, k))
    z = pw.zeros if pw.zeros is not None else pw.scales
    sig = dict(x="*i32" if int8 else "*bf16", w="*i32", aux="*fp16", aux2="*u8",
               bias="*bf16", out="*bf16", part="*fp32", idx="*i64", N="i32", rows_e="i32", stride_x="i32",
               stride_w="i32", stride_a="i32", stride_z="i32")
    const = dict(G=pw.group, KW=kw, STEPS=k // 8 // kw, BLOCKS=rows // qplanar.R, SPLIT=split, EXPERTS=False,
                 PARTIAL=split > 1, FMT=qplanar.FMTS[fmt],
                 HAS_BIAS=False, SWIGLU=False, A8=int8, PREFETCH=qplanar.PREFETCH[fmt],
                 PAIRS=qplanar.pairs_for(fmt), PDL=True, INTERPRETED=False)
    ints = dict(N=n, stride_w=pw.data.stride(0), stride_a=pw.scales.stride(0), stride_z=z.stride(0))
    names = list(sig)
    aligned = ["x", "w", "aux", "aux2", "out", "part"] + [x for x, v in ints.items() if v % 16 == 0]
    attrs = {(names.index(x),): [["tt.divisibility", 16]] for x in aligned}
    src = ASTSource(fn=qplanar._planar_gemv_kernel, signature={**sig, **{c: "constexpr" for c in const}},
                    constexprs=const, attrs=attrs)
    cubin = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps)).asm["cubin"]
    return _disassemble(cubin), rows * kw * 8


def _compile_runs(fmt: str, n: int, k: int, bn: int, warps: int, prefetch: int = 1,
                  int8: bool = True) -> tuple[str, int]:
    """qruns.py's GEMV (the runs: INT4 as AWQ stores it, Q4KR of Q4_K's, Q50R / Q51R of Q5_0's /
    Q5_1's) on a random [n, k] weight (config: BN rows a program, num_warps, PREFETCH 0/1); int8:
    on quantize_input's input."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from models.formats import gguf_blocks
    from models.quant import layers as quant, runs
    from models.kernels.cuda import qruns
    if fmt in runs.REPACKED:  # (from the GGUF type repacked into it, by the loader's table)
        ggml = {"Q4KR": "Q4_K", **{layout: t for t, layout in runs.FIVE_BIT.items()}}[fmt]
        pw = quant.BlockLinear.repack_for(gguf_blocks.TYPES[ggml], True, True)[0](weight(ggml, n, k))
    else:
        pw = weight("INT4", n, k)
    aux, aux2, sa, sz = qruns._aux(pw)
    dt = {torch_name: tri for torch_name, tri in (("float16", "fp16"), ("uint8", "u8"), ("int32", "i32"),
                                                  ("int16", "i16"))}
    sig = dict(x="*i32" if int8 else "*bf16", w="*i32", aux="*" + dt[str(aux.dtype).split(".")[1]],
               aux2="*" + dt[str(aux2.dtype).split(".")[1]], bias="*bf16", out="*bf16", N="i32", stride_w="i32",
               stride_a="i32", stride_z="i32", q8="*i32", sync="*i32")
    runs_n, c = k // 32, 32 * warps
    const = dict(G=pw.group, RUNS=runs_n, BN=bn, C=c, STEPS=-(-runs_n // c), EVEN=runs_n % c == 0,
                 FMT=qruns.FMTS[pw.fmt], A8=int8, HAS_BIAS=False, SWIGLU=False, PREFETCH=bool(prefetch), Q8=False,
                 PDL=True, INTERPRETED=False)
    ints = dict(N=n, stride_w=k // 8, stride_a=sa, stride_z=sz)
    names = list(sig)
    aligned = ["x", "w", "aux", "aux2", "out"] + [x for x, v in ints.items() if v % 16 == 0]
    attrs = {(names.index(x),): [["tt.divisibility", 16]] for x in aligned}
    src = ASTSource(fn=qruns._runs_gemv_kernel, signature={**sig, **{c: "constexpr" for c in const}},
                    constexprs=const, attrs=attrs)
    cubin = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps)).asm["cubin"]
    return _disassemble(cubin), bn * c * 32


def _compile_fp8(n: int, k: int, bn: int, nb: int, warps: int) -> tuple[str, int]:
    """fp8.py's GEMV on an [n, k] FP8 weight of 128-row scales (config: BLOCK_N, 128-weight
    blocks a step, num_warps)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from models.kernels.cuda import fp8
    qw = weight("FP8", n, k)
    sig = dict(x="*bf16", w="*fp8e4nv", sc="*fp32", bias="*bf16", out="*bf16", N="i32", K="i32", stride_w="i32",
               stride_s="i32", res="*bf16", norm_w="*bf16", sum_out="*bf16", eps="fp32")
    const = dict(GROUP=qw.group, ROW_SCALES=qw.group % bn != 0, HAS_BIAS=False, SWIGLU=False, NORM=False,
                 HAS_RES=False, EVEN=k % (nb * 128) == 0, STEPS=triton.cdiv(k, nb * 128), BLOCK_N=bn, NB=nb, PDL=True)
    ints = dict(N=n, K=k, stride_w=qw.data.stride(0), stride_s=qw.scales.stride(0))
    names = list(sig)
    aligned = ["x", "w", "sc", "out"] + [x for x, v in ints.items() if v % 16 == 0]
    attrs = {(names.index(x),): [["tt.divisibility", 16]] for x in aligned}
    src = ASTSource(fn=fp8._fp8_gemv_kernel, signature={**sig, **{c: "constexpr" for c in const}}, constexprs=const,
                    attrs=attrs)
    cubin = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps)).asm["cubin"]
    return _disassemble(cubin), bn * nb * 128


def _compile_fp8_16(n: int, k: int, bn: int, r: int, warps: int) -> tuple[str, int]:
    """fp8.py's fp16-product GEMV (`_fp8_gemv16_kernel`) on an [n, k] FP8 weight of 128-row
    scales (config: BLOCK_N, R runs a step, num_warps)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from models.kernels.cuda import fp8
    sig = dict(x="*bf16", w="*i32", sc="*fp32", bias="*bf16", out="*bf16", N="i32", K="i32", stride_w="i32",
               stride_s="i32", res="*bf16", norm_w="*bf16", sum_out="*bf16", eps="fp32")
    const = dict(GROUP=128, ROW_SCALES=128 % bn != 0, HAS_BIAS=False, SWIGLU=False, NORM=False, HAS_RES=False,
                 EVEN=k % (r * 16) == 0, STEPS=triton.cdiv(k, r * 16), BLOCK_N=bn, R=r, PDL=True)
    ints = dict(N=n, K=k, stride_w=k // 4, stride_s=k // 128)
    names = list(sig)
    aligned = ["x", "w", "sc", "out"] + [x for x, v in ints.items() if v % 16 == 0]
    attrs = {(names.index(x),): [["tt.divisibility", 16]] for x in aligned}
    src = ASTSource(fn=fp8._fp8_gemv16_kernel, signature={**sig, **{c: "constexpr" for c in const}},
                    constexprs=const, attrs=attrs)
    cubin = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps)).asm["cubin"]
    return _disassemble(cubin), bn * r * 16


def _disassemble(cubin: bytes) -> str:
    """The SASS, after a first line `// REG:n STACK:n ...` (cuobjdump's resource usage: registers a
    thread bound how many warps an SM holds, 64 Ki registers an SM)."""
    import triton
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        usage = subprocess.run([os.path.join(tools, "cuobjdump"), "-res-usage", path], capture_output=True,
                               text=True, check=True).stdout
        found = re.search(r"(REG:\d+ STACK:\d+)", usage)
        sass = subprocess.run([os.path.join(tools, "nvdisasm"), "-c", path], capture_output=True, text=True,
                              check=True).stdout
        return f"// {found.group(1) if found else 'REG:?'}\n" + sass


def resources(text: str) -> str:
    """_disassemble's first line: registers a thread and stack bytes."""
    return text.split("\n", 1)[0].lstrip("/ ")


def main_loop(text: str) -> list[str]:
    """The instructions of the longest backward branch's body."""
    lines = text.splitlines()
    labels = {}
    for i, line in enumerate(lines):
        m = re.match(r"\s*(\.L_x_\d+):", line)
        if m:
            nxt = next((x for x in lines[i + 1:] if ADDR.search(x)), None)
            if nxt:
                labels[m.group(1)] = int(ADDR.search(nxt).group(1), 16)
    code = [x for x in lines if ADDR.search(x)]
    best = None
    for line in code:
        m = re.search(r"BRA(?:\.\w+)*\s+.*?`\((\.L_x_\d+)\)", line)
        at = int(ADDR.search(line).group(1), 16)
        if m and labels.get(m.group(1), at + 1) < at and (best is None or at - labels[m.group(1)] > best[1] - best[0]):
            best = (labels[m.group(1)], at)
    if best is None:
        return []
    return [x for x in code if best[0] <= int(ADDR.search(x).group(1), 16) <= best[1]]


def opcode(line: str) -> str:
    m = re.search(r"\s(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line.split("*/", 1)[1])
    return m.group(2) if m else "?"


def main() -> None:
    from engine.device import configure_process
    configure_process()  # (the environment's diagnosis switches and folders, as chat takes them)
    ap = argparse.ArgumentParser()
    ap.add_argument("formats", nargs="*", default=["Q4_K", "Q6_K", "Q8_0", "INT4", "FP8", "INT4P", "Q4KP", "Q5KP", "Q6KP"])
    ap.add_argument("--n", type=int, default=10240)
    ap.add_argument("--k", type=int, default=5120)
    ap.add_argument("--config", default=None, help="BLOCK_N x num_warps x most weights a step (pick_config's by default)")
    ap.add_argument("--planar-config", default=None,
                    help="INT4P / Q4KP / Q5KP / Q6KP: rows a program x num_warps x words a step (qplanar.pick_config's by default)")
    ap.add_argument("--runs-config", default=None,
                    help="INT4R / Q4KR (qruns.py: AWQ's INT4 as stored, Q4_K as runs): BN rows x num_warps x "
                         "PREFETCH 0/1 (qruns.pick_config's by default)")
    ap.add_argument("--int8", action="store_true", help="the planar layouts: the GEMV on int8 inputs (DP4A)")
    ap.add_argument("--fp8-config", default=None,
                    help="FP8: BLOCK_N x 128-weight blocks a step x num_warps (fp8.pick_config's by default)")
    ap.add_argument("--fp8-form", default="f32", choices=("f32", "f16"),
                    help="FP8: fp8.py's fp32-product GEMV, or its fp16-product one (config then BLOCK_N x runs "
                         "a step x num_warps, fp8.pick_config16's by default)")
    a = ap.parse_args()
    from models.kernels.cuda import fp8, qlinear
    from models.kernels.cuda import qplanar
    print(f"[{a.n}, {a.k}] weight, config {a.config or 'qlinear.launch_config'}'s (BLOCK_N x num_warps x most "
          f"weights a step; planar layouts: {a.planar_config or 'qplanar.pick_config'}'s rows x num_warps x words a step)")
    from models.quant import runs
    from models.kernels.cuda import qruns
    for fmt in a.formats:
        if fmt == "INT4R" or fmt in runs.REPACKED:
            cfg = tuple(map(int, a.runs_config.split("x"))) if a.runs_config else \
                tuple(map(int, qruns.pick_config(a.n, a.k)))
            text, weights = _compile_runs(fmt, a.n, a.k, *cfg, int8=a.int8)
            body = main_loop(text)
            if not body:
                print(f"{fmt:>5}: no loop (one step covers the row)")
                continue
            ops = collections.Counter(opcode(x) for x in body)
            loads = sum(v for o, v in ops.items() if o in ("LDG", "LD"))
            print(f"{fmt:>5}: {len(body)} instructions a thread per iteration, {weights} weights -> "
                  f"{len(body) * cfg[1] * 32 / weights:.2f} a weight; global loads {loads}; {resources(text)}; "
                  + ", ".join(f"{o} {c}" for o, c in ops.most_common(12)))
            continue
        if fmt in qplanar.FMTS:
            cfg = tuple(map(int, a.planar_config.split("x"))) if a.planar_config else \
                qplanar.pick_config(a.n, a.k, {"INT4P": 128, "Q6KP": 16}.get(fmt, 32))[:3]
        elif fmt == "FP8":
            pick = fp8.pick_config16 if a.fp8_form == "f16" else fp8.pick_config
            cfg = tuple(map(int, a.fp8_config.split("x"))) if a.fp8_config else pick(a.n, a.k)
        else:  # (gemv's own pick, qlinear.launch_config: a head's rows take fewer for the K-quants)
            cfg = tuple(map(int, a.config.split("x"))) if a.config else qlinear.launch_config(weight(fmt, a.n, a.k))[:3]
        if fmt == "FP8" and a.fp8_form == "f16":
            text, weights = _compile_fp8_16(a.n, a.k, *cfg)
        else:
            text, weights = compile_sass(fmt, a.n, a.k, *cfg, int8=a.int8 and fmt in qplanar.FMTS)
        body = main_loop(text)
        if not body:
            print(f"{fmt:>5}: no loop (one step covers the row)")
            continue
        warps = cfg[2] if fmt == "FP8" else cfg[1]
        ops = collections.Counter(opcode(x) for x in body)
        if a.int8 and fmt in qplanar.FMTS:  # ptxas unrolls this loop: each step of it holds two DP4As a word
            weights *= max(1, round(ops["IDP"] / (2 * cfg[0] * cfg[2] / (cfg[1] * 32))))
        loads = sum(v for o, v in ops.items() if o in ("LDG", "LD"))
        print(f"{fmt:>5}: {len(body)} instructions a thread per iteration, {weights} weights -> "
              f"{len(body) * warps * 32 / weights:.2f} a weight; global loads {loads}; {resources(text)}; "
              + ", ".join(f"{o} {c}" for o, c in ops.most_common(10)))


if __name__ == "__main__":
    main()
