"""The MoE prefill's routed experts on one CUDA device: grouped.py's GEMMs (x's rows read in place,
SwiGLU in the epilogue) against torch._grouped_mm over a sorted copy of the rows, microseconds a
layer (CUDA events, median of --iters after warm-up; the sort and combine included in both),
for each tile config of the sweep, and the largest error of each against the fp32 per-expert loop.

    python3 bench/moe_prefill_sweep.py [--shapes E,H,I,K,T ...] [--iters 20] [--reps 1]
        [--gate-up BMxBNxBKxWxS,...] [--down BMxBNxBKxWxS,...]
--reps N: each sample times N calls queued back to back (the device's time, not the host's
launches: cuda_events.py). Also times the default configs with every tile whole
(grouped.HALF_TILES off) beside them.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cuda_events import median_us  # noqa: E402

from models.architectures import moe  # noqa: E402
from models.kernels.cuda import grouped  # noqa: E402
from models.kernels.cuda import moe as cuda_moe  # noqa: E402

SWEEP = ["128x128x64x8x3", "128x128x64x8x4", "64x128x64x4x4", "128x64x64x4x4", "64x64x64x4x4", "128x256x64x8x3",
         "64x256x64x8x3"]


def cfg(text: str) -> tuple:
    return tuple(int(v) for v in text.split("x"))


def main() -> None:
    from engine.device import configure_process
    configure_process()  # (the environment's diagnosis switches and folders, as chat takes them)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="*", default=["128,2048,768,8,2048", "256,2048,512,8,2048"])
    ap.add_argument("--gate-up", default=",".join(SWEEP))
    ap.add_argument("--down", default=",".join(SWEEP))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--reps", type=int, default=1)
    args = ap.parse_args()
    timed = functools.partial(median_us, reps=args.reps)
    for spec in args.shapes:
        E, H, I, k, T = (int(v) for v in spec.split(","))
        torch.manual_seed(E + T)
        ex = moe.Experts(E, H, I).cuda().to(torch.bfloat16)
        with torch.no_grad():
            ex.gate_up_proj.normal_(0, H ** -0.5)
            ex.down_proj.normal_(0, I ** -0.5)
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        logits = torch.randn(T, E, device="cuda")
        idx, w = cuda_moe.route(logits, k, True)
        with torch.no_grad():
            ref = moe.Experts(E, H, I).cuda()
            ref.gate_up_proj.copy_(ex.gate_up_proj.float())
            ref.down_proj.copy_(ex.down_proj.float())
            old_form = moe.EXPERTS_FORM
            moe.EXPERTS_FORM = "loop"
            exact = ref(x.float(), idx, w)
            moe.EXPERTS_FORM = old_form
        with torch.inference_mode():
            moe.TRITON_GROUPED = False
            torch_us = timed(lambda: ex.grouped(x, idx, w), args.iters)
            err = (ex.grouped(x, idx, w).float() - exact).abs().max().item()
            moe.TRITON_GROUPED = True
            scale = exact.abs().max().item()
            print(f"[{spec}] torch._grouped_mm form: {torch_us:8.1f} us a layer, err {err:.3g} (of {scale:.3g})")
            src, inv, starts, offs = cuda_moe.sort_pairs(x, idx, E, copy=False)
            wc = w.float().contiguous()
            h = grouped.gate_up(x, src, starts, offs, ex.gate_up_proj)
            for c in args.gate_up.split(","):
                try:
                    us = timed(lambda: grouped.gate_up(x, src, starts, offs, ex.gate_up_proj, cfg(c)), args.iters)
                except Exception as e:  # a tile that does not fit: its one-line reason
                    print(f"[{spec}] gate_up {c}: failed: {str(e).splitlines()[0][:100]}")
                    continue
                print(f"[{spec}] gate_up {c}: {us:8.1f} us")
            for c in args.down.split(","):
                try:
                    us = timed(lambda: grouped.down(h, starts, offs, ex.down_proj, cfg(c)), args.iters)
                except Exception as e:
                    print(f"[{spec}] down {c}: failed: {str(e).splitlines()[0][:100]}")
                    continue
                print(f"[{spec}] down {c}: {us:8.1f} us")
            for half in (True, False):
                grouped.HALF_TILES = half
                gu_us = timed(lambda: grouped.gate_up(x, src, starts, offs, ex.gate_up_proj), args.iters)
                dn_us = timed(lambda: grouped.down(h, starts, offs, ex.down_proj), args.iters)
                print(f"[{spec}] defaults, {'half tiles' if half else 'every tile whole'}: gate_up {gu_us:8.1f} us, "
                      f"down {dn_us:8.1f} us")
            grouped.HALF_TILES = True
            sort_us = timed(lambda: cuda_moe.sort_pairs(x, idx, E, copy=False), args.iters)
            comb_us = timed(lambda: cuda_moe.combine(grouped.down(h, starts, offs, ex.down_proj), inv, wc), args.iters)
            new_us = timed(lambda: ex.grouped(x, idx, w), args.iters)
            err = (ex.grouped(x, idx, w).float() - exact).abs().max().item()
            print(f"[{spec}] grouped.py form (defaults {grouped.GATE_UP_CONFIG}, {grouped.DOWN_CONFIG}): "
                  f"{new_us:8.1f} us a layer ({torch_us / new_us:.3f}x), err {err:.3g}; the sort alone {sort_us:.1f}, "
                  f"down + combine {comb_us:.1f}")


if __name__ == "__main__":
    main()
