"""Where a GGUF's decode time goes in the layers' products, per weight format, on one core:
`python bench/block_gemv.py [--threads 1] [--repeats 5] FILE_OR_ALIAS...`.

Each layer's linears (quantized: auto) run once per repeat, in model order, with a random fp32
row as x, so the weights come from DRAM as in a decode step; the CPU time of each call (thread
time: steady on a shared machine) is summed per format: BlockLinear through the C++ step's
block_linear, Int4Linear through torch's int4 kernel (with its bf16 casts).
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))



def main() -> None:
    from engine.device import configure_process
    configure_process()  # (the environment's diagnosis switches and folders, as chat takes them)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("models", nargs="+")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    import torch
    torch.set_num_threads(a.threads)
    import models
    from models.formats import gguf_blocks
    from models.quant import layers as quant
    from models.kernels.cpu import step
    step.load()
    for path in a.models:
        lm = models.load(path, quantized=True)
        mods = [m for m in lm.model.model.layers.modules() if isinstance(m, (quant.BlockLinear, quant.Int4Linear))]
        xs = [torch.randn(1, m.in_features) for m in mods]
        spent, weights = collections.defaultdict(float), collections.defaultdict(int)
        for rep in range(a.repeats + 1):  # the first is a warm-up
            for m, x in zip(mods, xs):
                t = time.thread_time()
                if isinstance(m, quant.BlockLinear):
                    torch.ops.chat_cpu.block_linear(x, m.blocks, m.ggml_type)
                    kind = gguf_blocks.type_name(m.ggml_type)
                else:
                    m(x)
                    kind = "int4 (" + getattr(m, "gguf_kind", "?").upper() + ")"
                if rep:
                    spent[kind] += time.thread_time() - t
                    weights[kind] += m.in_features * m.out_features
        total = sum(spent.values()) / a.repeats
        parts = "; ".join(f"{k} {spent[k] / a.repeats * 1e3:.2f} ms ({weights[k] / spent[k] / 1e9:.1f} Gweights/s)"
                          for k in sorted(spent, key=lambda k: -spent[k]))
        print(f"{os.path.basename(lm.source)}: the layers' products {total * 1e3:.2f} ms a step "
              f"({a.threads} thread{'s' * (a.threads > 1)}, CPU time): {parts}")


if __name__ == "__main__":
    main()
