"""One-token linear layers (GEMV, x [1, K] @ W^T) on CUDA: cuBLAS against Triton GEMV configs.

    python bench/gemv_sweep.py [--shapes smollm2-135m,...] [--quick] [--swiglu] [--wide]
For each matrix shape of the PERFORMANCE.md models, times F.linear (cuBLAS) and the Triton kernel
of models/kernels/cuda/linear.py under a set of (BLOCK_N, BLOCK_K, warps) configs, each inside a CUDA graph of
many calls over rotating weight copies (>= 256 MB, so the weights come from HBM, as in a decode
step, not from L2). Prints microseconds per call and the achieved GB/s; the best config per shape
is what cuda_linear.pick_config encodes. --swiglu: each matrix as a SwiGLU pair (its N rows the
gate's and the up's, one launch: gemv(swiglu=True) against F.linear and torch's silu-mul); --wide:
also K steps of 1,024 up to the whole row, 1-2 rows a program and 16 warps.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from models.kernels.cuda import linear as cuda_linear  # noqa: E402

SHAPES = {  # (K, N) of each linear in one decoder layer, and the LM head
    "smollm2-135m": [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152)],
    "qwen2.5-0.5b": [(896, 1152), (896, 896), (896, 9728), (4864, 896), (896, 151936)],
    "qwen3.5-0.8b": [(1024, 8224), (2048, 1024), (1024, 5120), (1024, 7168), (3584, 1024), (1024, 248320)],
    "qwen3.5-27b": [(5120, 16480), (6144, 5120), (5120, 14336), (5120, 34816), (17408, 5120)],
    # the MoE shapes' dense GEMVs (their experts: bench/moe_sweep.py)
    "qwen3.5-35b-a3b": [(2048, 12352), (4096, 2048), (2048, 9216), (2048, 257), (2048, 248320)],
    "qwen3-30b-a3b": [(2048, 5120), (4096, 2048), (2048, 128), (2048, 151936)],
    # LFM2-1.2B's conv in/out projections, attention qkv, gate/up (a SwiGLU pair's rows), down, head
    "lfm2-1.2b": [(2048, 6144), (2048, 2048), (2048, 3072), (2048, 16384), (8192, 2048), (2048, 65536)],
}


def time_graph(fn, n_calls: int, reps: int = 5) -> float:
    """Microseconds a call of fn(i) for i in range(n_calls), recorded in one CUDA graph (after
    one warm-up call on a side stream), the best of `reps` replays."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn(0)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(n_calls):
            fn(i)
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(reps):
        start.record()
        g.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / n_calls)
    return best


def time_calls(fn, weights, x, reps=5) -> float:
    """Microseconds per call of fn(x, w): one graph of len(weights) * 4 calls over the weights."""
    calls = [w for w in weights] * 4
    return time_graph(lambda i: fn(x, calls[i]), len(calls), reps)


def main() -> None:
    from engine.device import configure_process
    configure_process()  # (the environment's diagnosis switches and folders, as chat takes them)
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(list(SHAPES)[:4]))
    ap.add_argument("--quick", action="store_true", help="only the configs pick_config would choose, and cuBLAS")
    ap.add_argument("--matrix", help="only this K x N matrix (e.g. 5120x248320, an LM head), under --shapes' name")
    ap.add_argument("--swiglu", action="store_true", help="each matrix as a SwiGLU pair (N: gate and up rows)")
    ap.add_argument("--wide", action="store_true", help="also long K steps, 1-2 rows a program, 16 warps")
    a = ap.parse_args()
    dev = torch.device("cuda")
    configs = [c for c in itertools.product((4, 8, 16, 32, 64), (64, 128, 256, 512), (4, 8)) if c[0] * c[1] <= 16384]
    if a.wide:
        configs += [c for c in itertools.product((1, 2, 4, 8, 16), (1024, 2048, 4096, 8192), (4, 8, 16))
                    if c[0] * c[1] <= 32768] + [(1, 512, 4), (2, 512, 4), (2, 256, 4), (4, 256, 16), (8, 512, 16)]
    for name in a.shapes.split(","):
        for K, N in ([tuple(map(int, a.matrix.split("x")))] if a.matrix else SHAPES[name]):
            if a.swiglu and N % 2:
                print(f"{name:13} K={K:5} N={N:6}: an odd N is no SwiGLU pair, skipped", flush=True)
                continue
            size = K * N * 2
            n = max(2, min(64, (256 << 20) // size))
            weights = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(n)]
            x = torch.randn(1, K, device=dev, dtype=torch.bfloat16)
            if a.swiglu:
                def torch_form(x, w):
                    g, u = F.linear(x, w).chunk(2, dim=-1)
                    return F.silu(g) * u
            else:
                def torch_form(x, w):
                    return F.linear(x, w)
            ref = torch_form(x, weights[0]).float()
            row = {"cublas": time_calls(torch_form, weights, x)}
            n_out = N // 2 if a.swiglu else N
            picked = cuda_linear.pick_config(K, n_out, pair=a.swiglu)
            cands = [picked] + ([] if a.quick else configs)
            for bn, bk, nw in dict.fromkeys(cands):
                if bk > cuda_linear.next_pow2(K) or bn > n_out:  # (only masked weights beyond either)
                    continue
                out = cuda_linear.gemv(x, weights[0], config=(bn, bk, nw), swiglu=a.swiglu)
                assert torch.allclose(out.float(), ref, atol=1e-2, rtol=1e-2), (K, N, bn, bk, nw)
                row[(bn, bk, nw)] = time_calls(
                    lambda x, w: cuda_linear.gemv(x, w, config=(bn, bk, nw), swiglu=a.swiglu), weights, x)
            best = min((k for k in row if k != "cublas"), key=row.get)
            print(f"{name:13} K={K:5} N={N:6}{' pair' if a.swiglu else ''} {size / 1e6:7.1f} MB  "
                  f"cuBLAS {row['cublas']:7.2f} us "
                  f"({size / row['cublas'] / 1e3:5.0f} GB/s)  best {best} {row[best]:7.2f} us "
                  f"({size / row[best] / 1e3:5.0f} GB/s)  picked {picked} {row.get(picked, float('nan')):7.2f} us",
                  flush=True)
            if not a.quick:
                top = sorted((k for k in row if k != "cublas"), key=row.get)[:5]
                print("    top:", ", ".join(f"{k}={row[k]:.2f}" for k in top), flush=True)
            del weights
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
