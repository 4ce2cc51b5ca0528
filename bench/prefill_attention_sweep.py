"""The Triton causal prefill attention (models/kernels/cuda/prefill_attention.py) against torch's
flash kernel and the form attend_cached took before it, on one CUDA device: microseconds a call
(CUDA events, median of --iters after warm-up), TFLOP/s of the causal product, and the largest
error against the fp32 masked form, for each tile config in --configs or the default sweep.

    python3 bench/prefill_attention_sweep.py [--shapes H,KVH,D,START,T ...] [--iters 20] [--reps 1]

A shape with START > 0 is a continued prefill (a later turn over START cached tokens); there the
old form is the masked memory-efficient kernel over expanded KV heads. Also checks that a
continued prefill gives the bits of a cold prefill of the whole text (the kernel's contract)."""
from __future__ import annotations

import argparse
import functools
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cuda_events import median_us  # noqa: E402

from models.architectures import layers  # noqa: E402
from models.kernels.cuda import prefill_attention as pa  # noqa: E402

SWEEP = {
    64: [(128, 64, 4, 3), (128, 128, 4, 3), (64, 64, 4, 4), (128, 64, 8, 3), (128, 32, 4, 4)],
    128: [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3), (128, 32, 4, 4), (128, 64, 8, 4),
          (128, 128, 8, 2), (64, 128, 4, 3)],
    256: [(64, 64, 4, 2), (64, 32, 4, 3), (128, 64, 8, 2), (64, 64, 8, 2), (128, 32, 8, 2), (64, 64, 4, 3),
          (128, 64, 8, 1), (64, 128, 8, 1)],
}


def reference(q, kc, vc, start):
    H, T, D = q.shape
    n = start + T
    rep = H // kc.shape[0]
    k = kc[:, :n].float().repeat_interleave(rep, 0)
    v = vc[:, :n].float().repeat_interleave(rep, 0)
    pos = torch.arange(start, start + T, device=q.device)
    mask = torch.zeros(T, n, device=q.device).masked_fill(torch.arange(n, device=q.device)[None, :] > pos[:, None],
                                                          float("-inf"))
    o = F.scaled_dot_product_attention(q.float()[None], k[None], v[None], attn_mask=mask)[0]
    return o.transpose(0, 1).reshape(T, -1)


def old_form(q, kc, vc, start):
    T = q.shape[1]
    n = start + T
    mask = None
    if start:
        mask = layers.causal_mask(torch.arange(start, n, device=q.device), n, q.dtype)
    return layers.attend_cached(q, kc, vc, n, mask)


def main() -> None:
    from engine.device import configure_process
    configure_process()  # (the environment's diagnosis switches and folders, as chat takes them)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="*", default=["32,4,128,0,2048", "24,4,256,0,2048", "16,2,256,0,2048",
                                                    "14,2,64,0,2048", "32,4,128,14000,2048", "24,4,256,16000,201"])
    ap.add_argument("--configs", default="", help="BMxBNxWxS,... (else the sweep for the head size)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--reps", type=int, default=1, help="calls queued back to back a sample (cuda_events.py)")
    args = ap.parse_args()
    timed = functools.partial(median_us, reps=args.reps)
    for spec in args.shapes:
        H, KVH, D, start, T = (int(x) for x in spec.split(","))
        g = torch.Generator(device="cuda").manual_seed(H + D + T)
        q = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16, generator=g).transpose(0, 1)
        kc, vc = (torch.randn(KVH, start + T + 64, D, device="cuda", dtype=torch.bfloat16, generator=g)
                  for _ in range(2))
        ref = reference(q, kc, vc, start)
        flops = 4 * H * D * T * (start + (T + 1) / 2)
        layers.TRITON_PREFILL_ATTENTION = False
        us = timed(lambda: old_form(q, kc, vc, start), args.iters)
        err = (old_form(q, kc, vc, start).float() - ref).abs().max().item()
        layers.TRITON_PREFILL_ATTENTION = True
        print(f"[{spec}] torch form (attend_cached before): {us:8.1f} us {flops / us / 1e6:6.1f} TFLOP/s err {err:.3g}")
        if start == 0:
            fl = timed(lambda: layers._flash_lse(q[None], kc[None, :, :T], vc[None, :, :T], causal=True), args.iters)
            print(f"[{spec}] flash kernel alone: {fl:8.1f} us {flops / fl / 1e6:6.1f} TFLOP/s")
        configs = ([tuple(int(x) for x in c.split("x")) for c in args.configs.split(",")] if args.configs
                   else SWEEP[pa._padded(D)])
        for cfg in [None] + configs:
            try:
                out = pa.causal(q, kc, vc, start, cfg)
                torch.cuda.synchronize()
            except Exception as e:  # a tile that does not fit (shared memory): its one-line reason
                print(f"[{spec}] {cfg}: failed: {str(e).splitlines()[0][:120]}")
                continue
            us = timed(lambda: pa.causal(q, kc, vc, start, cfg), args.iters)
            err = (out.float() - ref).abs().max().item()
            name = f"default {pa.launch_config(D)}" if cfg is None else str(cfg)
            print(f"[{spec}] triton {name}: {us:8.1f} us {flops / us / 1e6:6.1f} TFLOP/s err {err:.3g}")
        if start:  # the continued prefill's bits against a cold prefill of the whole text
            qa = torch.randn(start + T, H, D, device="cuda", dtype=torch.bfloat16, generator=g).transpose(0, 1)
            qa[:, start:] = q
            cold = pa.causal(qa, kc, vc, 0)[start:]
            print(f"[{spec}] continued == cold prefill's rows: {torch.equal(cold, pa.causal(q, kc, vc, start))}")


if __name__ == "__main__":
    main()
