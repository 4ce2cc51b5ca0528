"""Timing of one CUDA call for the kernel sweeps (prefill_attention_sweep.py, moe_prefill_sweep.py):
`median_us(fn, iters)` is the median of `iters` calls' times in microseconds between CUDA events
recorded around each call (the host's launch time included: each call is synchronized), after three
untimed calls. `median_us(fn, iters, reps)` with reps > 1 records the events around `reps` calls
queued back to back and divides: the host queues ahead of the device, so a call of more than a few
launches' host time is timed by the device's time alone (where one synchronized call of a 150 us
kernel read ~50 us more on a slow host: bench/RESULTS.md, set V)."""
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
