"""A/B of CUDA prefill variants on quantized weights against bf16, interleaved in one process (the
same shape's bf16 and quantized models held side by side; drift between separate runs would
swamp a few percent).

    python bench/ab_prefill.py NAME [NAME ...] [--format Q4_K] [--variants bf16,base]
        [--prefill 2048] [--rounds 5]
Each round times one `--prefill`-token prefill per variant, in turn, on a fresh session (after one
untimed prefill of each at the start). Prints the median tok/s per variant and its ratio to the
first. Variants: bf16 (the bf16 model), base (the quantized model, the defaults), bf16-nosolve and
nosolve (the same with the Gated DeltaNet prefill's triangular solve in torch, not
cuda_scan.solve: gated_delta.FUSED_SOLVE), bf16-tritonlaunch (every Triton kernel launched
through Triton's own call, not launcher.py's direct one), bf16-noraw and noraw (the Gated
DeltaNet's q/k norms, g, beta and output norm in torch: qwen3_5.FUSED_PROLOGUE), bf16-flash
(prefill attention by torch's flash kernel, not prefill_attention.py's: layers.TRITON_PREFILL_ATTENTION),
bf16-torchgrouped (the MoE prefill's GEMMs by torch._grouped_mm, not grouped.py's: moe.TRITON_GROUPED),
bf16-wholetiles (grouped.py's GEMMs without half tiles: grouped.HALF_TILES), bf16-apartcombine (the MoE
prefill's combine as its own launch, not joined with the next add_norm's: moe.FUSED_COMBINE), fp8dequant
(an FP8 model's linears dequantized to bf16, then torch's GEMM, not fp8_gemm.py's FP8 GEMM:
fp8_gemm.MODE "dequant"). A variant sets module attributes for its runs (the
noahead variant of branch next-dequant-ahead set quant.AHEAD: bench/RESULTS.md set S).
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
from models.architectures import gated_delta, layers, moe, qwen3_5  # noqa: E402
from models.kernels.cuda import fp8_gemm, grouped, launcher  # noqa: E402
from shapes import random_model, random_quantized_model  # noqa: E402

NOSOLVE = {(gated_delta, "FUSED_SOLVE"): False}
TRITON_LAUNCH = {(launcher, "ENABLED"): False}
NORAW = {(qwen3_5, "FUSED_PROLOGUE"): False}
FLASH = {(layers, "TRITON_PREFILL_ATTENTION"): False}
TORCH_GROUPED = {(moe, "TRITON_GROUPED"): False}
WHOLE_TILES = {(grouped, "HALF_TILES"): False}
APART_COMBINE = {(moe, "FUSED_COMBINE"): False}
FP8_DEQUANT = {(fp8_gemm, "MODE"): "dequant"}
VARIANTS = {"bf16": ("bf16", {}), "base": ("quantized", {}), "bf16-nosolve": ("bf16", NOSOLVE),
            "nosolve": ("quantized", NOSOLVE), "bf16-tritonlaunch": ("bf16", TRITON_LAUNCH),
            "bf16-noraw": ("bf16", NORAW), "noraw": ("quantized", NORAW), "bf16-flash": ("bf16", FLASH),
            "bf16-torchgrouped": ("bf16", TORCH_GROUPED), "bf16-wholetiles": ("bf16", WHOLE_TILES),
            "bf16-apartcombine": ("bf16", APART_COMBINE), "fp8dequant": ("quantized", FP8_DEQUANT)}


def prefill_seconds(model, ids: list[int], settings: dict) -> float:
    saved = {k: getattr(*k) for k in settings}
    for (mod, attr), v in settings.items():
        setattr(mod, attr, v)
    try:
        s = DecodeSession(model, max_context=len(ids) + 8, device=torch.device("cuda"), dtype=torch.bfloat16,
                          cuda_graph="off")
        torch.cuda.synchronize()
        t = time.perf_counter()
        s.prefill(ids)
        torch.cuda.synchronize()
        return time.perf_counter() - t
    finally:
        for (mod, attr), v in saved.items():
            setattr(mod, attr, v)


def main() -> None:
    from engine.device import configure_process
    configure_process()  # (the environment's diagnosis switches and folders, as chat takes them)
    ap = argparse.ArgumentParser()
    ap.add_argument("names", nargs="+")
    ap.add_argument("--format", default="Q4_K")
    ap.add_argument("--variants", default="bf16,base")
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    from models import plan as kernel_plan
    dev = torch.device("cuda")
    variants = a.variants.split(",")
    for name in a.names:
        kinds = {VARIANTS[v][0] for v in variants}
        models = {"bf16": random_model(name, dev, torch.bfloat16) if "bf16" in kinds else None}
        if "quantized" in kinds:
            models["quantized"] = random_quantized_model(name, a.format, dev, torch.bfloat16)
            kernel_plan.bind(models["quantized"], dev, torch.bfloat16)
        vocab = next(m for m in models.values() if m is not None).config.vocab_size
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
        print(f"{name} {a.format if 'quantized' in kinds else 'bf16'} {a.prefill}-token prefill, tok/s (median of {a.rounds}): " + "; ".join(cells),
              flush=True)
        del models
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
