"""One draw of each sampler version, per token: milliseconds (median), on the CPU and, where it
exists, on CUDA (logits on the device: version 2 copies the row to the host).

    python bench/sampling_bench.py [--reps 200] [--vocab 49152 151936]
Settings: greedy; the defaults (top-k 40, top-p 0.95, min-p 0.05); top-p 0.95 over the whole
vocabulary (top-k 0); temperature only (the whole vocabulary sorted); penalties with the defaults.
Logits are N(0, 3^2): flatter than a trained model's, so top-p over the whole vocabulary keeps
more tokens than it would in a conversation (an upper bound for that setting).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.config import SamplingConfig  # noqa: E402
from engine.sampling import make_sampler  # noqa: E402

SETTINGS = {
    "greedy": SamplingConfig(temperature=0),
    "defaults": SamplingConfig(temperature=0.7),
    "top-p, top-k 0": SamplingConfig(temperature=0.7, top_k=0, top_p=0.95, min_p=0.0),
    "temperature only": SamplingConfig(temperature=0.7, top_k=0, top_p=1.0, min_p=0.0),
    "defaults + penalties": SamplingConfig(temperature=0.7, repetition_penalty=1.1, frequency_penalty=0.1),
}


def per_draw_ms(version: int, cfg: SamplingConfig, vocab: int, device: torch.device, reps: int) -> float:
    g = torch.Generator().manual_seed(0)
    rows = [(torch.randn(vocab, generator=g) * 3).to(device) for _ in range(8)]
    context = torch.randint(0, vocab, (64,), generator=g).tolist()
    s = make_sampler(version, cfg, vocab, device, context, seed=1, turn=0)
    times = []
    for i in range(reps + 10):
        t0 = time.perf_counter()
        token = int(s(rows[i % len(rows)]))  # int(): the host sync a generation makes anyway
        times.append(time.perf_counter() - t0)
        s.accept(token)
    return statistics.median(times[10:]) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--vocab", type=int, nargs="+", default=[49152, 151936])
    args = p.parse_args()
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| device | vocabulary | setting | version 1 (ms) | version 2 (ms) |")
    print("|---|---|---|---|---|")
    for device in devices:
        for vocab in args.vocab:
            for name, cfg in SETTINGS.items():
                v1, v2 = (per_draw_ms(v, cfg, vocab, device, args.reps) for v in (1, 2))
                print(f"| {device.type} | {vocab} | {name} | {v1:.3f} | {v2:.3f} |")


if __name__ == "__main__":
    main()
