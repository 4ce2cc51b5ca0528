"""A/B of CUDA prefill variants on quantized weights against bf16, interleaved in one process (the
same shape's bf16 and quantized models held side by side; drift between separate runs would
swamp a few percent).

    python bench/ab_prefill.py NAME [NAME ...] [--format Q4_K] [--variants bf16,base]
        [--prefill 2048] [--rounds 5]
Each round times one `--prefill`-token prefill per variant, in turn, on a fresh session (after one
untimed prefill of each at the start). Prints the median tok/s per variant and its ratio to the
first. Variants: bf16 (the bf16 model), base (the quantized model, the defaults). A variant sets
attributes of models/formats/quant.py for its runs (the noahead variant of branch
next-dequant-ahead: bench/RESULTS.md set S).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from engine.session import DecodeSession  # noqa: E402
from models.formats import quant  # noqa: E402
from shapes import random_model, random_quantized_model  # noqa: E402

VARIANTS = {"bf16": ("bf16", {}), "base": ("quantized", {})}


def prefill_seconds(model, ids: list[int], settings: dict) -> float:
    saved = {k: getattr(quant, k) for k in settings}
    for k, v in settings.items():
        setattr(quant, k, v)
    try:
        s = DecodeSession(model, max_context=len(ids) + 8, device=torch.device("cuda"), dtype=torch.bfloat16,
                          cuda_graph="off")
        torch.cuda.synchronize()
        t = time.perf_counter()
        s.prefill(ids)
        torch.cuda.synchronize()
        return time.perf_counter() - t
    finally:
        for k, v in saved.items():
            setattr(quant, k, v)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("names", nargs="+")
    ap.add_argument("--format", default="Q4_K")
    ap.add_argument("--variants", default="bf16,base")
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    from models.formats.loader import repack_for_cuda
    dev = torch.device("cuda")
    variants = a.variants.split(",")
    for name in a.names:
        models = {"bf16": random_model(name, dev, torch.bfloat16) if "bf16" in variants else None}
        models["quantized"] = random_quantized_model(name, a.format, dev, torch.bfloat16)
        repack_for_cuda(models["quantized"])
        vocab = models["quantized"].config.vocab_size
        ids = torch.randint(0, vocab, (a.prefill,), generator=torch.Generator().manual_seed(1)).tolist()
        times = {v: [] for v in variants}
        for v in variants:  # compiles, allocator warm-up
            prefill_seconds(models[VARIANTS[v][0]], ids, VARIANTS[v][1])
        for _ in range(a.rounds):
            for v in variants:
                times[v].append(prefill_seconds(models[VARIANTS[v][0]], ids, VARIANTS[v][1]))
        first = a.prefill / statistics.median(times[variants[0]])
        cells = []
        for v in variants:
            tps = a.prefill / statistics.median(times[v])
            cells.append(f"{v} {tps:,.0f} ({tps / first:.3f}x)")
        print(f"{name} {a.format} {a.prefill}-token prefill, tok/s (median of {a.rounds}): " + "; ".join(cells),
              flush=True)
        del models
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
