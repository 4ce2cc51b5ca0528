"""Timing of one CUDA call for the kernel sweeps (prefill_attention_sweep.py, moe_prefill_sweep.py):
`median_us(fn, iters)` is the median of `iters` calls' times in microseconds between CUDA events
recorded around each call (the host's launch time included: each call is synchronized), after three
untimed calls."""
from __future__ import annotations

import torch


def median_us(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000)
    return sorted(times)[len(times) // 2]
