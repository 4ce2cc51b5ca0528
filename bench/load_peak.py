"""Peak device memory of building a benchmark shape and fusing its projections, against its
weights: `python bench/load_peak.py [--device cuda] [--dtype bfloat16] [--decode 16] SHAPE...`.

Each shape is built as bench/shapes.py builds it (random weights, then `models.fuse`, the loader's
own step) in this process; the line printed gives the bytes of its weights, the peak allocated
while building and fusing, and their ratio (1.0 plus one module's fused matrices is the goal:
tests/engine/test_load_memory.py). With --decode N, a greedy decode of N tokens follows on one
DecodeSession to show the model runs in what is left.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.shapes import SHAPES, random_model  # noqa: E402



def main() -> None:
    from engine.device import configure_process
    configure_process()  # (the environment's diagnosis switches and folders, as chat takes them)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shapes", nargs="+", choices=sorted(SHAPES))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--decode", type=int, default=0, help="greedy tokens decoded after the load (0: none)")
    args = ap.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if device.type != "cuda":
        raise SystemExit("load_peak: the device's allocator is what is measured: --device cuda")
    total = torch.cuda.get_device_properties(device).total_memory
    for name in args.shapes:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        t = time.perf_counter()
        model = random_model(name, device, dtype)
        torch.cuda.synchronize(device)
        seconds = time.perf_counter() - t
        weights = sum(p.nbytes for p in model.parameters()) + sum(b.nbytes for b in model.buffers())
        peak = torch.cuda.max_memory_allocated(device) - base
        line = (f"{name} {args.dtype}: weights {weights / 2**30:.2f} GiB, peak while building and fusing "
                f"{peak / 2**30:.2f} GiB ({peak / weights:.3f}x), card {total / 2**30:.1f} GiB, {seconds:.1f} s")
        if args.decode:
            from engine.config import SamplingConfig
            from engine.session import DecodeSession
            session = DecodeSession(model, max_context=512, device=device, dtype=dtype)
            sampling = SamplingConfig(temperature=0.0, max_new_tokens=args.decode)
            t = time.perf_counter()
            out = list(session.generate(list(range(1, 17)), sampling))
            torch.cuda.synchronize(device)
            line += f"; decoded {len(out)} tokens in {time.perf_counter() - t:.1f} s"
        print(line, flush=True)
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
