"""The CPU block products alone: G weights/s and GB/s of block_linear per GGUF type and shape, fp32
inputs against int8 ones (`cpu_int8`): one decode row, or a prefill's many.

    python bench/cpu_block_bench.py [--types Q4_0,Q5_0,Q8_0,Q4_K,Q5_K,Q6_K] [--shapes 3584x1024,1024x3584]
                                    [--threads N] [--rows 1] [--cached] [--cpu-isa native|avx2]

Each matrix is random blocks (finite fp16 scales) of N x K weights; enough copies of it are cycled
through that they exceed the last-level cache (100 MB), so the weights come from DRAM as a
model's decode reads them (`--cached`: one copy, the caches warm: the kernels' compute rate).
With more than 8 rows (`--rows 512 --cached`: a prefill), the fp32 column is what a prefill runs
with cpu_int8 off: BlockLinear's forward, the blocks dequantized by the library and one fp32 GEMM;
the int8 column is block_linear on int8 inputs; where the CPU multiplies bf16 natively
(step.bf16_gemm), the bf16 column is block_linear_bf16, which cpu_int8 on takes from
BlockLinear.PREFILL_ROWS rows. Printed: the best of 10 passes (GFLOP/s in place of GB/s for a
prefill), and the largest relative error against the fp64 product of the dequantized weights
(with x rounded as the int8 path rounds it, step.int8_reference, for int8; x and W rounded to
bf16 for bf16). `--cpu-isa avx2`: the library built for the AVX2 level and torch's kernels held
there too, as bench/cpu_bench.py --cpu-isa avx2 runs them (the process starts again with its
AVX2_ENV: cpu_bench.hold_to_isa).

With `--rows16`, the rows16 types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) get a rows16 column too: the
same int8 products on the blocks interleaved 16 rows at a time (models/quant/rows16.py), as the
kernel plan holds such a file's linears by default; and a wide column, the same layout on inputs
rounded to 16 bits (`cpu_int8: wide`).

    python bench/cpu_block_bench.py --verify [--types ...] [--shapes ...] [--threads N] [--cpu-isa ...]

times instead a speculative verify's products (block_linear_rows: each row's sums those of a
one-row call, the weights read once) of 2, 3, 4 and 8 rows against one row's (block_linear), fp32
and int8 inputs, the weights from DRAM: the cost of a verify of k drafts in steps of its linears.

    python bench/cpu_block_bench.py --mamba2 [48x64x128x1,128x64x128x8] [--threads N]

times instead a Mamba2 mixer's one-token step between its projections (models/architectures/
mamba2.py's torch form against the library's mamba2_decode, which a Mamba2 hybrid's GGUF blocks
take with cpu_kernel on), each mixer given as heads x head size x state size x groups (the
defaults: Granite 4.0-H-Tiny's and Nemotron-H-8B's), its projections 16 wide so that their cost
is negligible; best of 5 passes of 200 steps, in alternation, from the same random states.

    python bench/cpu_block_bench.py --experts [64x1536x512x6,128x2048x768x8] [--threads N]

times instead a token's routed experts (quant.BlockExperts' decode, E experts of H x I, top k;
the defaults: Granite-4.0-H-Tiny's and Qwen3-30B-A3B's) as a Q4_K_M file holds them (gate and up
Q4_K, down Q6_K, random blocks): BlockExperts' per-expert loop (the baseline) against the
library's experts_decode, on fp32 and on int8 inputs; the chosen experts drawn afresh each call
(their weights from DRAM as a decode reads them), best of 5 passes of 100 calls, in alternation.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cpu_bench import hold_to_isa  # noqa: E402
from models.formats import gguf_blocks  # noqa: E402
from models.quant import layers as quant  # noqa: E402
from models.quant import rows16  # noqa: E402
from models.kernels.cpu import step  # noqa: E402


def random_blocks(name: str, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    layout = gguf_blocks.LAYOUTS[gguf_blocks.TYPES[name]]
    nb = k // layout.block
    blocks = torch.randint(0, 256, (n, nb, layout.bytes), dtype=torch.uint8, generator=gen)
    f16 = lambda v: torch.tensor([v], dtype=torch.float16).view(torch.uint8)  # noqa: E731
    if name in ("Q4_K", "Q5_K"):
        blocks[:, :, 0:2], blocks[:, :, 2:4] = f16(0.01), f16(0.002)
    elif name == "Q6_K":
        blocks[:, :, 208:210] = f16(0.01)
    else:
        blocks[:, :, 0:2] = f16(0.01)
        if name in ("Q4_1", "Q5_1"):
            blocks[:, :, 2:4] = f16(-0.05)
    return blocks.reshape(n, nb * layout.bytes).contiguous()


def main() -> None:
    from engine.device import configure_process
    configure_process()  # (the environment's diagnosis switches and folders, as chat takes them)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--types", default="Q4_0,Q5_0,Q8_0,Q4_K,Q5_K,Q6_K")
    p.add_argument("--shapes", default="3584x1024,1024x3584,8192x2048")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--cached", action="store_true")
    p.add_argument("--cpu-isa", choices=("native", "avx2"), default="native")
    p.add_argument("--verify", action="store_true", help="a verify's rows against one row (block_linear_rows)")
    p.add_argument("--rows16", action="store_true", help="the rows16 types: the int8 products on the rows16 layout too")
    p.add_argument("--mamba2", nargs="?", const="48x64x128x1,128x64x128x8", default=None,
                   help="a Mamba2 mixer's step instead: HEADSxHEAD_DIMxSTATExGROUPS, comma-separated")
    p.add_argument("--experts", nargs="?", const="64x1536x512x6,128x2048x768x8", default=None,
                   help="a token's routed experts instead: EXPERTSxHIDDENxWIDTHxTOP_K, comma-separated")
    a = p.parse_args()
    hold_to_isa(a.cpu_isa)
    step.select_isa(a.cpu_isa)
    from engine.device import physical_cores
    torch.set_num_threads(a.threads or physical_cores())
    step.load()
    if a.mamba2:
        mamba2_steps(a.mamba2)
        return
    if a.experts:
        experts_calls(a.experts)
        return
    if a.verify:
        verify_rows(a.types, a.shapes)
        return
    block_linear = torch.ops.chat_cpu.block_linear
    modules: dict = {}

    def op(x, blocks, ggml, variant):
        if variant in ("rows16", "wide"):  # (blocks: an interleaved copy)
            return block_linear(x, blocks, rows16.CODE + ggml + (rows16.WIDE if variant == "wide" else 0), True)
        if variant == "bf16":
            return torch.ops.chat_cpu.block_linear_bf16(x, blocks, ggml)
        if variant == "int8" or x.shape[0] <= 8:
            return block_linear(x, blocks, ggml, variant == "int8")
        key = blocks.data_ptr()
        if key not in modules:  # (prefill's fp32 form: dequantized by the library, one GEMM)
            modules[key] = quant.BlockLinear(blocks, ggml)
            step.attach_block_kernels(modules[key])
        return modules[key](x)
    variants = ["fp32", "int8"] + (["bf16"] if a.rows > 8 and step.bf16_gemm() else []) + (["rows16", "wide"] if a.rows16 else [])
    gen = torch.Generator().manual_seed(0)
    print(f"{torch.get_num_threads()} threads, {a.rows} row(s), weights {'cached' if a.cached else 'from DRAM'}, "
          f"cpu_isa: {step.isa_label()}")
    rate = "GFLOP/s" if a.rows > 8 else "GB/s"  # (a prefill's rate: its arithmetic; a decode's: its bytes)
    print(f"{'type':6}{'shape':>14}" + "".join(f"{v + ' us':>10}{'Gw/s':>7}{rate:>8}" for v in variants)
          + "".join(f"{v + '/fp32':>12}" for v in variants[1:]) + f"{'max rel err':>13}")
    for name in a.types.split(","):
        ggml = gguf_blocks.TYPES[name]
        for shape in a.shapes.split(","):
            n, k = map(int, shape.split("x"))
            blocks = random_blocks(name, n, k, gen)
            x = torch.randn(a.rows, k, generator=gen)
            w = gguf_blocks.dequantize(blocks, ggml)
            copies = [blocks] if a.cached else [blocks.clone() for _ in range(int(100e6 // blocks.numel()) + 1)]
            times, err = {}, 0.0
            for v in variants:
                if v in ("rows16", "wide") and not rows16.fits(ggml, n):
                    continue
                held = [rows16.interleave(c, ggml) for c in copies] if v in ("rows16", "wide") else copies
                xr = step.int8_reference(x, ggml) if v in ("int8", "rows16") else wide_reference(x) if v == "wide" \
                    else x.bfloat16().double() if v == "bf16" else x.double()
                wr = w.bfloat16().double() if v == "bf16" else w.double()
                y = op(x, held[0], ggml, v).double()
                err = max(err, float(((y - xr @ wr.t()).abs() / (xr.abs() @ wr.abs().t()).clamp_min(1e-30)).max()))
                times[v] = best_pass(lambda b: op(x, b, ggml, v), held)
                del held
            row = f"{name:6}{shape:>14}"
            for v in variants:
                t = times.get(v, float("nan"))
                per = 2 * a.rows * n * k if a.rows > 8 else blocks.numel()
                row += f"{t * 1e6:>10.1f}{n * k / t / 1e9:>7.1f}{per / t / 1e9:>8.1f}"
            print(row + "".join(f"{times['fp32'] / times.get(v, float('nan')):>11.2f}x" for v in variants[1:])
                  + f"{err:>13.1e}")

def wide_reference(x: torch.Tensor) -> torch.Tensor:
    """x~ in fp64 for 16-bit inputs (rows16_int8.h's quantize_wide: per 32, q = round(x 32767 /
    max|x|), x~ = q max|x| / 32767), for the wide column's error."""
    g = x.float().reshape(x.shape[0], -1, 32)
    amax = g.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 32767.0) / torch.where(amax > 0, amax, 1.0), 0.0)
    return (torch.round(g * inv).clamp(-32767, 32767).double() * (amax / 32767.0).double()).reshape(x.shape)


def best_pass(fn, copies: list) -> float:
    """Seconds a call of fn over each of `copies` takes: the best of 10 passes, after 3 warm calls."""
    for b in copies[:3]:
        fn(b)
    best = float("inf")
    for _ in range(10):
        t0 = time.perf_counter()
        for b in copies:
            fn(b)
        best = min(best, (time.perf_counter() - t0) / len(copies))
    return best


def verify_rows(types: str, shapes: str) -> None:
    """block_linear_rows of 2, 3, 4 and 8 rows against block_linear of one, per type and shape,
    fp32 and int8 inputs, the weights cycled through copies that exceed the last-level cache."""
    ops, gen, counts = torch.ops.chat_cpu, torch.Generator().manual_seed(0), (2, 3, 4, 8)
    print(f"{torch.get_num_threads()} threads, cpu_isa: {step.isa_label()}; a verify of R rows in one-row calls' time")
    print(f"{'type':6}{'shape':>14}{'inputs':>7}{'1 row us':>10}" + "".join(f"{f'{r} rows':>9}" for r in counts))
    for name in types.split(","):
        ggml = gguf_blocks.TYPES[name]
        for shape in shapes.split(","):
            n, k = map(int, shape.split("x"))
            blocks = random_blocks(name, n, k, gen)
            copies = [blocks.clone() for _ in range(int(100e6 // blocks.numel()) + 1)]
            for int8 in (False, True):
                times = {}
                for r in (1,) + counts:
                    x = torch.randn(r, k, generator=gen)
                    fn = ops.block_linear if r == 1 else ops.block_linear_rows
                    times[r] = best_pass(lambda b: fn(x, b, ggml, int8), copies)
                print(f"{name:6}{shape:>14}{'int8' if int8 else 'fp32':>7}{times[1] * 1e6:>10.1f}"
                      + "".join(f"{times[r] / times[1]:>8.2f}x" for r in counts))


def mamba2_steps(specs: str) -> None:
    """The Mamba2 mixers' one-token steps, torch form against the library's (module docstring)."""
    from models.architectures.mamba2 import Mamba2Mixer
    print(f"{torch.get_num_threads()} threads, cpu_isa: {step.isa_label()}")
    print(f"{'H x P x N x G':>18}{'torch us':>10}{'library us':>12}{'ratio':>8}")
    for spec in specs.split(","):
        H, P, N, G = map(int, spec.split("x"))
        torch.manual_seed(0)
        m = Mamba2Mixer(16, H, P, N, G, 4, 1e-5)
        with torch.no_grad():
            for prm in m.parameters():
                prm.normal_(0, 0.3)
        m.reset_buffers("cpu")
        x = torch.randn(1, 16)
        states = {"conv": torch.randn(m.conv_dim, 3), "ssm": torch.randn(H, P, N) * 0.1}
        best = {None: float("inf"), torch.ops.chat_cpu.mamba2_decode: float("inf")}
        with torch.inference_mode():
            for _ in range(5):
                for kernel in best:
                    m.cpu_kernel = kernel
                    st = {k: v.clone() for k, v in states.items()}
                    for _ in range(20):
                        m(x, st)
                    t0 = time.perf_counter()
                    for _ in range(200):
                        m(x, st)
                    best[kernel] = min(best[kernel], (time.perf_counter() - t0) / 200)
        t_torch, t_lib = best.values()
        print(f"{spec:>18}{t_torch * 1e6:>10.1f}{t_lib * 1e6:>12.1f}{t_torch / t_lib:>7.2f}x", flush=True)


def experts_calls(specs: str) -> None:
    """A token's routed experts, the per-expert loop against experts_decode (module docstring)."""
    from models.formats import gguf_tensors
    print(f"{torch.get_num_threads()} threads, cpu_isa: {step.isa_label()}")
    print(f"{'E x H x I x k':>20}{'inputs':>8}{'loop us':>10}{'library us':>12}{'ratio':>8}{'GB/s':>7}")
    for spec in specs.split(","):
        E, H, I, k = map(int, spec.split("x"))
        gen = torch.Generator().manual_seed(0)

        def stack(name, rows, cols):
            b = random_blocks(name, E * rows, cols, gen)
            return gguf_tensors.GgufTensor(int(gguf_blocks.TYPES[name]), b.numpy().reshape(E, rows, -1))
        ex = quant.BlockExperts(gguf_tensors.GgufExperts(stack("Q4_K", I, H), stack("Q4_K", I, H), stack("Q6_K", H, I)))
        step.attach_block_kernels(ex, norms=True)
        kernel = ex.cpu_kernel
        read = k * (2 * ex.gate_blocks[0].numel() + ex.down_blocks[0].numel())
        x = torch.randn(1, H, generator=gen)
        picks = [(torch.randperm(E, generator=gen)[:k][None], torch.softmax(torch.randn(1, k, generator=gen), -1))
                 for _ in range(100)]
        for int8 in (False, True):
            quant.use_int8_inputs(ex, int8)
            best = {None: float("inf"), kernel: float("inf")}
            with torch.inference_mode():
                for _ in range(5):
                    for form in best:
                        ex.cpu_kernel = form
                        t0 = time.perf_counter()
                        for idx, w in picks:
                            ex(x, idx, w)
                        best[form] = min(best[form], (time.perf_counter() - t0) / len(picks))
            t_loop, t_lib = best.values()
            print(f"{spec:>20}{'int8' if int8 else 'fp32':>8}{t_loop * 1e6:>10.1f}{t_lib * 1e6:>12.1f}"
                  f"{t_loop / t_lib:>7.2f}x{read / t_lib / 1e9:>7.1f}", flush=True)
        ex.cpu_kernel = kernel


if __name__ == "__main__":
    main()
