"""CPU benchmark of the embedded model: load time, prefill tok/s (~600-token prompt), decode tok/s.

Runs ours and, when `llama_cpp` is importable (optional, never a dependency), llama.cpp on the
same GGUF in the same run (a child process, so the two OpenMP runtimes never meet), with the same
thread count and prompt, and prints a table with ratios.
    python bench/cpu_bench.py [--model smollm2] [--threads 1,0] [--decode 128] [--repeats 3]
                              [--quantized auto|off] [--compile on|off] [--cpu-kernel auto|on|off]
                              [--context 16]  # tokens in the context when decoding starts
                              [--cpu-int8 auto|off|on|all]  # a GGUF's block products on rounded inputs
                              [--llama-python PYTHON]  # one that has llama_cpp
                              [--clock wall|cpu] [--rounds 1] [--cpu-isa native|avx2]
--quantized off measures the dequantized fp32 reference path instead of the 4-bit kernels;
--compile on the torch.compile'd decode step (the session's start, compile included, is printed).
--clock cpu times the process's CPU time instead of the wall clock: with --threads 1 a measure of
one core's work that other processes on a shared machine barely move (tok/s per core-second).
--model takes a path too (e.g. the Q4_K_M file bench/requantize.py writes).
--cpu-int8 (the `cpu_int8` setting: rounded inputs, int8 rows and a prefill's in bf16 where the CPU
has AVX512-BF16) is the engine's default, auto, unless given; all runs ours with auto, off (fp32
inputs) and on in turn, on the one load (whose Q4_0/Q4_1 layout is auto's: models.load), beside
the one llama.cpp run.
--cpu-isa avx2 measures ours as an AVX2-only machine runs it: the C++ library built for the AVX2
level (the `cpu_isa` setting), and torch's own kernels held there too (the process starts again
with ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2, MKL_ENABLE_INSTRUCTIONS=AVX2); give it a
--llama-python whose llama.cpp was built for AVX2 (-DGGML_NATIVE=OFF -DGGML_AVX2=ON
-DGGML_AVX512=OFF ...) to compare like with like.
--threads takes a list: each count in turn (0: the cores this process may run on), a table each;
by default 1 and all of them. The machine's read bandwidth is measured in the same command (the
best of several sums over 256 MiB: a stream of reads, as a decode step's), its copy bandwidth too
(engine.device.measure_bandwidth, what `chat plan` takes), and each decode figure is also given as
a share of the floor the read bandwidth puts under a token: the weight bytes a decode step reads
(the kernel plan's) plus the KV cache of the context, over that bandwidth.
--rounds R runs ours and llama.cpp in turn R times (a shared machine's speed drifts by up to a
fifth within minutes, bench/RESULTS.md): each round's figures and ratios are printed, and the table
gives the medians over the rounds, its ratios the median of the rounds' ratios.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# torch and the engine are imported where used: the llama.cpp child runs in a Python without them.

TEXT = ("The history of computing is a story of layers: transistors become gates, gates become "
        "adders and memories, and those become processors that run programs written in languages "
        "compiled by other programs. ")



def prompt_ids(tokenizer, n: int) -> list[int]:
    ids: list[int] = []
    while len(ids) < n:
        ids += tokenizer.encode(TEXT, add_special_tokens=False).ids
    return ids[:n]


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
# what holds torch's own kernels (ATen's dispatch, oneDNN, MKL) to the AVX2 level, read at its import
AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def hold_to_isa(isa: str) -> None:
    """For `--cpu-isa avx2`: this process started again with AVX2_ENV (torch's own kernels held to
    AVX2 as well), unless it already runs with it; native: nothing to do."""
    if isa == "avx2" and any(os.environ.get(k) != v for k, v in AVX2_ENV.items()):
        os.execve(sys.executable, [sys.executable] + sys.argv, {**os.environ, **AVX2_ENV})
clock = CLOCKS["wall"]


def timed(repeats: int, n_prompt: int, prefill_case, decode_case) -> dict:
    """Median prefill and decode tok/s. Each case sets up untimed and returns the timed call;
    a decode call returns how many tokens it decoded."""
    prefill, decode = [], []
    for _ in range(repeats):
        go = prefill_case()
        t = clock()
        go()
        prefill.append(n_prompt / (clock() - t))
        go = decode_case()
        t = clock()
        n = go()
        decode.append(n / (clock() - t))
    return {"prefill": statistics.median(prefill), "decode": statistics.median(decode)}


def bench_ours(lm, ids: list[int], n_decode: int, repeats: int, compile: str = "off",
               cpu_kernel: str = "auto", context: list[int] | None = None) -> dict:
    import torch

    from engine.config import SamplingConfig
    from engine.session import DecodeSession

    t0 = time.perf_counter()
    context = context or ids[:16]
    s = DecodeSession(lm.model, max_context=max(2048, len(context) + n_decode + 8), device=torch.device("cpu"),
                      dtype=torch.float32,
                      compile=compile, cpu_kernel=cpu_kernel)
    if s.cpu_kernel_note:
        print(s.cpu_kernel_note, file=sys.stderr)
    session_s = time.perf_counter() - t0
    greedy = SamplingConfig(temperature=0, max_new_tokens=n_decode)
    list(s.generate(ids[:32], SamplingConfig(temperature=0, max_new_tokens=4)))  # warm-up

    def prefill_case():
        s.reset()
        return lambda: s.prefill(ids)

    def decode_case():
        s.reset()
        gen = s.generate(context, greedy, stop_ids=())
        next(gen)  # the prompt's prefill and first token are not decode time
        return lambda: sum(1 for _ in gen)

    return dict(timed(repeats, len(ids), prefill_case, decode_case), session_s=session_s)


def bench_llama_cpp(path: str, ids: list[int], n_decode: int, repeats: int, threads: int,
                    context: list[int] | None = None) -> dict | None:
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    t0 = time.perf_counter()
    context = context or ids[:16]
    llm = Llama(model_path=path, n_ctx=max(2048, len(context) + n_decode + 8), n_threads=threads,
                n_threads_batch=threads, n_batch=512,
                verbose=False)
    load = time.perf_counter() - t0

    def prefill_case():
        llm.reset()
        return lambda: llm.eval(ids)

    def decode_case():
        llm.reset()
        llm.eval(context)

        def go():
            for _ in range(n_decode):
                llm.eval([llm.sample(temp=0.0)])
            return n_decode
        return go

    return dict(timed(repeats, len(ids), prefill_case, decode_case), load_s=load)


def llama_cpp_in_child(python: str, path: str, ids: list[int], n_decode: int, repeats: int,
                       threads: int, context: list[int]) -> dict | None:
    args = json.dumps({"path": path, "ids": ids, "n_decode": n_decode, "repeats": repeats, "threads": threads,
                       "context": context, "clock": next(k for k, v in CLOCKS.items() if v is clock)})
    proc = subprocess.run([python, os.path.abspath(__file__), "--child-llama-cpp", args],
                          capture_output=True, text=True)
    if proc.returncode != 0 or not proc.stdout.strip():
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    global clock
    if len(sys.argv) == 3 and sys.argv[1] == "--child-llama-cpp":
        a = json.loads(sys.argv[2])
        clock = CLOCKS[a.get("clock", "wall")]
        r = bench_llama_cpp(a["path"], a["ids"], a["n_decode"], a["repeats"], a["threads"], a["context"])
        print(json.dumps(r) if r else "")
        return
    from engine.device import configure_process
    configure_process()  # (the environment's diagnosis switches and folders, as chat takes them)
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--threads", default="1,0", help="thread counts, comma-separated (0: all this process may use)")
    ap.add_argument("--prompt-tokens", type=int, default=622)
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--context", type=int, default=16,
                    help="tokens already in the context when decoding starts (a long conversation: 2000)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quantized", choices=("auto", "off"), default="auto")
    ap.add_argument("--compile", choices=("on", "off"), default="off")
    ap.add_argument("--cpu-kernel", choices=("auto", "on", "off"), default="auto",
                    help="the C++ decode step (auto/on) or the torch step (off)")
    ap.add_argument("--cpu-int8", choices=("auto", "off", "on", "wide", "all"), default="auto",
                    help="a GGUF's block products on rounded inputs (the cpu_int8 setting), or each value in turn")
    ap.add_argument("--llama-python", default=sys.executable, help="a Python that can import llama_cpp")
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    ap.add_argument("--rounds", type=int, default=1,
                    help="ours and llama.cpp in turn this many times; medians and per-round ratios")
    ap.add_argument("--cpu-isa", choices=("native", "avx2"), default="native",
                    help="the cpu_isa setting; avx2 holds torch's kernels to AVX2 as well (above)")
    ap.add_argument("--rows16", choices=("on", "off"), default="on",
                    help="off: no matrix in the rows16 layout (KernelConfig.cpu_rows16; the baseline)")
    args = ap.parse_args()
    hold_to_isa(args.cpu_isa)
    import models
    from engine.config import EngineConfig
    from engine.device import kernel_config, physical_cores

    models.select_cpu_isa(args.cpu_isa)

    path = models.resolve(args.model)
    try:
        counts = [int(t) for t in args.threads.split(",")]
    except ValueError:
        ap.error("--threads: comma-separated thread counts, 0 for all")
    clock = CLOCKS[args.clock]
    t0 = time.perf_counter()
    # (the kernel plan's config as chat builds it for these settings, and so the layout it loads
    # Q4_0/Q4_1 in: blocks or int4 planes; `all` measures each value on auto's)
    eng = EngineConfig(cpu_kernel=args.cpu_kernel, compile=args.compile,
                       cpu_int8="auto" if args.cpu_int8 == "all" else args.cpu_int8)
    lm = models.load(path, quantized=args.quantized == "auto", kernels=kernel_config(eng).but(cpu_rows16=args.rows16 == "on"))
    load = time.perf_counter() - t0
    for threads in dict.fromkeys(t or physical_cores() for t in counts):  # (1 and all on one core: once)
        run_threads(args, path, threads, lm, load)


BANDWIDTH_CHILD = r"""
import json, sys, time
import torch
sys.path.insert(0, sys.argv[1])
torch.set_num_threads(int(sys.argv[2]))
from engine.device import measure_bandwidth
x = torch.ones(64 << 20, dtype=torch.float32)  # 256 MiB: far past the last-level cache
best = float("inf")
for _ in range(8):  # (a sum reads each byte once and writes nothing: a decode step's stream)
    t0 = time.perf_counter()
    float(x.sum())
    best = min(best, time.perf_counter() - t0)
print(json.dumps({"read": x.numel() * 4 / best, "copy": measure_bandwidth(torch.device("cpu"))}))
"""


def bandwidth_in_child(threads: int) -> dict:
    """The read and copy bandwidths (bytes a second) on `threads` threads, in a child process: its
    buffers stay out of this process's peak RSS."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", BANDWIDTH_CHILD, root, str(threads)], capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_threads(args, path: str, threads: int, lm, load: float) -> None:
    import torch

    import models
    torch.set_num_threads(threads)
    ids = prompt_ids(lm.tokenizer, args.prompt_tokens)
    context = prompt_ids(lm.tokenizer, args.context)
    variants = ["auto", "off", "on", "wide"] if args.cpu_int8 == "all" else [args.cpu_int8]
    rounds = []  # (ours by variant, llama.cpp's or None) a round
    for _ in range(args.rounds):
        ours = {}
        for v in variants:
            mode = models.rounding_by_default(lm.model) if v == "auto" else v
            if not models.use_int8_inputs(lm.model, mode != "off", wide=mode == "wide") and v in ("on", "wide"):
                print("cpu_int8: the model holds no GGUF blocks on the CPU; it changes nothing", file=sys.stderr)
            ours[v] = dict(bench_ours(lm, ids, args.decode, args.repeats, args.compile, args.cpu_kernel, context),
                           load_s=load)
        rss_ours = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        rounds.append((ours, llama_cpp_in_child(args.llama_python, path, ids, args.decode, args.repeats, threads,
                                                context)))
    bandwidths = bandwidth_in_child(threads)
    step_bytes = lm.plan.decode_bytes() + lm.plan.kv_bytes_per_token() * len(context)
    floor = bandwidths["read"] / step_bytes  # tok/s
    print(f"model {os.path.basename(path)}, {threads} threads, {args.clock} clock, prompt {len(ids)} tokens, decode {args.decode} "
          f"after {len(context)}, "
          f"quantized: {args.quantized}, compile: {args.compile}, cpu_kernel: {args.cpu_kernel}, "
          f"cpu_isa: {models.cpu_isa_label()}, rows16: {args.rows16} "
          f"(session start {rounds[0][0][variants[0]]['session_s']:.1f} s)")
    print(f"bandwidth {bandwidths['read'] / 1e9:.1f} GB/s read (sums over 256 MiB; a 256 MiB copy: "
          f"{bandwidths['copy'] / 1e9:.1f} GB/s), {threads} threads; a decode step reads {step_bytes / 1e6:.1f} MB: "
          f"floor {floor:.1f} tok/s")
    names = {"auto": f"ours (auto: {models.rounding_by_default(lm.model)})", "off": "ours (int8 off)",
             "on": "ours (int8 on)", "wide": "ours (wide)"}
    measured = all(ref for _, ref in rounds)
    if len(rounds) > 1:
        for i, (ours, ref) in enumerate(rounds, 1):
            line = "; ".join(f"{names[v]} {ours[v]['prefill']:.1f} / {ours[v]['decode']:.1f}" +
                             (f" ({ours[v]['prefill'] / ref['prefill']:.2f}x / {ours[v]['decode'] / ref['decode']:.2f}x)"
                              if ref else "") for v in variants)
            if ref:
                line += f"; llama.cpp {ref['prefill']:.1f} / {ref['decode']:.1f}"
            print(f"round {i} (prefill / decode tok/s): {line}")
        print(f"medians over {len(rounds)} rounds:")
    med = statistics.median
    print(f"{'':24}{'load s':>10}{'prefill tok/s':>16}{'decode tok/s':>15}{'of floor':>10}")
    for v in variants:
        decode = med(o[v]['decode'] for o, _ in rounds)
        print(f"{names[v]:24}{load:>10.2f}{med(o[v]['prefill'] for o, _ in rounds):>16.1f}"
              f"{decode:>15.1f}{decode / floor:>10.0%}")
    if measured:
        refs = [ref for _, ref in rounds]
        decode = med(r['decode'] for r in refs)
        print(f"{'llama.cpp':24}{med(r['load_s'] for r in refs):>10.2f}{med(r['prefill'] for r in refs):>16.1f}"
              f"{decode:>15.1f}{decode / floor:>10.0%}")
        for v in variants:
            print(f"{'ratio, ' + names[v]:24}{'':>10}{med(o[v]['prefill'] / r['prefill'] for o, r in rounds):>15.2f}x"
                  f"{med(o[v]['decode'] / r['decode'] for o, r in rounds):>14.2f}x")
    else:
        print("llama.cpp: not measured (llama_cpp is not importable)")
    print(f"peak RSS after ours: {rss_ours:.0f} MB")


if __name__ == "__main__":
    main()
