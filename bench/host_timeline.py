"""Where a prefill's time goes between the host and the GPU, run after run (CUDA only).

    python bench/host_timeline.py NAME [--prefill 2048] [--runs 10] [--every 25] [--cpus 2,3]
        [--out FILE.json]

Each of `--runs` prefills of one session (the same `--prefill` random tokens, reset between
runs) is timed four ways: its wall time (to a device sync), when the host had queued it, the
host thread's CPU time over it (time.thread_time: below the wall time where the thread was off
its core), and the GPU's time between CUDA events recorded before every `--every`th Triton
launch. Each Triton launch (launcher.launch, which every kernel wrapper calls) records its host
timestamp and kernel name, so a slow run can be compared with a fast one launch by launch: a
uniformly slower host (every gap longer) or a few long stalls (which kernel's launch). The
process's context switches and page faults (getrusage) and the caching allocator's device
allocations (torch.cuda.memory_stats) are recorded per run too. `--cpus`: pin the process to those
cores first (os.sched_setaffinity), as an A/B of the OS's placement.

Prints one JSON line per run and a comparison of the slowest run with the fastest: the host's
time per kernel name (from each launch of it to the next launch of any kernel) and the GPU's
time per segment between events. `--out` keeps every launch's timestamp.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from engine.session import DecodeSession  # noqa: E402
from models.kernels.cuda import launcher  # noqa: E402
from shapes import random_model  # noqa: E402


class Recorder:
    """Wraps launcher.launch: each launch's (ns, name); a CUDA event before every `every`th."""

    def __init__(self, every: int):
        self.every, self.on = every, False
        self.stamps: list[tuple[int, str]] = []
        self.events: list[tuple[int, torch.cuda.Event]] = []
        self._launch = launcher.launch

    def __call__(self, kernel, grid, args, kwargs):
        if self.on:
            i = len(self.stamps)
            if i % self.every == 0:
                ev = torch.cuda.Event(enable_timing=True)
                ev.record()
                self.events.append((i, ev))
            fn = getattr(kernel, "fn", kernel)
            self.stamps.append((time.perf_counter_ns(), getattr(fn, "__name__", str(fn))))
        self._launch(kernel, grid, args, kwargs)

    def start(self):
        self.stamps, self.events, self.on = [], [], True

    def stop(self):
        self.on = False


def run_once(s, ids, rec: Recorder) -> dict:
    ru0, st0 = resource.getrusage(resource.RUSAGE_SELF), torch.cuda.memory_stats()
    s.reset()
    torch.cuda.synchronize()
    begin = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    rec.start()
    t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
    begin.record()
    s.prefill(ids)
    end.record()
    queued, cpu = time.perf_counter_ns() - t0, time.thread_time_ns() - c0
    rec.stop()
    torch.cuda.synchronize()
    wall = time.perf_counter_ns() - t0
    ru1, st1 = resource.getrusage(resource.RUSAGE_SELF), torch.cuda.memory_stats()
    stamps = [(t - t0, name) for t, name in rec.stamps]
    seg = [begin] + [ev for _, ev in rec.events] + [end]
    gpu = [a.elapsed_time(b) for a, b in zip(seg, seg[1:])]
    return dict(wall_ms=wall / 1e6, queued_ms=queued / 1e6, thread_cpu_ms=cpu / 1e6,
                gpu_ms=begin.elapsed_time(end), launches=len(stamps),
                nvcsw=ru1.ru_nvcsw - ru0.ru_nvcsw, nivcsw=ru1.ru_nivcsw - ru0.ru_nivcsw,
                minflt=ru1.ru_minflt - ru0.ru_minflt,
                device_allocs=st1.get("num_device_alloc", 0) - st0.get("num_device_alloc", 0),
                device_frees=st1.get("num_device_free", 0) - st0.get("num_device_free", 0),
                _stamps=stamps, _segments=[i for i, _ in rec.events], _gpu=gpu, _queued=queued)


def host_by_name(r: dict) -> dict[str, float]:
    """ms of host time from each launch of a kernel to the next launch (the last: to queued)."""
    out: dict[str, float] = {}
    st = r["_stamps"]
    for (t, name), nxt in zip(st, [t for t, _ in st[1:]] + [r["_queued"]]):
        out[name] = out.get(name, 0.0) + (nxt - t) / 1e6
    return out


def compare(slow: dict, fast: dict) -> dict:
    hs, hf = host_by_name(slow), host_by_name(fast)
    names = sorted(hs, key=lambda n: -(hs[n] - hf.get(n, 0.0)))
    gaps = lambda r: [(b - a) / 1e3 for (a, _), (b, _) in zip(r["_stamps"], r["_stamps"][1:])]  # noqa: E731
    gs, gf = gaps(slow), gaps(fast)
    return dict(
        host_ms_by_kernel=[(n, round(hs[n], 3), round(hf.get(n, 0.0), 3)) for n in names[:12]],
        gap_us_median=(round(statistics.median(gs), 1), round(statistics.median(gf), 1)),
        gap_us_p90=(round(sorted(gs)[int(0.9 * len(gs))], 1), round(sorted(gf)[int(0.9 * len(gf))], 1)),
        gap_us_max=(round(max(gs), 1), round(max(gf), 1)),
        longest_gaps_slow=sorted(((round(g, 1), i, slow["_stamps"][i][1]) for i, g in enumerate(gs)),
                                 reverse=True)[:8],
        gpu_segment_ms=[(round(a, 3), round(b, 3)) for a, b in zip(slow["_gpu"], fast["_gpu"])],
    )


def main() -> None:
    from engine.device import configure_process
    configure_process()  # (the environment's diagnosis switches and folders, as chat takes them)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("name")
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--every", type=int, default=25)
    ap.add_argument("--cpus", default="", help="cores to pin the process to, e.g. 2,3")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    if a.cpus:
        os.sched_setaffinity(0, {int(c) for c in a.cpus.split(",")})
    model = random_model(a.name, torch.device("cuda"), torch.bfloat16)
    torch.cuda.synchronize()
    ids = torch.randint(0, model.config.vocab_size, (a.prefill,), generator=torch.Generator().manual_seed(1)).tolist()
    s = DecodeSession(model, max_context=a.prefill + 8, device=torch.device("cuda"), dtype=torch.bfloat16,
                      cuda_graph="off")
    rec = Recorder(a.every)
    launcher.launch = rec
    s.prefill(ids)  # compiles, first launches through Triton's own call
    runs = []
    for i in range(a.runs):
        r = run_once(s, ids, rec)
        runs.append(r)
        print(json.dumps({"run": i, **{k: (round(v, 3) if isinstance(v, float) else v)
                                       for k, v in r.items() if not k.startswith("_")}}), flush=True)
    slow, fast = max(runs, key=lambda r: r["wall_ms"]), min(runs, key=lambda r: r["wall_ms"])
    print(json.dumps({"slowest_vs_fastest": compare(slow, fast)}), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump([{k: v for k, v in r.items()} for r in runs], f)


if __name__ == "__main__":
    main()
