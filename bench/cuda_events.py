"""Timing of one CUDA call for the kernel sweeps (prefill_attention_sweep.py, moe_prefill_sweep.py):
`median_us(fn, iters)` is the median of `iters` calls' times in microseconds between CUDA events
recorded around each call (the host's launch time included: each call is synchronized), after three
untimed calls. `median_us(fn, iters, reps)` with reps > 1 records the events around `reps` calls
queued back to back and divides, so that the host's launch time of one call overlaps the device's
work on the one before (bench/RESULTS.md set V: even so, the grouped GEMMs read above their
profiled times)."""
from __future__ import annotations

import torch


def median_us(fn, iters: int, reps: int = 1) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / reps)
    return sorted(times)[len(times) // 2]
