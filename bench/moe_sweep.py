"""The CUDA MoE decode launches alone (models/kernels/cuda/moe.py), per kernel config:

    python bench/moe_sweep.py [--shapes qwen3.5-35b-a3b,qwen3-30b-a3b]
For each shape's experts (one layer's, bf16, random), times the gate/up launch and the down launch
over (rows a program, K a step, num_warps) and then the best three of each with the K loop
unrolled, and the down launch's wide form (the experts as a tile dimension, a fifth config
field): microseconds a call and GB/s of the chosen experts' bytes. Each call routes to other
random experts (64 precomputed id sets, replayed from one CUDA graph of 256 calls), so the weights
come from HBM as in a decode step, not from L2. The best configs are what moe.pick_config encodes.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import triton  # noqa: E402

from gemv_sweep import time_graph  # noqa: E402
from models.kernels.cuda import moe  # noqa: E402

SHAPES = {  # E, H, I, top k, shared expert as one more (its I the experts')
    "qwen3.5-35b-a3b": (256, 2048, 512, 8, True),
    "qwen3-30b-a3b": (128, 2048, 768, 8, False),
    "qwen3-next-80b-a3b": (512, 2048, 512, 10, True),
}


def main() -> None:
    from engine.device import configure_process
    configure_process()  # (the environment's diagnosis switches and folders, as chat takes them)
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="qwen3.5-35b-a3b,qwen3-30b-a3b")
    ap.add_argument("--launches", default="gate_up,down", help="which launches to sweep")
    ap.add_argument("--all-unrolled", action="store_true",
                    help="a wider grid (2-16 rows, K steps to 1024, 2-8 warps), each config rolled and unrolled")
    a = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    for name in a.shapes.split(","):
        E, H, I, k, shared = SHAPES[name]
        gate_up = torch.randn(E, 2 * I, H, device=dev, dtype=torch.bfloat16) * 0.02
        down = torch.randn(E, H, I, device=dev, dtype=torch.bfloat16) * 0.02
        sgu = torch.randn(2 * I, H, device=dev, dtype=torch.bfloat16) * 0.02 if shared else None
        sdn = torch.randn(H, I, device=dev, dtype=torch.bfloat16) * 0.02 if shared else None
        sg = torch.randn(1, 1, device=dev, dtype=torch.bfloat16) if shared else None
        x = torch.randn(1, H, device=dev, dtype=torch.bfloat16)
        ids = [torch.randperm(E, device=dev)[:k].view(1, k) for _ in range(64)]
        w = torch.softmax(torch.randn(1, k, device=dev), -1)
        h = torch.randn(k + shared, I, device=dev)
        n = k + shared
        gu_bytes, dn_bytes = n * 2 * I * H * 2, n * H * I * 2
        ref_h = moe.experts_gate_up(x, gate_up, ids[0], sgu, (8, 64, 4, 1))
        ref_y = moe.experts_down(h, down, ids[0], w, x.dtype, None, sg, sdn, (8, 64, 4, 1))
        picked = moe.pick_config(H, I)
        for which, nbytes, ks in (("gate_up", gu_bytes, (128, 256, 512)),
                                  ("down", dn_bytes, (128, 256, 512))):
            if which not in a.launches.split(","):
                continue
            def call(cfg):
                if which == "gate_up":
                    return lambda i: moe.experts_gate_up(x, gate_up, ids[i % 64], sgu, cfg)
                return lambda i: moe.experts_down(h, down, ids[i % 64], w, x.dtype, None, sg, sdn, cfg)

            def check(cfg):
                out = call(cfg)(0)
                ref = ref_h if which == "gate_up" else ref_y
                assert torch.allclose(out.float(), ref.float(), atol=2e-2, rtol=2e-2), (name, which, cfg)

            row = {}
            steps = (H if which == "gate_up" else I)
            grid = ((2, 4, 8, 16), ks + (1024,), (2, 4, 8)) if a.all_unrolled else ((4, 8, 16), ks, (4, 8))
            for bn, bk, nw in itertools.product(*grid):
                if bn * bk > 8192:
                    continue
                for unroll in ((1, -(-steps // bk)) if a.all_unrolled else (1,)):
                    check((bn, bk, nw, unroll))
                    row[(bn, bk, nw, unroll)] = time_graph(call((bn, bk, nw, unroll)), 256)
            if which == "down":  # the experts as a tile dimension (moe._down_wide_kernel)
                slots = triton.next_power_of_2(n)
                for bn, bk, nw in itertools.product((1, 2, 4, 8), (64, 128, 256, 512), (2, 4, 8)):
                    if 1024 <= slots * bn * bk <= 16384 and bk <= triton.next_power_of_2(I):
                        check((bn, bk, nw, 1, True))
                        row[(bn, bk, nw, 1, True)] = time_graph(call((bn, bk, nw, 1, True)), 256)
            for bn, bk, nw, _ in [c[:4] for c in sorted(row, key=row.get) if len(c) == 4][:3]:
                cfg = (bn, bk, nw, -(-steps // bk))
                check(cfg)
                row[cfg] = time_graph(call(cfg), 256)
            mine = picked[0] if which == "gate_up" else picked[1]
            if mine not in row:
                check(mine)
                row[mine] = time_graph(call(mine), 256)
            top = sorted(row, key=row.get)
            print(f"{name} {which} ({nbytes / 1e6:.1f} MB a call): picked {mine} {row[mine]:.2f} us "
                  f"({nbytes / row[mine] / 1e3:.0f} GB/s); best " + ", ".join(
                      f"{c}={row[c]:.2f} us ({nbytes / row[c] / 1e3:.0f} GB/s)" for c in top[:5]), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
