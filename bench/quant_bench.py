"""Quantized weights on CUDA against bf16, random weights built on the device (no files), one command:

    python bench/quant_bench.py [--big qwen3.5-27b] [--formats bf16,Q4_K,AWQ,FP8]
        [--small smollm2-135m,qwen2.5-0.5b,qwen3.5-0.8b] [--small-formats bf16,Q4_K] [--new 128] [--prefill 2048]
        [--plan | --plan-only]     (each model's kernel plan, as `chat plan` prints it; --plan-only: no timing)
    python bench/quant_bench.py --sweep     (the dequant-GEMV alone, per kernel config)
    python bench/quant_bench.py --sweep-planar     (only qplanar.py's, on bf16 and on int8 inputs)
    python bench/quant_bench.py --sweep-fp8     (only fp8.py's, beside the bf16 GEMV of the same matrix)
    python bench/quant_bench.py --sweep-fp8-rows     (fp8.py's fp16 form on 5,120-row matrices, 1-6 rows a program)
    python bench/quant_bench.py --sweep-runs [--runs-shapes 896x4864,9728x896s,151936x896h] [--runs-formats Q4_K]
        (qruns.py's GEMV per config beside qplanar.py's picked one, or the blocks', or a head's bf16)
    python bench/quant_bench.py --sweep-grid     (qplanar.py's GEMV per config on the small shapes' Q4KP matrices)
    python bench/quant_bench.py --sweep-dequant     (qplanar.py's dequantize launch per tile: prefill's weights)
    python bench/quant_bench.py --sweep-fp8-prefill     (FP8 prefill's GEMM: fp8_gemm.py against dequantize + bf16)
    python bench/quant_bench.py --sweep-small     (qlinear.py's on the 0.5B-like Q5_0 matrices, the 27B-like Q6_K head)
    python bench/quant_bench.py --sweep-head     (qplanar.py's on the 27B-like Q6_K head, its fp32 row, per config)

For the big shape, each format: decode tok/s after a 128-token prompt (`--new` greedy tokens,
median of 3, CUDA graph), one `--prefill`-token prefill (tok/s, median of 3), the weights' bytes,
the GPU memory the model takes once built and the peak over the run; then the small shapes in
Q4_K against bf16. Q4_K and AWQ run as the loader leaves them on CUDA (Q4_K repacked into Q4KR, AWQ
as stored in one allocation: models/kernels/cuda/qruns.py; ab_decode.py's planar4 variant has
qplanar.py's Q4KP and INT4P); Q4_K-stored keeps the blocks (qlinear.py's kernel), and AWQ-stored
now runs qruns.py too (qlinear.gemv sends INT4 of whole 32-weight runs there), its three tensors
apart. Formats (bench/shapes.py, random_quantized_model): Q4_K = every linear in Q4_K
(Q5_0 where K is not whole 256-weight blocks, as llama.cpp's Q4_K_M falls back), the LM head in
Q6_K and the embedding table in Q4_K blocks, as a Q4_K_M file holds them; AWQ = 4-bit groups of 128
(the layout AWQ and GPTQ checkpoints are repacked into); FP8 = e4m3 with 128 x 128 block scales;
AWQ and FP8 keep the embedding and an untied LM head in bf16, as their checkpoints do. "read GB" is
what a decode step reads (the weights less the embedding table); floor = read GB / 4.3 TB/s.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from decode_bench import bench_shape  # noqa: E402
from gemv_sweep import time_graph  # noqa: E402
from shapes import random_model, random_quantized_model  # noqa: E402



def run(name: str, fmt: str, args, device) -> dict:
    from models.quant.layers import weight_formats
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    dtype = torch.bfloat16
    if fmt == "bf16":
        model = random_model(name, device, dtype)
    else:  # as the kernel plan leaves them on CUDA (Q4_K as Q4KR, AWQ as stored: qruns.py); "-stored":
        # the CUDA forms bound, nothing repacked
        from models import plan as kernel_plan
        model = random_quantized_model(name, fmt.removesuffix("-stored"), device, dtype)
        if fmt.endswith("-stored"):
            kernel_plan.bind_forms(model)
        else:
            kernel_plan.bind(model, device, dtype)
    if args.plan or args.plan_only:
        print_plan(model, name, fmt, device, dtype)
        if args.plan_only:
            return {}
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - base
    formats = weight_formats(model)
    rec = bench_shape(name, device, dtype, "on", args.prompt, args.new, args.prefill, 1, model=model)
    rec.update(format=fmt, formats_gb={k: round(v / 1e9, 3) for k, v in formats.items()},
               read_gb=rec["active_gb"], held_gb=round(held / 1e9, 2))  # read: decode_bench.active_bytes
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return rec


def print_plan(model, name: str, fmt: str, device, dtype) -> None:
    """The model's kernel plan as it now is (bound where the run binds it), as `chat plan` prints
    it, with the floor at this bench's 4.3 TB/s."""
    from chat.plan_report import report
    from models import plan as kernel_plan
    plan = kernel_plan.make(model, device, dtype)
    print(report(plan, f"kernel plan of the {name}-like shape in {fmt} on {device}, {dtype}",
                 (4.3e12, "the floor this bench's table uses"), 8192) + "\n", flush=True)


CONFIGS = [(2, 4, 1024), (4, 4, 256), (4, 4, 1024), (4, 8, 1024), (8, 4, 512), (8, 8, 1024), (16, 8, 512),
           (16, 8, 1024)]


def sweep(device) -> None:
    """The dequant-GEMV alone on matrices of the big shape, per format and config (BLOCK_N,
    num_warps, most weights a step): microseconds a call (CUDA events over 100 calls replayed
    from a CUDA graph) and TB/s of the weight's bytes."""
    from models.kernels.cuda import qlinear
    from shapes import random_quant_linear
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(1, 17408, device=device, dtype=torch.bfloat16)
    print(f"\n{'format':>6}{'N':>7}{'K':>7}" + "".join(f"{'x'.join(map(str, c)):>13}" for c in CONFIGS))
    for fmt in ("Q4_K", "AWQ"):  # (FP8: --sweep-fp8)
        for n, k in ((10240, 5120), (5120, 17408)):
            lin = random_quant_linear(fmt, n, k, device, gen)
            qw, xk = lin.qweight(), x[:, :k].contiguous()
            cells = []
            for config in CONFIGS:
                us = _graph_us(lambda: qlinear.gemv(xk, qw, config=config))
                cells.append(f"{us:.0f}/{qw.nbytes() / us / 1e6:.2f}")
            print(f"{fmt:>6}{n:>7}{k:>7}" + "".join(f"{c:>13}" for c in cells), flush=True)
            lin = qw = None
            torch.cuda.empty_cache()
    print("(each cell: microseconds a call / TB/s; columns: BLOCK_N x num_warps x most weights a step)")
    sweep_planar(device, x, gen)


def sweep_planar(device, x, gen) -> None:
    """qplanar.py's GEMV per (rows a program, num_warps) with pick_config's words a step and K
    split for them, on the bf16 input as given (A16) and as int8 (A8, quantize_input's launch
    included), on the big shape's matrices."""
    from models.quant import planar
    from models.kernels.cuda import qplanar
    from shapes import random_quant_linear
    saved = dict(qplanar.PREFETCH)
    print(f"\n{'format':>8}{'N':>7}{'K':>7}" + "".join(f"{'x'.join(map(str, c)):>13}" for c in PLANAR_TILES)
          + f"{'picked':>13}")
    for fmt, src, repack in (("INT4P", "AWQ", planar.repack_int4p), ("Q4KP", "Q4_K", planar.repack_q4k)):
        for n, k in ((10240, 5120), (5120, 17408), (34816, 5120)):
            pw = repack(random_quant_linear(src, n, k, device, gen).qweight())
            xk = x[:, :k].contiguous()
            for int8, prefetch in ((False, True), (True, False), (True, True)):
                qplanar.PREFETCH = dict.fromkeys(saved, prefetch)
                cells = []
                picked = qplanar.pick_config(n, k, pw.group)
                for config in [qplanar.pick_config(n, k, pw.group, r, w, small=False) for r, w in PLANAR_TILES] + [picked]:
                    us = _graph_us(lambda: qplanar.gemv(xk, pw, config=config, int8=int8))
                    cells.append(f"{us:.0f}/{pw.nbytes() / us / 1e6:.2f}")
                label = fmt + ("-A8" if int8 else "") + ("" if prefetch else "-np")
                print(f"{label:>8}{n:>7}{k:>7}" + "".join(f"{c:>13}" for c in cells)
                      + f"  (picked {'x'.join(map(str, picked))})", flush=True)
            pw = None
            torch.cuda.empty_cache()
    qplanar.PREFETCH = saved
    print("(-np: without the next step's words read ahead; "
          "columns: rows a program x num_warps, with pick_config's words a step and K split for them; "
          "a cell: microseconds a call / TB/s of the weight's bytes)")


FP8_CONFIGS = [(bn, nb, w) for bn in (2, 4, 8, 16) for nb in (2, 4, 8, 16) for w in (1, 2, 4, 8) if bn * nb * 128 >= w * 512]
# fp8.py's fp16-product form: (BLOCK_N, R runs a step, R / 32 warps)
FP8_CONFIGS16 = [(bn, r, r // 32) for bn in (1, 2, 4, 8) for r in (32, 64, 128)]


def sweep_fp8(device, x, gen) -> None:
    """fp8.py's GEMV in its two forms, f32 per (BLOCK_N, 128-weight blocks a step, num_warps) and
    pick_config's, f16 per (BLOCK_N, runs a step, num_warps) and pick_config16's, on the
    big shape's matrices, beside linear.gemv on the same matrix in bf16 (the rate to beat per
    weight: half the bytes should take about half the time)."""
    from models.kernels.cuda import fp8, linear
    from shapes import random_quant_linear
    for n, k in ((10240, 5120), (16480, 5120), (5120, 6144), (5120, 17408), (34816, 5120)):
        qw = random_quant_linear("FP8", n, k, device, gen).qweight()
        xk = x[:, :k].contiguous()
        wb = torch.empty(n, k, device=device, dtype=torch.bfloat16)
        bf16_us = _graph_us(lambda: linear.gemv(xk, wb))
        wb = None
        torch.cuda.empty_cache()
        for form, configs, pick in (("f32", FP8_CONFIGS, fp8.pick_config), ("f16", FP8_CONFIGS16, fp8.pick_config16)):
            cells = {c: _graph_us(lambda: fp8.gemv(xk, qw, config=c, form=form)) for c in configs}
            picked = pick(n, k)
            if picked not in cells:  # (a small matrix's whole-row step is not among the configs)
                cells[picked] = _graph_us(lambda: fp8.gemv(xk, qw, form=form))
            best = min(cells, key=cells.get)
            print(f"[{n}, {k}] {form}: bf16 GEMV {bf16_us:.1f} us ({n * k * 2 / bf16_us / 1e6:.2f} TB/s); FP8 picked "
                  f"{'x'.join(map(str, picked))} {cells[picked]:.1f} us, best {'x'.join(map(str, best))} "
                  f"{cells[best]:.1f} us ({qw.nbytes() / cells[best] / 1e6:.2f} TB/s)", flush=True)
            print("   " + "  ".join(f"{'x'.join(map(str, c))}:{us:.1f}" for c, us in cells.items()), flush=True)
        if n == 34816:  # the gate/up pair as decode runs it: SwiGLU, 17,408 outputs
            cells = {c: _graph_us(lambda: fp8.gemv(xk, qw, swiglu=True, config=c, form="f16")) for c in FP8_CONFIGS16}
            cells["f32"] = _graph_us(lambda: fp8.gemv(xk, qw, swiglu=True, form="f32"))
            print(f"[{n}, {k}] SwiGLU: picked {'x'.join(map(str, fp8.pick_config16(n // 2, k, swiglu=True)))}; "
                  + "  ".join(f"{c if isinstance(c, str) else 'x'.join(map(str, c))}:{us:.1f}" for c, us in cells.items()),
                  flush=True)
        qw = None
        torch.cuda.empty_cache()
    print("(configs: BLOCK_N x 128-weight blocks a step x num_warps: microseconds a call)")


def sweep_fp8_rows(device, x, gen) -> None:
    """fp8.py's fp16-product form on the 27B-like shape's 5,120-row matrices per BLOCK_N (1-6: the
    rows a program, powers of two or not, which sets how many waves of programs a matrix takes)
    x (runs a step, warps), beside pick_config16's."""
    from models.kernels.cuda import fp8
    from shapes import random_quant_linear
    for n, k in ((5120, 17408), (5120, 6144)):
        qw = random_quant_linear("FP8", n, k, device, gen).qweight()
        xk = x[:, :k].contiguous()
        cells = {}
        for bn in (1, 2, 3, 4, 5, 6):
            for r in (64, 128, 256):
                try:
                    cells[(bn, r, r // 32)] = _graph_us(lambda: fp8.gemv(xk, qw, config=(bn, r, r // 32), form="f16"))
                except Exception as e:  # (a config that does not compile: named, the others still timed)
                    print(f"   {bn}x{r}x{r // 32}: {type(e).__name__}: {str(e).splitlines()[0][:120]}", flush=True)
        picked = fp8.pick_config16(n, k)
        best = min(cells, key=cells.get)
        print(f"[{n}, {k}] f16: picked {'x'.join(map(str, picked))} {cells[picked]:.1f} us, best "
              f"{'x'.join(map(str, best))} {cells[best]:.1f} us ({qw.nbytes() / cells[best] / 1e6:.2f} TB/s)", flush=True)
        print("   " + "  ".join(f"{'x'.join(map(str, c))}:{us:.1f}" for c, us in cells.items()), flush=True)
        qw = None
        torch.cuda.empty_cache()


RUNS_DEQUANT_TILES = [(16, 32, 8), (8, 32, 4), (32, 32, 8), (16, 16, 4), (16, 64, 8), (4, 64, 4), (64, 8, 8)]
RUNS_CONFIGS = [(bn, w, p) for bn in (1, 2, 4, 8) for w in (1, 2, 4, 8) for p in (True, False)]
# --sweep-runs's default matrices ([N, K], s: a SwiGLU pair of N rows): the 27B-like shape's
RUNS_SHAPES = "10240x5120,16480x5120,5120x6144,5120x17408,34816x5120s"


# An LM head's configs (rows a program x warps x read ahead): more rows a program
RUNS_HEAD_CONFIGS = [(bn, w, p) for bn in (4, 8, 16, 32) for w in (1, 2, 4) for p in (True, False)]


def sweep_runs(device, x, gen, shapes: str = RUNS_SHAPES, formats: str = "Q4_K,AWQ") -> None:
    """qruns.py's GEMV (the weights in runs: AWQ's INT4 as stored, Q4_K as Q4KR, and where K is not
    whole 256-weight super-blocks Q4_K's fallback Q5_0 as Q50R, as a Q4_K_M file holds it) per (BN,
    num_warps, PREFETCH) on `shapes` ("NxK" a matrix, an s after it: a SwiGLU pair of N rows, an h:
    an LM head, its fp32 normed row on the float path and fp32 logits; the 27B-like matrices by
    default), int8 inputs (quantize_input's launch included), beside the same weights in the other
    kernels' layout (qplanar.py's Q4KP or INT4P, picked config, its int8 launch included; Q5_0: its
    blocks, qlinear.py's pick), qruns.pick_config's config and the best config on the inputs as
    given (the float path, no int8 launch); heads beside the bf16 GEMV of their shape instead:
    microseconds a call and TB/s of the weight's bytes."""
    from models.formats import gguf_blocks
    from models.quant import layers as quant, planar, runs
    from models.kernels.cuda import linear, qlinear, qplanar, qruns
    from shapes import random_quant_linear
    todo = [(int(a), int(b.rstrip("sh")), b.endswith("s"), b.endswith("h"))
            for a, b in (m.split("x") for m in shapes.split(","))]
    for fmt in formats.split(","):
        for n, k, swiglu, head in todo:
            qw = random_quant_linear(fmt, n, k, device, gen).qweight()
            made = quant.BlockLinear.repack_for(gguf_blocks.TYPES[qw.fmt], True, True) \
                if qw.fmt in gguf_blocks.TYPES else None
            pw = made[0](qw) if made is not None and made[1] in runs.REPACKED else qw
            if head:
                xk = x[:, :k].float().contiguous()
                wb = torch.empty(n, k, device=device, dtype=torch.bfloat16)
                other, other_name = _graph_us(lambda: linear.gemv(xk.bfloat16(), wb, out_dtype=torch.float32)), "bf16"
                other_bytes = wb.numel() * 2
                wb = None
            else:
                xk = x[:, :k].contiguous()
                if qw.fmt in ("Q4_K", "INT4"):
                    pp = (planar.repack_q4k if qw.fmt == "Q4_K" else planar.repack_int4p)(qw)
                    other, other_name = _graph_us(lambda: qplanar.gemv(xk, pp, swiglu=swiglu)), "planar"
                else:
                    pp = qw
                    other, other_name = _graph_us(lambda: qlinear.gemv(xk, qw, swiglu=swiglu)), "blocks"
                other_bytes = pp.nbytes()
                pp = None
            out = torch.float32 if head else None
            cells = {}
            for c in RUNS_HEAD_CONFIGS if head else RUNS_CONFIGS:
                try:
                    cells[c] = _graph_us(lambda: qruns.gemv(xk, pw, swiglu=swiglu, config=c, out_dtype=out))
                except Exception as e:  # (a config that does not compile: named, the others still timed)
                    print(f"   {c}: {type(e).__name__}: {str(e).splitlines()[0][:120]}", flush=True)
            best = min(cells, key=cells.get)
            picked = qruns.pick_config(n // 2 if swiglu else n, k, swiglu, int8=not head)
            picked_us = _graph_us(lambda: qruns.gemv(xk, pw, swiglu=swiglu, config=picked, out_dtype=out))
            float_us = _graph_us(lambda: qruns.gemv(xk, pw, swiglu=swiglu, config=best, int8=False))
            q_us = _graph_us(lambda: qruns.quantize_input(xk))
            y = qruns.gemv(xk, pw, swiglu=swiglu, config=best, out_dtype=torch.float32)
            xr = xk.float() if head else qplanar.quantized_reference(xk, 32).float()
            full = xr @ runs.dequantize(pw).float().T
            ref = torch.nn.functional.silu(full[:, :n // 2]) * full[:, n // 2:] if swiglu else full
            err = ((y - ref).abs().max() / ref.abs().max()).item()
            full = ref = None
            print(f"{pw.fmt} [{n}, {k}]{' SwiGLU' if swiglu else ''}{' head, fp32 row' if head else ''}: "
                  f"{other_name} {other:.1f} us ({other_bytes / other / 1e6:.2f} TB/s); runs best {best} "
                  f"{cells[best]:.1f} us ({pw.nbytes() / cells[best] / 1e6:.2f} TB/s, {other / cells[best]:.2f}x); "
                  f"picked {picked} {picked_us:.1f} us; the best on the row as given {float_us:.1f} us; "
                  f"runs' quantize alone {q_us:.1f} us; max error / max |y| {err:.1e}", flush=True)
            print("   " + "  ".join(f"{c[0]}x{c[1]}{'p' if c[2] else ''}:{us:.1f}" for c, us in cells.items()),
                  flush=True)
            qw = pw = None
            torch.cuda.empty_cache()
    print("(configs: BN rows x num_warps, p: the next step read ahead; microseconds a call, int8 launch included "
          "but for heads)")


SMALL_CONFIGS = [(bn, w, most) for bn in (1, 2, 4, 8, 16) for w in (1, 2, 4, 8) for most in (256, 1024)
                 if bn * most >= w * 256]
# an LM head's rows (a vocabulary): more rows a program, fewer warps
HEAD_CONFIGS = [(bn, w, most) for bn in (8, 16, 32, 64) for w in (1, 2, 4) for most in (256, 1024)]


def sweep_small(device, gen) -> None:
    """qlinear.py's generic GEMV on the Q5_0 matrices of the Qwen2.5-0.5B-like shape in Q4_K
    (hidden 896 is not whole Q4_K super-blocks: llama.cpp's fallback) and on the 27B-like shape's
    Q6_K LM head (a Q4_K_M file's), per (BLOCK_N, num_warps, most weights a step), beside the
    bf16 GEMV of the same matrix: microseconds a call."""
    from models.kernels.cuda import linear, qlinear
    from shapes import random_quant_linear
    for fmt, n, k, swiglu in (("Q4_K", 1152, 896, False), ("Q4_K", 896, 896, False), ("Q4_K", 9728, 896, True),
                              ("Q4_K", 151936, 896, False), ("Q6_K", 248320, 5120, False)):
        qw = random_quant_linear(fmt, n, k, device, gen).qweight()
        xk = torch.randn(1, k, device=device, dtype=torch.bfloat16)
        wb = torch.empty(n, k, device=device, dtype=torch.bfloat16)
        bf16_us = _graph_us(lambda: linear.gemv(xk, wb, swiglu=swiglu))
        wb = None
        configs = HEAD_CONFIGS if n > 100000 else SMALL_CONFIGS
        cells = {c: _graph_us(lambda: qlinear.gemv(xk, qw, swiglu=swiglu, config=c)) for c in configs}
        picked = qlinear.pick_config(qw, swiglu)
        cells.setdefault(picked, _graph_us(lambda: qlinear.gemv(xk, qw, swiglu=swiglu)))
        best = min(cells, key=cells.get)
        print(f"{qw.fmt} [{n}, {k}]{' SwiGLU' if swiglu else ''}: bf16 {bf16_us:.1f} us; picked "
              f"{'x'.join(map(str, picked))} {cells[picked]:.1f}, best {'x'.join(map(str, best))} {cells[best]:.1f}",
              flush=True)
        print("   " + "  ".join(f"{'x'.join(map(str, c))}:{us:.1f}" for c, us in cells.items()), flush=True)
        qw = None
        torch.cuda.empty_cache()
    print("(configs: BLOCK_N x num_warps x most weights a step)")


# (rows a program, warps): J2's best (8 x 4) and the tiles with fewer instructions a weight in the
# SASS (bench/sass_loop.py: 2 warps over the same tile, or twice the rows)
PLANAR_TILES = [(8, 4), (8, 2), (16, 2), (16, 4), (32, 4), (4, 1)]


# qplanar.py's GEMV on an LM head's rows: (rows a program, warps, words a step, the next step read ahead)
HEAD_PLANAR = [(r, w, kw, False) for r in (4, 8, 16) for w in (1, 2, 4) for kw in (16, 32, 64)] + \
    [(r, w, 32, True) for r in (4, 8, 16) for w in (1, 2, 4)]


def sweep_head(device, gen) -> None:
    """The 27B-like shape's Q6_K LM head (a Q4_K_M file's) as the model reads it: Q6KP, its fp32
    normed row on the float path, fp32 logits; per (rows a program, num_warps, words a step, read
    ahead), beside pick_config's, the same head on int8 inputs (a bf16 row, quantize_input's launch
    included) and a bf16 matrix of its shape (AWQ's head): microseconds a call and TB/s."""
    from models.quant import planar
    from models.kernels.cuda import linear, qplanar
    from shapes import random_quant_linear
    n, k = 248320, 5120
    pw = planar.repack_q6k(random_quant_linear("Q6_K", n, k, device, gen).qweight())
    x = torch.randn(1, k, device=device, dtype=torch.float32)
    saved = dict(qplanar.PREFETCH)
    cells = {}
    for rows, warps, kw, ahead in HEAD_PLANAR:
        qplanar.PREFETCH["Q6KP"] = ahead
        cells[(rows, warps, kw, ahead)] = _graph_us(
            lambda: qplanar.gemv(x, pw, out_dtype=torch.float32, config=(rows, warps, kw, 1)))
    qplanar.PREFETCH = saved
    picked = qplanar.pick_config(n, k, pw.group, int8=False)
    picked_us = _graph_us(lambda: qplanar.gemv(x, pw, out_dtype=torch.float32))
    xb = x.to(torch.bfloat16)
    int8_us = _graph_us(lambda: qplanar.gemv(xb, pw, out_dtype=torch.float32))
    ref = x.double() @ qplanar.dequantize_rows(pw, 0, n, torch.float32).double().T
    y = qplanar.gemv(x, pw, out_dtype=torch.float32).double()
    err = float((y - ref).abs().max() / ref.abs().max())
    ref = y = None
    pw_bytes = pw.nbytes()
    pw = None
    torch.cuda.empty_cache()
    wb = torch.empty(n, k, device=device, dtype=torch.bfloat16)
    bf16_us = _graph_us(lambda: linear.gemv(xb, wb, out_dtype=torch.float32))
    best = min(cells, key=cells.get)
    tbs = lambda us: pw_bytes / us / 1e6  # noqa: E731
    print(f"Q6KP head [{n}, {k}], fp32 row: picked {'x'.join(map(str, picked[:3]))} {picked_us:.1f} us "
          f"({tbs(picked_us):.2f} TB/s); best {best} {cells[best]:.1f} us ({tbs(cells[best]):.2f} TB/s); "
          f"int8 inputs (picked) {int8_us:.1f} us; bf16 matrix {bf16_us:.1f} us ({n * k * 2 / bf16_us / 1e6:.2f} TB/s); "
          f"max error / max |y| {err:.1e}", flush=True)
    print("   " + "  ".join(f"{r}x{w}x{kw}{'p' if a else ''}:{us:.1f}" for (r, w, kw, a), us in cells.items()),
          flush=True)
    print("(configs: rows a program x num_warps x words a step, p: the next step read ahead; microseconds a call)")


# The small shapes' Q4KP matrices (N, K, SwiGLU): the 0.5B-like down, the 0.8B-like gate/up and down
GRID_SHAPES = [(896, 4864, False), (7168, 1024, True), (1024, 3584, False)]


def sweep_grid(device, gen) -> None:
    """qplanar.py's GEMV on the small shapes' Q4KP matrices (int8 inputs) per (rows a program,
    num_warps, words a step, K split in): every split of at least 4 steps a part up to 8, beside
    pick_config's; microseconds a call, the input's quantize launch and the split-K reduce included."""
    from models.quant import planar
    from models.kernels.cuda import qplanar
    from shapes import random_quant_linear
    for n, k, swiglu in GRID_SHAPES:
        pw = planar.repack_q4k(random_quant_linear("Q4_K", n, k, device, gen).qweight())
        x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
        words = k // 8
        configs = [(r, w, kw, sp) for r, w in ((8, 2), (8, 4), (4, 1), (4, 2)) for kw in (8, 16, 32, 64)
                   for sp in (1, 2, 4, 8) if words % kw == 0 and (words // kw) % sp == 0
                   and (sp == 1 or words // kw // sp >= 4)]
        picked = qplanar.pick_config(n // 2 if swiglu else n, k, pw.group)
        configs += [picked] if picked not in configs else []
        cells = {c: _graph_us(lambda: qplanar.gemv(x, pw, swiglu=swiglu, config=c, int8=True)) for c in configs}
        best = sorted(cells, key=cells.get)
        print(f"Q4KP [{n}, {k}]{' SwiGLU' if swiglu else ''}: picked {'x'.join(map(str, picked))} "
              f"{cells[picked]:.1f} us; best " + ", ".join(f"{'x'.join(map(str, c))} {cells[c]:.1f}" for c in best[:6]),
              flush=True)
        print("   " + "  ".join(f"{'x'.join(map(str, c))}:{us:.1f}" for c, us in cells.items()), flush=True)
    print("(configs: rows a program x num_warps x words a step x K split in)")


# (rows a program, weights a program at most, num_warps, flat store): qplanar.dequantize_rows's tiles
DEQUANT_TILES = [(16, 128, 4, False), (16, 128, 4, True), (16, 256, 4, True), (8, 256, 4, True), (8, 512, 4, True),
                 (16, 512, 8, True), (32, 256, 8, True), (32, 128, 4, True), (4, 512, 4, True), (16, 1024, 8, True),
                 (32, 512, 8, True), (16, 256, 8, False)]


def _dequant_cells(dequantize_rows, pw, out, tiles) -> list[str]:
    """A cell per tile: microseconds a call of dequantize_rows(pw, 0, N, bf16, out, tile=t) and the
    TB/s of the bytes it reads and writes."""
    n = out.shape[0]
    cells = []
    for t in tiles:
        us = time_graph(lambda i: dequantize_rows(pw, 0, n, torch.bfloat16, out, tile=t), 20, reps=3)
        cells.append(f"{us:.0f}/{(pw.nbytes() + out.numel() * 2) / us / 1e6:.2f}")
    return cells


def sweep_dequant(device, gen, tokens: int, runs_only: bool = False) -> None:
    """qplanar.dequantize_rows (prefill's weights: each matrix dequantized to bf16, then one
    GEMM) per tile and layout on the big shape's matrices, beside the bf16 GEMM of `tokens` rows
    it feeds: microseconds a call, and the TB/s of the bytes read and written."""
    from models.quant import planar
    from models.kernels.cuda import qplanar
    from shapes import random_quant_linear
    print(f"\n{'layout':>7}{'N':>7}{'K':>7}{'GEMM us':>9}" + "".join(f"{'x'.join(str(int(v)) for v in t):>14}"
                                                              for t in DEQUANT_TILES))
    for fmt, src, repack in (("INT4P", "AWQ", planar.repack_int4p), ("Q4KP", "Q4_K", planar.repack_q4k),
                             ("Q5KP", "Q5_K", planar.repack_q5k), ("Q6KP", "Q6_K", planar.repack_q6k)):
        for n, k in ((34816, 5120), (5120, 17408)) if not runs_only else ():
            pw = repack(random_quant_linear(src, n, k, device, gen).qweight())
            out = torch.empty(n, k, device=device, dtype=torch.bfloat16)
            x = torch.randn(tokens, k, device=device, dtype=torch.bfloat16)
            gemm_us = time_graph(lambda i: x @ out.t(), 10, reps=3)
            cells = _dequant_cells(qplanar.dequantize_rows, pw, out, DEQUANT_TILES)
            print(f"{fmt:>7}{n:>7}{k:>7}{gemm_us:>9.0f}" + "".join(f"{c:>14}" for c in cells), flush=True)
            pw = out = x = None
            torch.cuda.empty_cache()
    print(f"(tiles: rows a program x weights a program at most x num_warps x flat store; a cell: microseconds "
          f"a call / TB/s read and written; GEMM: x[{tokens}, K] @ W^T in bf16)")
    from models.quant import runs
    from models.kernels.cuda import qruns
    print(f"\n{'layout':>7}{'N':>7}{'K':>7}" + "".join(f"{'x'.join(map(str, t)):>14}" for t in RUNS_DEQUANT_TILES))
    for fmt, src in (("INT4", "AWQ"), ("Q4KR", "Q4_K")):
        for n, k in ((34816, 5120), (5120, 17408)):
            qw = random_quant_linear(src, n, k, device, gen).qweight()
            pw = runs.repack_q4k(qw) if fmt == "Q4KR" else qw
            out = torch.empty(n, k, device=device, dtype=torch.bfloat16)
            cells = _dequant_cells(qruns.dequantize_rows, pw, out, RUNS_DEQUANT_TILES)
            print(f"{fmt:>7}{n:>7}{k:>7}" + "".join(f"{c:>14}" for c in cells), flush=True)
            qw = pw = out = None
            torch.cuda.empty_cache()
    print("(qruns.dequantize_rows's tiles: rows a program x runs a program x num_warps)")


def sweep_fp8_prefill(device, gen, tokens: int) -> None:
    """FP8 prefill's GEMM per 27B-like matrix, `tokens` rows: the bf16 GEMM of the same matrix, the
    dequantize-then-bf16-GEMM form (fp8_gemm.MODE "dequant"), and fp8_gemm.matmul (its input's
    quantization included), microseconds a call; then matmul's rms distance to the exact product of
    the bf16 input and the dequantized weights, beside the dequantize form's."""
    from models.kernels.cuda import fp8_gemm, qlinear
    from shapes import random_quant_linear
    print(f"{'N':>7}{'K':>7}{'bf16 GEMM':>11}{'dequant+GEMM':>14}{'fp8_gemm':>10}{'vs dequant':>12}"
          f"{'rms err fp8_gemm':>18}{'rms err dequant':>17}")
    for n, k in ((10240, 5120), (16480, 5120), (34816, 5120), (5120, 17408), (5120, 6144), (12288, 5120)):
        lin = random_quant_linear("FP8", n, k, device, gen)
        if n % 128:  # (a fused in_proj whose parts end inside a block: a scale a row, as concat gives it)
            from models.quant import hf_layers
            lin = hf_layers.Fp8Linear(lin.weight, lin.scale.repeat_interleave(128, 0)[:n], scale_rows=1)
        qw = lin.qweight()
        x = torch.randn(tokens, k, device=device, dtype=torch.bfloat16, generator=gen)
        wb = qlinear.dequantize(qw, 0, n, torch.bfloat16)
        bf16_us = time_graph(lambda i: x @ wb.t(), 5, reps=3)
        deq_us = time_graph(lambda i: x @ qlinear.dequantize(qw, 0, n, torch.bfloat16, wb).t(), 5, reps=3)
        assert fp8_gemm.serves(x, qw), (n, k)
        fp8_us = time_graph(lambda i: fp8_gemm.matmul(x, qw), 5, reps=3)
        exact = x.float() @ lin.dequantize(torch.float32).t()
        rms = exact.pow(2).mean().sqrt()
        err = lambda y: float((y.float() - exact).pow(2).mean().sqrt() / rms)  # noqa: E731
        print(f"{n:>7}{k:>7}{bf16_us:>11.0f}{deq_us:>14.0f}{fp8_us:>10.0f}{deq_us / fp8_us:>11.2f}x"
              f"{err(fp8_gemm.matmul(x, qw)):>18.2e}{err(x @ wb.t()):>17.2e}", flush=True)
        lin = qw = x = wb = exact = None
        torch.cuda.empty_cache()
    print(f"(microseconds a call, {tokens} rows; rms err: of the output, against the bf16 input times the "
          f"dequantized weights in fp32)")


def _graph_us(call) -> float:
    """Microseconds a call: 100 calls captured in a CUDA graph, one replay timed by CUDA events."""
    return time_graph(lambda i: call(), 100, reps=1)


def main() -> None:
    from engine.device import configure_process
    configure_process()  # (the environment's diagnosis switches and folders, as chat takes them)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--big", default="qwen3.5-27b")
    ap.add_argument("--formats", default="bf16,Q4_K,Q4_K-stored,AWQ,AWQ-stored,FP8")
    ap.add_argument("--small", default="smollm2-135m,qwen2.5-0.5b,qwen3.5-0.8b")
    ap.add_argument("--small-formats", default="bf16,Q4_K", help="the small shapes' formats (Q4_K-stored: the blocks as stored)")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--plan", action="store_true", help="print each model's kernel plan before timing it")
    ap.add_argument("--plan-only", action="store_true", help="print each model's kernel plan, time nothing")
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument("--sweep", action="store_true", help="only time the dequant-GEMV alone per kernel config")
    ap.add_argument("--sweep-planar", action="store_true", help="--sweep for qplanar.py's GEMV alone")
    ap.add_argument("--sweep-fp8", action="store_true", help="--sweep for fp8.py's GEMV alone")
    ap.add_argument("--sweep-fp8-rows", action="store_true", help="fp8.py's fp16 form on the 5,120-row matrices "
                    "per rows a program (1-6)")
    ap.add_argument("--sweep-dequant", action="store_true", help="qplanar.dequantize_rows's tiles (prefill's "
                    "weights) beside the --prefill-row bf16 GEMM they feed")
    ap.add_argument("--sweep-dequant-runs", action="store_true", help="--sweep-dequant for qruns.py's tiles only")
    ap.add_argument("--sweep-fp8-prefill", action="store_true", help="FP8 prefill's GEMM per 27B-like "
                    "matrix: fp8_gemm.py against the dequantize-then-bf16 form, --prefill rows")
    ap.add_argument("--sweep-runs", action="store_true", help="qruns.py's GEMV per config beside qplanar.py's")
    ap.add_argument("--runs-shapes", default=RUNS_SHAPES, help="--sweep-runs's matrices: NxK, comma-separated "
                    "(NxKs: a SwiGLU pair of N rows; NxKh: an LM head on its fp32 row)")
    ap.add_argument("--runs-formats", default="Q4_K,AWQ", help="--sweep-runs's formats")
    ap.add_argument("--sweep-grid", action="store_true", help="qplanar.py's GEMV per config on the small "
                    "shapes' Q4KP matrices")
    ap.add_argument("--sweep-head", action="store_true", help="qplanar.py's GEMV on the 27B-like Q6_K LM head "
                    "per config, on its fp32 row (the model's float path)")
    ap.add_argument("--sweep-small", action="store_true", help="--sweep for qlinear.py's GEMV on the "
                    "0.5B-like shape's Q5_0 matrices and the 27B-like Q6_K head")
    args = ap.parse_args()
    device = torch.device("cuda")
    if args.sweep:
        sweep(device)
        return
    if args.sweep_planar:
        sweep_planar(device, torch.randn(1, 17408, device=device, dtype=torch.bfloat16),
                     torch.Generator(device=device).manual_seed(0))
        return
    if args.sweep_runs:
        sweep_runs(device, torch.randn(1, 17408, device=device, dtype=torch.bfloat16),
                   torch.Generator(device=device).manual_seed(0), args.runs_shapes, args.runs_formats)
        return
    if args.sweep_grid:
        sweep_grid(device, torch.Generator(device=device).manual_seed(0))
        return
    if args.sweep_fp8_prefill:
        sweep_fp8_prefill(device, torch.Generator(device=device).manual_seed(0), args.prefill)
        return
    if args.sweep_dequant or args.sweep_dequant_runs:
        sweep_dequant(device, torch.Generator(device=device).manual_seed(0), args.prefill, args.sweep_dequant_runs)
        return
    if args.sweep_head:
        sweep_head(device, torch.Generator(device=device).manual_seed(0))
        return
    if args.sweep_small:
        sweep_small(device, torch.Generator(device=device).manual_seed(0))
        return
    if args.sweep_fp8_rows:
        sweep_fp8_rows(device, torch.randn(1, 17408, device=device, dtype=torch.bfloat16),
                       torch.Generator(device=device).manual_seed(0))
        return
    if args.sweep_fp8:
        sweep_fp8(device, torch.randn(1, 17408, device=device, dtype=torch.bfloat16),
                  torch.Generator(device=device).manual_seed(0))
        return
    jobs = [(args.big, f) for f in args.formats.split(",") if args.big and f]
    jobs += [(s, f) for s in args.small.split(",") if s for f in args.small_formats.split(",") if f]
    rows = []
    for name, fmt in jobs:
        rec = run(name, fmt, args, device)
        if not rec:  # (--plan-only)
            continue
        print(json.dumps(rec), flush=True)
        rows.append(rec)
    if not rows:
        return
    print(f"\n{'shape':14}{'format':>7}{'decode tok/s':>14}{'floor':>7}{'% floor':>8}{'prefill tok/s':>15}"
          f"{'vs bf16':>8}{'weights GB':>11}{'read GB':>9}{'held GB':>9}{'peak GB':>9}")
    bf16 = {r["model"]: r for r in rows if r["format"] == "bf16"}
    for r in rows:
        floor = 4.3 / r["read_gb"]
        b = bf16.get(r["model"])
        pf = r.get("prefill_tok_s", 0) / b["prefill_tok_s"] if b and b.get("prefill_tok_s") else 0
        print(f"{r['model']:14}{r['format']:>7}{r['decode_tok_s']:>14.1f}{floor * 1e3:>7.0f}"
              f"{r['decode_tok_s'] / (floor * 1e3) * 100:>7.0f}%{r.get('prefill_tok_s', 0):>15.0f}{pf:>7.2f}x"
              f"{r['weight_gb']:>11.2f}{r['read_gb']:>9.2f}{r['held_gb']:>9.2f}{r.get('peak_mem_gb', 0):>9.2f}")


if __name__ == "__main__":
    main()
