"""Where a cold CUDA start spends its kernel compiles: each Triton compile timed, with the
session's side-by-side compiles run on N threads.

    TRITON_CACHE_DIR=$(mktemp -d) python bench/compile_times.py [NAME] [--workers 16]
Builds NAME's random-weight model (default qwen3.5-0.8b), starts an ungraphed session (which
compiles its prefill and decode kernels: DecodeSession._precompile), and prints the session's
time, the number of compiles, their summed time (more than the wall time where threads overlap)
and the slowest ones. Point TRITON_CACHE_DIR at an empty folder, or every compile is a cache hit.
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import triton.compiler  # noqa: E402

from engine.session import DecodeSession  # noqa: E402
from models.kernels.cuda import base as cuda_base  # noqa: E402
from shapes import random_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("name", nargs="?", default="qwen3.5-0.8b")
    ap.add_argument("--workers", type=int, default=0, help="compile threads (default: the session's own choice)")
    a = ap.parse_args()
    times, lock = [], threading.Lock()
    compile_fn = triton.compiler.compile

    def timed(src, *args, **kwargs):  # JITFunction binds triton.compiler.compile at its first launch
        t = time.perf_counter()
        out = compile_fn(src, *args, **kwargs)
        with lock:
            times.append((time.perf_counter() - t, getattr(src, "name", "?"), str(getattr(src, "constants", ""))))
        return out

    triton.compiler.compile = timed
    precompiling = cuda_base.precompiling
    cuda_base.precompiling = lambda workers=None: precompiling(a.workers or workers)
    dev = torch.device("cuda")
    model = random_model(a.name, dev, torch.bfloat16)
    torch.cuda.synchronize()
    t = time.perf_counter()
    DecodeSession(model, max_context=4096, device=dev, dtype=torch.bfloat16, cuda_graph="off")
    torch.cuda.synchronize()
    print(f"{a.name}: session start {time.perf_counter() - t:.2f} s with {a.workers or 'default'} compile threads; "
          f"{len(times)} compiles, {sum(x[0] for x in times):.2f} s summed")
    for dt, name, constants in sorted(times, reverse=True)[:12]:
        print(f"  {dt:6.2f} s  {name}  {constants[:100]}")


if __name__ == "__main__":
    main()
