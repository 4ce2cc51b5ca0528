"""One planar dequant-GEMV at a time, for a profiler's counters (Nsight Compute) on the 27B-like
shape's two largest matrices: `ncu --clock-control none --section SpeedOfLight --section Occupancy
--section LaunchStats --section WarpStateStats -k regex:_planar_gemv -s 6 -c 2 python3
bench/gemv_counters.py [--format Q4_K|AWQ]`. Each matrix's GEMV (int8 inputs, pick_config's
split, its quantize and reduce launches) runs 4 times: the first compiles, the profiler skips
what it is told to. `--time`: also the microseconds a call of each (100 calls in a CUDA graph),
without the profiler."""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402



def main() -> None:
    from engine.device import configure_process
    configure_process()  # (the environment's diagnosis switches and folders, as chat takes them)
    ap = argparse.ArgumentParser()
    ap.add_argument("--format", default="Q4_K")
    ap.add_argument("--time", action="store_true")
    a = ap.parse_args()
    from models.quant import planar
    from models.kernels.cuda import qplanar
    from quant_bench import _graph_us
    from shapes import random_quant_linear
    dev, gen = torch.device("cuda"), torch.Generator(device="cuda").manual_seed(0)
    repack = planar.repack_q4k if a.format == "Q4_K" else planar.repack_int4p
    for n, k, swiglu in ((34816, 5120, True), (5120, 17408, False)):
        pw = repack(random_quant_linear(a.format, n, k, dev, gen).qweight())
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16, generator=gen)
        for _ in range(4):
            qplanar.gemv(x, pw, swiglu=swiglu)
        torch.cuda.synchronize()
        if a.time:
            us = _graph_us(lambda: qplanar.gemv(x, pw, swiglu=swiglu))
            config = qplanar.pick_config(n // (2 if swiglu else 1), k, pw.group)
            print(f"{a.format} [{n}, {k}]{' SwiGLU' if swiglu else ''}: config {config}, {us:.1f} us a call, "
                  f"{pw.nbytes() / us / 1e6:.2f} TB/s", flush=True)


if __name__ == "__main__":
    main()
