"""Decode and prefill speed of our engine on the PERFORMANCE.md shapes (random weights).

    python bench/decode_bench.py NAME [NAME ...] [--device cuda] [--graph auto|on|off]
        [--prompt 128] [--new 256] [--prefill 2048] [--runs 2] [--max-context N] [--hf hf.jsonl]
        [--hf-script PATH/hf_baseline.py] [--hf-variants eager,static,prefill] [--graph-check]
        [--startup NAME]

The floor (weight bytes a token reads / 4.3 TB/s) leaves out an untied embedding table, and of MoE
shapes (qwen3.5-35b-a3b, qwen3-30b-a3b, granite-4.0-h-tiny) counts only the top-k experts.
Decode: tokens/s after a `--prompt`-token prompt, `--new` greedy tokens, median of 3, measured
on one session (graph captured once). Prefill: tokens/s of one `--prefill`-token prompt, median
of runs 2-4 on one session (run 1 compiles, and with graphs on captures its bucket's graph).
`--runs N` (determinism mode): the same session runs the same prompt N times and the benchmark
stops with an error on any token mismatch. `--hf FILE` reads hf_baseline.py's JSON
lines (run in the same device command) and prints ratios; `--hf-script` runs hf_baseline.py
first (eager, static cache compiled, prefill) so that one command prints ours against HF's best
(the table names which variant that was, and shows a dash where one did not run or timed out).
`--graph-check`: the graph's tokens against a graph-off session's. `--startup NAME`: process start to
ready-to-decode (model built, state allocated, graph captured) in a fresh child process.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

T_PROCESS = time.perf_counter()
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from engine import graphs  # noqa: E402
from engine.config import SamplingConfig  # noqa: E402
from engine.session import DecodeSession  # noqa: E402
from shapes import random_model  # noqa: E402


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def active_bytes(model) -> int:
    """The weight bytes one decoded token reads: all of them but an untied embedding table (a
    token reads one row of it; as quant_bench.py's floor), and of each MoE block's routed experts
    only the top k (the bandwidth floor of an MoE model). An MoE block is any module holding
    experts (moe.Experts, or models/quant's BlockExperts / PlanarExperts) beside its router (`gate` in the Qwen MoE models, `router` in Granite 4.0-H).
    Weights in any format: weight_formats' bytes (quantized blocks included)."""
    from models.architectures.moe import Experts, Router
    from models.quant.layers import BlockExperts, PlanarExperts, weight_formats
    total = sum(weight_formats(model).values())
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if embed is not None and not getattr(getattr(model, "config", None), "tie_embeddings", False):
        total -= sum(t.numel() * t.element_size() for t in list(embed.parameters()) + list(embed.buffers()))
    for m in model.modules():
        ex_mod = getattr(m, "experts", None)
        router = next((r for r in (getattr(m, "gate", None), getattr(m, "router", None)) if isinstance(r, Router)), None)
        if isinstance(ex_mod, (Experts, BlockExperts, PlanarExperts)) and router is not None:
            ex = sum(t.numel() * t.element_size() for t in list(ex_mod.parameters()) + list(ex_mod.buffers()))
            total -= ex - ex * router.top_k // router.weight.shape[0]
    return total


def bench_shape(name, device, dtype, graph, prompt_len, new, prefill_len, runs, compile="off",
                max_context=0, graph_check=False, model=None) -> dict:
    """model: a model of this shape already built (quant_bench.py's quantized ones); random_model's by default."""
    from models.quant.layers import weight_formats
    t0 = time.perf_counter()
    model = model if model is not None else random_model(name, device, dtype)
    sync(device)
    rec = {"model": name, "build_s": round(time.perf_counter() - t0, 1),
           "weight_gb": round(sum(weight_formats(model).values()) / 1e9, 3),
           "active_gb": round(active_bytes(model) / 1e9, 3)}
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (max(prompt_len, prefill_len),), generator=g).tolist()
    prompt = ids[:prompt_len]
    t0 = time.perf_counter()
    s = DecodeSession(model, max_context=max_context or prompt_len + new + 8, device=device, dtype=dtype,
                      cuda_graph=graph, compile=compile)
    sync(device)
    rec["session_s"] = round(time.perf_counter() - t0, 2)
    rec["graph"] = s.graph is not None
    rec["compile"] = compile
    greedy = SamplingConfig(temperature=0, max_new_tokens=new)
    list(s.generate(prompt, SamplingConfig(temperature=0, max_new_tokens=16), stop_ids=()))  # warm-up
    times, outs = [], []
    for _ in range(max(3, runs)):
        s.reset()
        out = list(s.generate(prompt, greedy, stop_ids=()))
        st = s.last_stats
        times.append(st.decode_seconds / max(st.generated_tokens - 1, 1))
        outs.append(out)
    ms = statistics.median(times) * 1e3
    rec.update(decode_ms_per_tok=round(ms, 3), decode_tok_s=round(1e3 / ms, 1),
               floor_ms_per_tok=round(rec["active_gb"] / 4.3, 3))
    if runs > 1:
        for i, out in enumerate(outs[1:runs], start=2):
            if out != outs[0]:
                first = next(j for j, (a, b) in enumerate(zip(out, outs[0])) if a != b)
                raise SystemExit(f"{name}: run {i} differs from run 1 at token {first}: "
                                 f"{out[first]} != {outs[0][first]}")
        rec["runs_identical"] = runs
    if graph_check and s.graph is not None:  # the graph records the eager step: the same tokens
        eager = DecodeSession(model, max_context=s.max_context, device=device, dtype=dtype, cuda_graph="off",
                              compile=compile)
        out = list(eager.generate(prompt, greedy, stop_ids=()))
        if out != outs[0]:
            first = next(j for j, (a, b) in enumerate(zip(out, outs[0])) if a != b)
            raise SystemExit(f"{name}: graph off differs from graph on at token {first}")
        rec["graph_equals_eager"] = True
        del eager
    del s
    if prefill_len:
        # the session as a chat runs it (graph: a bucket's prefill captured after its first, eager
        # run, then replayed: engine/graphs.py's PaddedPrefill); the first run is not in the median
        s = DecodeSession(model, max_context=prefill_len + 8, device=device, dtype=dtype, cuda_graph=graph)
        pf, queued = [], []
        for _ in range(4):
            s.reset()
            sync(device)
            t = time.perf_counter()
            s.prefill(ids[:prefill_len])
            queued.append(time.perf_counter() - t)
            sync(device)
            pf.append(time.perf_counter() - t)
        rec["prefill_tok_s"] = round(prefill_len / statistics.median(pf[1:]), 1)
        # each run's time, and when the host had queued it: where the two are equal, the host's
        # queueing bounded the prefill (bench/RESULTS.md set V)
        rec["prefill_ms"] = [round(t * 1e3, 2) for t in pf]
        rec["prefill_queued_ms"] = [round(t * 1e3, 2) for t in queued]
        rec["prefill_path"] = s.prefill_path
        del s
    if device.type == "cuda":
        rec["peak_mem_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 2)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return rec


def startup(name: str, device: str, graph: str, compile: str = "off") -> tuple[float, str]:
    """Seconds from starting a child process to its READY line (not to its exit: tearing down a
    CUDA context is not start-up), and that line."""
    t = time.perf_counter()
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--ready", name, "--device", device,
                             "--graph", graph, "--compile", compile], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if line.startswith("READY"):
            ready = time.perf_counter() - t
            proc.communicate()
            return ready, line.strip()
    raise SystemExit(f"startup child failed: {proc.communicate()[1][-2000:]}")


def run_hf_baseline(a) -> None:
    """hf_baseline.py in child processes (their GPU memory is gone before ours is built): eager,
    static cache (which it compiles), and the prefill; a variant that fails or runs out of time
    leaves an error line, and the comparison takes the best of those that ran."""
    with open(a.hf, "w") as out:
        variants = {"eager": [], "static": ["--static"],
                    "prefill": ["--prompt", str(a.prefill), "--new", "8", "--tag", "prefill"]}
        for variant in (variants[v] for v in a.hf_variants.split(",")):
            cmd = [sys.executable, a.hf_script, *a.names, "--prompt", str(a.prompt), "--new", str(a.new), *variant]
            tag = "prefill" if "--tag" in variant else ""
            try:
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=a.hf_timeout)
                lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
                if r.returncode != 0 and not lines:
                    why = r.stderr.strip().splitlines()[-1][:300] if r.stderr.strip() else "failed"
                    lines = [json.dumps({"model": n, "static": "--static" in variant, "tag": tag, "error": why})
                             for n in a.names]
            except subprocess.TimeoutExpired:
                lines = [json.dumps({"model": n, "static": "--static" in variant, "tag": tag,
                                     "error": f"timed out after {a.hf_timeout} s"}) for n in a.names]
            for line in lines:
                print("HF", line, flush=True)
                out.write(line + "\n")


def main() -> None:
    from engine.device import configure_process
    configure_process()  # (the environment's diagnosis switches and folders, as chat takes them)
    ap = argparse.ArgumentParser()
    ap.add_argument("names", nargs="*")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--graph", default="auto")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--max-context", type=int, default=0,
                    help="state size of the decode session (default: prompt + new + 8); the CUDA step "
                         "attends over all of it, masked, as the REPL's session (8192) does")
    ap.add_argument("--compile", default="off", help="torch.compile the decode step (on|off)")
    ap.add_argument("--prefill-form", default="chunked", choices=["chunked", "naive"],
                    help="hybrid models: the gated delta form used for multi-token forwards")
    ap.add_argument("--hf", help="hf_baseline.py JSON lines to compare with")
    ap.add_argument("--hf-script", help="hf_baseline.py's path: run it first on the same shapes (eager, static "
                                        "cache compiled, a --prefill-token prefill), write its lines to --hf "
                                        "(default hf.jsonl) and compare, all in one command")
    ap.add_argument("--hf-timeout", type=int, default=900, help="seconds per hf_baseline.py variant")
    ap.add_argument("--hf-variants", default="eager,static,prefill",
                    help="the hf_baseline.py runs of --hf-script, any of eager, static, prefill")
    ap.add_argument("--graph-check", action="store_true",
                    help="also decode with the graph off and stop with an error unless the tokens are the same")
    ap.add_argument("--startup", help="measure process start to ready-to-decode for this shape")
    ap.add_argument("--ready", help=argparse.SUPPRESS)
    a = ap.parse_args()
    from models.architectures import mamba2, qwen3_5
    qwen3_5.PREFILL_FORM = mamba2.PREFILL_FORM = a.prefill_form
    device = torch.device(a.device)
    dtype = getattr(torch, a.dtype) if a.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    if a.ready:
        t_import = time.perf_counter() - T_PROCESS
        model = random_model(a.ready, device, dtype)
        sync(device)
        t_model = time.perf_counter() - T_PROCESS
        spent = {}

        def timed(fn, key):  # the session's kernel compiles and graph capture, timed apart
            def run(*args, **kwargs):
                t = time.perf_counter()
                out = fn(*args, **kwargs)
                spent[key] = time.perf_counter() - t
                return out
            return run

        DecodeSession._precompile = timed(DecodeSession._precompile, "compile")
        graphs.GraphedDecodeStep.capture = timed(graphs.GraphedDecodeStep.capture, "capture")
        s = DecodeSession(model, max_context=4096, device=device, dtype=dtype, cuda_graph=a.graph,
                          compile=a.compile)
        s.prefill([1])
        s.step(2)  # the first decode step: where a compiled step compiles (and the graph replays)
        sync(device)
        print("READY", f"imports {t_import:.2f}s, model {t_model:.2f}s, session+capture "
              f"{time.perf_counter() - T_PROCESS:.2f}s (times since interpreter start; of the session: "
              f"kernel compiles {spent.get('compile', 0):.2f}s, graph capture {spent.get('capture', 0):.2f}s)",
              flush=True)
        return
    if a.hf_script:
        a.hf = a.hf or "hf.jsonl"
        run_hf_baseline(a)
    rows = []
    for name in a.names:
        rec = bench_shape(name, device, dtype, a.graph, a.prompt, a.new, a.prefill, a.runs, a.compile,
                          a.max_context, a.graph_check)
        rec["max_context"] = a.max_context or a.prompt + a.new + 8
        rec["prefill_form"] = a.prefill_form
        print(json.dumps(rec), flush=True)
        rows.append(rec)
    hf, hf_lines = {}, []
    if a.hf and os.path.exists(a.hf):
        hf_lines = [line for line in open(a.hf) if line.startswith("{")]
    if hf_lines:
        for line in hf_lines:
            if line.startswith("{"):
                r = json.loads(line)
                key = "prefill" if r.get("tag") == "prefill" else ("static" if r.get("static") else "eager")
                hf.setdefault(r["model"], {})[key] = r
    if rows:
        def cell(v: float, width: int, fmt: str = ".1f", suffix: str = "") -> str:
            """A figure, or a dash where that baseline did not run (or timed out: its JSON line says)."""
            return f"{v:>{width - len(suffix)}{fmt}}{suffix}" if v else f"{'-':>{width}}"
        print(f"\n{'shape':20}{'ours tok/s':>11}{'HF eager':>9}{'HF best':>9}{'of':>7}{'ratio':>7}{'floor':>8}"
              f"{'ours prefill':>14}{'HF prefill':>12}{'ratio':>7}")
        for r in rows:
            h = hf.get(r["model"], {})
            eager = h.get("eager", {}).get("decode_tok_s", 0)
            ran = {k: v.get("decode_tok_s", 0) for k, v in h.items() if k != "prefill" and v.get("decode_tok_s")}
            which = max(ran, key=ran.get) if ran else ""
            best = ran.get(which, 0)
            hf_pf = h.get("prefill", {}).get("ttft_ms")
            hf_pf_tps = a.prefill / (hf_pf / 1e3) if hf_pf else 0
            print(f"{r['model']:20}{r['decode_tok_s']:>11.1f}{cell(eager, 9)}{cell(best, 9)}{which or '-':>7}"
                  f"{cell(r['decode_tok_s'] / best if best else 0, 7, '.2f', 'x')}"
                  f"{1000 / (r['floor_ms_per_tok'] or float('inf')):>8.0f}"
                  f"{r.get('prefill_tok_s', 0):>14.0f}{cell(hf_pf_tps, 12, '.0f')}"
                  f"{cell(r.get('prefill_tok_s', 0) / hf_pf_tps if hf_pf_tps else 0, 7, '.2f', 'x')}")
    if a.startup:
        total, detail = startup(a.startup, a.device, a.graph, a.compile)
        print(f"\nstartup {a.startup}: process start to first decoded token (graph={a.graph}, "
              f"compile={a.compile}) {total:.2f} s; {detail}")


if __name__ == "__main__":
    main()
