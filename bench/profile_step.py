"""Where a decode step's time goes: kernels per step and the top kernels by GPU time.

    python bench/profile_step.py NAME [--compile on] [--steps 20] [--format bf16|Q4_K|AWQ|FP8] [--gguf FILE]
                                 [--dtype bfloat16|float16]
Profiles eager decode steps (the step a CUDA graph records) with torch.profiler and compares
the GPU busy time with the graph-replayed step's wall time: the gap is launch overhead that a
graph cannot remove, the busy time is what fusion must shrink. `--prefill N`: one N-token
prefill instead, with the time the host took to queue it and the lines where it waited on the
device (torch.cuda's sync debug mode). `--gguf FILE`: that file's model, its quantized matrices
kept (as chat loads it on CUDA), instead of NAME's random one (NAME then only labels the output). `--sequence N`: a decode step's first N kernels in launch
order with their GPU times (one layer's launches, one by one). `--prefill N --host`: also where
the host's time goes while it queues the prefill (cProfile, the costliest functions by their own
time), and the host's microseconds a launch of a Triton GEMV against a torch op.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from collections import Counter, defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from engine.session import DecodeSession  # noqa: E402
from shapes import random_model  # noqa: E402

DTYPE = [torch.bfloat16]  # the activations' dtype (--dtype)


def top_kernels(prof, per: int, n: int = 8) -> None:
    """Kernels per run (of `per` runs), the GPU busy time, and the `n` costliest kernels."""
    per_kernel = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type.name == "CUDA":
            k = per_kernel[e.name[:70]]
            k[0] += 1
            k[1] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    busy = sum(v[1] for v in per_kernel.values()) / per / 1e3
    print(f"  {sum(v[0] for v in per_kernel.values()) / per:.0f} kernels, GPU busy {busy:.3f} ms")
    for name, (count, us) in sorted(per_kernel.items(), key=lambda kv: -kv[1][1])[:n]:
        print(f"  {us / per / 1e3:7.3f} ms  {count / per:5.0f}x  {name}")


def sequence(prof, per: int, n: int) -> None:
    """The first `n` kernels of a step in launch order, each with its GPU time averaged over the
    `per` steps (every step launches the same kernels): one layer's launches, one by one."""
    ev = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
    if not ev or len(ev) % per:
        print(f"  (no sequence: {len(ev)} kernels over {per} steps)")
        return
    k = len(ev) // per
    for i in range(min(n, k)):
        us = sum(ev[s * k + i].time_range.elapsed_us() for s in range(per)) / per
        print(f"  #{i:3d} {us:7.2f} us  {ev[i].name[:60]}")


def build(name: str, fmt: str, dev, gguf: str | None = None):
    """The shape's random model in `fmt`: bf16, or quant_bench's formats as the loader leaves them
    on CUDA (the kernel plan bound: models/plan); or the GGUF file's, loaded as chat loads it."""
    if gguf:
        import models
        return models.load(gguf, device=dev, dtype=DTYPE[0], quantized=True).model
    if fmt == "bf16":
        return random_model(name, dev, DTYPE[0])
    from models import plan as kernel_plan
    from shapes import random_quantized_model
    model = random_quantized_model(name, fmt, dev, DTYPE[0])
    kernel_plan.bind(model, dev, DTYPE[0])
    return model


def host_profile(s, ids, top: int) -> None:
    """cProfile over one prefill (the device synced after it): the functions with the most own time,
    and the host's cost a launch, a Triton kernel's (linear.gemv) against a torch op's."""
    import cProfile
    import pstats
    s.reset()
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    s.prefill(ids)
    torch.cuda.synchronize()
    pr.disable()
    st = pstats.Stats(pr)
    rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:top]
    total = sum(v[2] for v in st.stats.values())
    print(f"  host profile: {total * 1e3:.1f} ms of own time in {sum(v[1] for v in st.stats.values())} calls")
    for (f, line, fn), (cc, nc, tt, ct, _) in rows:
        print(f"  {tt * 1e3:8.2f} ms own {ct * 1e3:8.2f} cum {nc:6d}x  {os.path.basename(f)}:{line} {fn}")
    from models.kernels.cuda import launcher, linear
    x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)

    def triton_launch(direct: bool):
        def fn():
            saved, launcher.ENABLED = launcher.ENABLED, direct
            try:
                linear.gemv(x, w)
            finally:
                launcher.ENABLED = saved
        return fn
    for label, fn in (("Triton GEMV (linear.gemv), the direct launch", triton_launch(True)),
                      ("Triton GEMV (linear.gemv), Triton's launch", triton_launch(False)),
                      ("torch.add", lambda: torch.add(x, x))):
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(1000):
            fn()
        us = (time.perf_counter() - t) * 1e3
        torch.cuda.synchronize()
        print(f"  host time a call, {label}: {us:.1f} us")


def profile_prefill(name: str, n: int, fmt: str, top: int, host: bool = False, gguf: str | None = None) -> None:
    dev = torch.device("cuda")
    model = build(name, fmt, dev, gguf)
    s = DecodeSession(model, max_context=n + 8, device=dev, dtype=DTYPE[0], cuda_graph="off")
    ids = torch.randint(0, model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(1)).tolist()
    for _ in range(2):
        s.reset()
        s.prefill(ids)
    torch.cuda.synchronize()
    s.reset()
    torch.cuda.synchronize()
    t = time.perf_counter()
    s.prefill(ids)
    queued = (time.perf_counter() - t) * 1e3  # until the host had queued it all (or waited on a sync)
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t) * 1e3
    s.reset()
    torch.cuda.synchronize()
    # where the host waits on the device inside the prefill: each sync's line in our code
    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s.prefill(ids)
    torch.cuda.set_sync_debug_mode(0)
    syncs = Counter(f"{os.path.relpath(w.filename)}:{w.lineno}" for w in caught if "synchroniz" in str(w.message))
    s.reset()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        s.prefill(ids)
        torch.cuda.synchronize()
    print(f"{name}: prefill of {n} tokens {wall:.2f} ms wall ({n / wall * 1e3:.0f} tok/s); the host returned "
          f"after {queued:.2f} ms; {sum(syncs.values())} host syncs" + "".join(f"\n  sync at {k} x{v}" for k, v in
                                                                               syncs.most_common(6)))
    top_kernels(prof, 1, top)
    if host:
        host_profile(s, ids, max(top, 25))


def main() -> None:
    from engine.device import configure_process
    configure_process()  # (the environment's diagnosis switches and folders, as chat takes them)
    ap = argparse.ArgumentParser()
    ap.add_argument("name")
    ap.add_argument("--compile", default="off")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prefill", type=int, default=0, help="profile a prefill of this many tokens instead")
    ap.add_argument("--format", default="bf16", help="bf16, or a format of bench/quant_bench.py (Q4_K, AWQ, FP8)")
    ap.add_argument("--top", type=int, default=8, help="kernels listed")
    ap.add_argument("--sequence", type=int, default=0, help="also list a step's first N kernels in order")
    ap.add_argument("--host", action="store_true", help="with --prefill: where the host's time goes")
    ap.add_argument("--gguf", help="profile this GGUF's model (quantized matrices kept) instead of NAME's")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"], help="the activations' dtype")
    a = ap.parse_args()
    DTYPE[0] = getattr(torch, a.dtype)
    if a.prefill:
        return profile_prefill(a.name, a.prefill, a.format, a.top, a.host, a.gguf)
    dev = torch.device("cuda")
    model = build(a.name, a.format, dev, a.gguf)
    s = DecodeSession(model, max_context=512, device=dev, dtype=DTYPE[0], cuda_graph="on", compile=a.compile)
    s.prefill(list(range(1, 129)))
    for _ in range(5):
        s.step(7)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(a.steps):
        s.step(7)
    torch.cuda.synchronize()
    graph_ms = (time.perf_counter() - t) / a.steps * 1e3
    graph, s.graph = s.graph, None  # the same step, eager, for the profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(a.steps):
            s.step(7)
        torch.cuda.synchronize()
    s.graph = graph
    print(f"{a.name} {a.format} (compile={a.compile}): graph step {graph_ms:.3f} ms; its eager form:")
    top_kernels(prof, a.steps, a.top)
    if a.sequence:
        sequence(prof, a.steps, a.sequence)


if __name__ == "__main__":
    main()
