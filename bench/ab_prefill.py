"""A/B of CUDA prefill variants, interleaved in one process (as bench/ab_decode.py does for decode).

    python bench/ab_prefill.py NAME [NAME ...] [--format bf16|Q4_K|Q5_K|AWQ|FP8]
        [--variants base,noahead] [--rounds 5] [--prefill 2048]
For each shape: one model; each round runs one `--prefill`-token prefill per variant, in turn, on
one session each (after a warm-up prefill that also teaches prefill_weights the linears' order),
timed to the device's end. Prints the median tok/s per variant, its ratio to the first, and
whether the last position's logits equal the first variant's bit for bit. Variants: base (the
defaults), noahead (no weights dequantized ahead on a side stream: prefill_weights.AHEAD off).
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
from models.kernels.cuda import prefill_weights  # noqa: E402
from shapes import random_model, random_quantized_model  # noqa: E402

VARIANTS = {"base": dict(ahead=prefill_weights.AHEAD), "noahead": dict(ahead=False)}


def apply(variant: str) -> None:
    prefill_weights.AHEAD = VARIANTS[variant]["ahead"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="+")
    ap.add_argument("--variants", default="base,noahead")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument("--format", default="Q4_K", help="bf16, or Q4_K / Q5_K / AWQ / FP8 (random weights in that "
                    "format, repacked as the loader leaves them on CUDA)")
    a = ap.parse_args()
    dev = torch.device("cuda")
    variants = a.variants.split(",")
    for name in a.names:
        if a.format == "bf16":
            model = random_model(name, dev, torch.bfloat16)
        else:
            from models.formats.loader import repack_for_cuda
            model = random_quantized_model(name, a.format, dev, torch.bfloat16)
            repack_for_cuda(model)
        ids = torch.randint(0, model.config.vocab_size, (a.prefill,), generator=torch.Generator().manual_seed(1))
        ids = ids.tolist()
        speeds = {v: [] for v in variants}
        logits = {}
        for _ in range(a.rounds):
            for v in variants:
                apply(v)
                s = DecodeSession(model, max_context=a.prefill + 8, device=dev, dtype=torch.bfloat16,
                                  cuda_graph="off")
                s.prefill(ids)  # the warm-up
                s.reset()
                torch.cuda.synchronize()
                t = time.perf_counter()
                out = s.prefill(ids)
                torch.cuda.synchronize()
                speeds[v].append(a.prefill / (time.perf_counter() - t))
                logits[v] = out.reshape(-1).float().cpu()
                del s
        apply("base")
        prefill_weights.release()
        first = variants[0]
        base = statistics.median(speeds[first])
        for v in variants:
            med = statistics.median(speeds[v])
            same = torch.equal(logits[v], logits[first])
            print(f"{name:14} {a.format:5} {v:9} {med:9.1f} tok/s  {med / base:5.3f}x  (min {min(speeds[v]):.1f}, "
                  f"max {max(speeds[v]):.1f})  logits {'=' if same else '!='} {first}", flush=True)
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
