"""llama.cpp's own CUDA build beside ours: the same GGUF, the same GPU, one command.

llama.cpp is a benchmark reference, never a dependency: its sources are the llama-cpp-python sdist's
(tests/support/llama_cpp_tree.py's pin), built on the GPU machine for that GPU's architecture alone.

    python bench/llama_cuda.py pack [--sdist FILE]
        here: the sources a build needs (ggml with its CPU and CUDA backends, src, include, common,
        vendor, tools, the converter and gguf-py), a few MB, in .llama-cuda/src.tar.gz (git-ignored)
    python bench/llama_cuda.py build [--jobs N] [--parts DIR]
        on the GPU machine: llama-bench and llama-quantize (-DGGML_CUDA=ON, the architecture torch
        reads off the device) in .llama-cuda/build; --parts DIR also writes what was built as parts
        of at most 15 MB (llama-cuda-bin.tar.xz.NN) that a later call carries instead of building again
    python bench/llama_cuda.py compare [--shapes smollm2-135m,qwen3.5-0.8b] [--type Q4_K_M] [--layers N]
        [--prompt 128] [--new 128] [--prefill 512] [--rounds 3] [--dtype float16] [--bin DIR]
        each shape (bench/shapes.py): its random checkpoint converted by llama.cpp's converter and
        quantized by the llama-quantize built above (bench/hybrid_gguf.py), then `rounds` times in
        turn: ours on the file (models.load with its quantized weights, as `chat --quantized on`
        runs it; decode_bench.bench_shape: decode after a `--prompt`-token prompt, CUDA graph, and
        a `--prefill`-token prefill) and llama-bench on it (all layers on the GPU, its defaults
        otherwise: flash attention auto, CUDA graphs; tg `--new` tokens at depth `--prompt`, pp
        `--prefill` tokens). Prints each round and the medians, with ours / llama.cpp.

    python bench/llama_cuda.py profile [--shapes qwen3.5-0.8b] [--type Q4_K_M] [--layers N] [--prefill 512]
        [--top 15] [--dtype float16] [--bin DIR]
        where our side's time goes on that same file, in compare's activations' dtype:
        bench/profile_step.py's prefill profile (--gguf: the kernels, the GPU's busy time, the
        host's syncs) in a child process.

--layers N builds the shape with N of its layers (a multiple of a hybrid's attention interval):
for shapes whose full depth does not fit the disk. Both engines read the same file, so the ratio
compares; the tok/s are those of the N-layer model and the table says so.
--bin DIR runs a llama.cpp build from elsewhere (a folder with llama-bench and llama-quantize),
e.g. the parts of an earlier `build --parts` joined and unpacked.
"""
from __future__ import annotations

import argparse
import glob
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

DIR = os.path.join(ROOT, ".llama-cuda")
SRC = os.path.join(DIR, "src.tar.gz")
TREE = os.path.join(DIR, "tree")
BUILD = os.path.join(DIR, "build")
PART_BYTES = 15 * 1000 * 1000
TARGETS = ("llama-bench", "llama-quantize")

# what a CUDA build of llama-bench and llama-quantize reads (CMake checks every listed source of
# every configured tool, so tools/ and vendor/ travel whole), and the converter with its gguf-py
KEEP = ("CMakeLists.txt", "cmake/", "ggml/CMakeLists.txt", "ggml/cmake/", "ggml/include/", "ggml/src/", "src/",
        "include/", "common/", "vendor/", "tools/", "licenses/", "LICENSE",
        "convert_hf_to_gguf.py", "conversion/", "gguf-py/")
# of ggml/src/'s backend folders, the two this build configures
BACKENDS = ("ggml-cpu/", "ggml-cuda/")
# the web UI's assets are served, not compiled
SKIP = ("tools/ui/",)


def _wanted(rel: str) -> bool:
    if not rel.startswith(KEEP) or rel.startswith(SKIP):
        return False
    if rel.startswith("ggml/src/ggml-"):
        sub = rel[len("ggml/src/"):]
        return "/" not in sub or sub.startswith(BACKENDS)
    return True


def pack(sdist: str | None) -> str:
    """The build's sources out of the sdist (fetched with pip where not given) into SRC, atomically."""
    from tests.support.llama_cpp_tree import VERSION
    with tempfile.TemporaryDirectory() as tmp:
        if sdist is None:
            r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-binary", ":all:", "--no-deps",
                                "-d", tmp, f"llama-cpp-python=={VERSION}"], capture_output=True, text=True)
            found = glob.glob(os.path.join(tmp, "*.tar.gz"))
            if r.returncode != 0 or not found:
                raise SystemExit(f"llama_cuda: llama-cpp-python {VERSION}'s sdist is not reachable; "
                                 f"give it with --sdist FILE ({r.stderr.strip()[-200:]})")
            sdist = found[0]
        prefix = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
        os.makedirs(DIR, exist_ok=True)
        part = SRC + ".part"
        n = 0
        with tarfile.open(sdist) as src, tarfile.open(part, "w:gz") as out:
            for m in src:
                if not m.name.startswith(prefix) or not (m.isfile() or m.isdir()):
                    continue
                rel = m.name[len(prefix):]
                if not _wanted(rel + ("/" if m.isdir() else "")):
                    continue
                info = tarfile.TarInfo(rel)  # a fresh header: a long name's pax record holds the old one
                info.type, info.size, info.mode, info.mtime = m.type, m.size, m.mode, m.mtime
                out.addfile(info, src.extractfile(m) if m.isfile() else None)
                n += m.isfile()
        os.replace(part, SRC)
    print(f"{SRC}: {n} files, {os.path.getsize(SRC) / 1e6:.1f} MB", flush=True)
    return SRC


def _tree() -> str:
    if not os.path.exists(os.path.join(TREE, "CMakeLists.txt")):
        if not os.path.exists(SRC):
            raise SystemExit(f"llama_cuda: no sources at {SRC}: run `python bench/llama_cuda.py pack` first "
                             "(and carry .llama-cuda to the GPU machine)")
        tmp = tempfile.mkdtemp(dir=DIR, prefix=".tree-")
        with tarfile.open(SRC) as tar:
            tar.extractall(tmp, filter="data")
        os.replace(tmp, TREE)
    return TREE


def _arch() -> str:
    import torch
    if not torch.cuda.is_available():
        raise SystemExit("llama_cuda: no CUDA device here: build runs on the GPU machine")
    major, minor = torch.cuda.get_device_capability()
    return f"{major}{minor}"


def build(jobs: int, parts: str | None) -> str:
    """llama-bench and llama-quantize for this machine's GPU in BUILD/bin (their shared libraries
    beside them); with `parts`, that folder again as xz parts there."""
    tree = _tree()
    arch = _arch()
    t0 = time.perf_counter()
    cfg = ["cmake", "-S", tree, "-B", BUILD, "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
           "-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={arch}", "-DGGML_NATIVE=ON", "-DGGML_CUDA_NCCL=OFF",
           "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
           "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF", "-DCMAKE_BUILD_RPATH_USE_ORIGIN=ON"]
    subprocess.run(cfg, check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", BUILD, "-j", str(jobs), "--target", *TARGETS], check=True,
                   stdout=subprocess.DEVNULL)
    bin_dir = os.path.join(BUILD, "bin")
    print(f"built {', '.join(TARGETS)} for sm_{arch} in {time.perf_counter() - t0:.0f} s: {bin_dir}", flush=True)
    if parts:
        _write_parts(bin_dir, parts)
    return bin_dir


def _write_parts(bin_dir: str, out: str) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:xz") as tar:
        for name in sorted(os.listdir(bin_dir)):
            if name in TARGETS or ".so" in name:
                tar.add(os.path.join(bin_dir, name), arcname=name)
    data = buf.getvalue()
    os.makedirs(out, exist_ok=True)
    for i in range(0, len(data), PART_BYTES):
        with open(os.path.join(out, f"llama-cuda-bin.tar.xz.{i // PART_BYTES:02d}"), "wb") as f:
            f.write(data[i:i + PART_BYTES])
    print(f"{len(data) / 1e6:.1f} MB in {-(-len(data) // PART_BYTES)} parts in {out}", flush=True)


def _bin_dir(given: str | None) -> str:
    """The llama.cpp build to run: `given`, else BUILD/bin, else the parts in DIR unpacked there."""
    if given:
        return given
    bin_dir = os.path.join(BUILD, "bin")
    if os.path.exists(os.path.join(bin_dir, "llama-bench")):
        return bin_dir
    found = sorted(glob.glob(os.path.join(DIR, "llama-cuda-bin.tar.xz.*")))
    if not found:
        raise SystemExit("llama_cuda: no llama.cpp build: run `build` first (or carry its parts in .llama-cuda)")
    data = b"".join(open(p, "rb").read() for p in found)
    os.makedirs(bin_dir, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:xz") as tar:
        tar.extractall(bin_dir, filter="data")
    return bin_dir


def gguf_file(shape: str, qtype: str, layers: int | None, bin_dir: str) -> str:
    """The shape's GGUF in `qtype`, written once into DIR (hybrid_gguf.build with the built
    llama-quantize)."""
    import hybrid_gguf
    suffix = f"-{layers}l" if layers else ""
    out = os.path.join(DIR, f"bench-{shape}{suffix}.{qtype}.gguf")
    if not os.path.exists(out):
        os.environ.setdefault("CHAT_LLAMA_CPP_TREE", _tree())
        t0 = time.perf_counter()
        hybrid_gguf.build(shape, qtype, None, out, quantize=os.path.join(bin_dir, "llama-quantize"),
                          layers=layers)
        print(f"{out}: {os.path.getsize(out) / 1e6:.1f} MB, written in {time.perf_counter() - t0:.0f} s", flush=True)
    return out


def ours(path: str, name: str, dtype: str, prompt: int, new: int, prefill: int) -> dict:
    """Our decode and prefill on the GGUF in a child process (each engine's memory its own)."""
    code = ("import json, sys; sys.path[:0] = sys.argv[1:3]; import llama_cuda; "
            "print('RESULT ' + json.dumps(llama_cuda.ours_here(*json.loads(sys.argv[3]))))")
    r = subprocess.run([sys.executable, "-c", code, ROOT, HERE, json.dumps([path, name, dtype, prompt, new, prefill])],
                       capture_output=True, text=True)
    line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
    if r.returncode != 0 or line is None:
        raise SystemExit(f"ours on {path} failed ({r.returncode}): {r.stderr.strip()[-1500:]}")
    return json.loads(line[len("RESULT "):])


def ours_here(path: str, name: str, dtype: str, prompt: int, new: int, prefill: int) -> dict:
    import torch

    import models
    from decode_bench import bench_shape
    from engine.device import configure_process
    configure_process()
    device = torch.device("cuda")
    dt = getattr(torch, dtype)
    t0 = time.perf_counter()
    loaded = models.load(path, device=device, dtype=dt, quantized=True)
    torch.cuda.synchronize()
    load_s = time.perf_counter() - t0
    rec = bench_shape(name, device, dt, "auto", prompt, new, prefill, 1, model=loaded.model)
    return {"load_s": round(load_s, 1), "decode": rec["decode_tok_s"], "prefill": rec["prefill_tok_s"],
            "read_gb": rec["active_gb"], "graph": rec["graph"], "prefill_path": rec["prefill_path"],
            "prefill_ms": rec["prefill_ms"], "prefill_queued_ms": rec["prefill_queued_ms"]}


def llama_bench(bin_dir: str, path: str, prompt: int, new: int, prefill: int) -> dict:
    """llama-bench on the file: pp `prefill` at depth 0, tg `new` at depth `prompt` (its JSON's avg_ts)."""
    out = {}
    for key, args in (("prefill", ["-p", str(prefill), "-n", "0"]),
                      ("decode", ["-p", "0", "-n", str(new), "-d", str(prompt)])):
        r = subprocess.run([os.path.join(bin_dir, "llama-bench"), "-m", path, "-ngl", "99", "-r", "3", "-o", "json",
                            *args], capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"llama-bench failed ({r.returncode}): {r.stderr.strip()[-1500:]}")
        out[key] = round(json.loads(r.stdout)[0]["avg_ts"], 1)
    return out


def compare(a) -> None:
    import torch
    bin_dir = _bin_dir(a.bin)
    gpu = torch.cuda.get_device_name()
    for shape in a.shapes.split(","):
        path = gguf_file(shape, a.type, a.layers, bin_dir)
        depth = f", {a.layers} layers" if a.layers else ""
        print(f"\n{shape}{depth}, {a.type} ({os.path.basename(path)}), {gpu}, {a.dtype} activations: decode after "
              f"{a.prompt} tokens ({a.new} new), prefill of {a.prefill}", flush=True)
        rounds = []
        for i in range(a.rounds):
            o = ours(path, shape, a.dtype, a.prompt, a.new, a.prefill)
            ref = llama_bench(bin_dir, path, a.prompt, a.new, a.prefill)
            rounds.append((o, ref))
            print(f"  round {i + 1}: ours {o['decode']:.1f} / {o['prefill']:.1f} tok/s, llama.cpp {ref['decode']:.1f} / "
                  f"{ref['prefill']:.1f} (decode / prefill): {o['decode'] / ref['decode']:.2f}x, "
                  f"{o['prefill'] / ref['prefill']:.2f}x; our prefill {o['prefill_path']}, ms a run "
                  f"{o['prefill_ms']} (queued by {o['prefill_queued_ms']})", flush=True)
        med = lambda xs: statistics.median(list(xs))  # noqa: E731
        o_dec, o_pf = med(o["decode"] for o, _ in rounds), med(o["prefill"] for o, _ in rounds)
        r_dec, r_pf = med(r["decode"] for _, r in rounds), med(r["prefill"] for _, r in rounds)
        read = rounds[0][0]["read_gb"]
        print(f"  {'engine':12}{'decode tok/s':>14}{'prefill tok/s':>15}")
        print(f"  {'ours':12}{o_dec:>14.1f}{o_pf:>15.1f}   (load {rounds[0][0]['load_s']} s, reads {read} GB a token)")
        print(f"  {'llama.cpp':12}{r_dec:>14.1f}{r_pf:>15.1f}")
        ratios = [(o["decode"] / r["decode"], o["prefill"] / r["prefill"]) for o, r in rounds]
        print(f"  ours / llama.cpp: decode {med(d for d, _ in ratios):.2f}x, prefill {med(p for _, p in ratios):.2f}x "
              f"(median of {a.rounds} rounds' ratios)", flush=True)


def profile(a) -> None:
    """profile_step.py --gguf FILE --prefill N on each shape's file (written as compare writes it)."""
    bin_dir = _bin_dir(a.bin)
    for shape in a.shapes.split(","):
        path = gguf_file(shape, a.type, a.layers, bin_dir)
        print(f"\n{shape}, {a.type} ({os.path.basename(path)}): our prefill of {a.prefill} tokens", flush=True)
        r = subprocess.run([sys.executable, os.path.join(HERE, "profile_step.py"), shape, "--gguf", path,
                            "--prefill", str(a.prefill), "--top", str(a.top), "--dtype", a.dtype])
        if r.returncode != 0:
            raise SystemExit(f"profile_step.py on {path} failed ({r.returncode})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pk = sub.add_parser("pack")
    pk.add_argument("--sdist", help="llama-cpp-python's sdist (.tar.gz); fetched with pip where not given")
    b = sub.add_parser("build")
    b.add_argument("--jobs", type=int, default=os.cpu_count() or 4)
    b.add_argument("--parts", help="also write the build as parts of at most 15 MB into this folder")

    def on_files(name: str, shapes: str):  # (compare and profile: the shapes' files, llama.cpp's build)
        q = sub.add_parser(name)
        q.add_argument("--shapes", default=shapes)
        q.add_argument("--type", default="Q4_K_M")
        q.add_argument("--layers", type=int, default=None)
        q.add_argument("--prefill", type=int, default=512)
        q.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
        q.add_argument("--bin", help="a folder with llama-bench and llama-quantize (default: the build here)")
        return q
    c = on_files("compare", "smollm2-135m,qwen3.5-0.8b")
    c.add_argument("--prompt", type=int, default=128)
    c.add_argument("--new", type=int, default=128)
    c.add_argument("--rounds", type=int, default=3)
    on_files("profile", "qwen3.5-0.8b").add_argument("--top", type=int, default=15)
    a = p.parse_args()
    if a.cmd == "pack":
        pack(a.sdist)
    elif a.cmd == "build":
        build(a.jobs, a.parts)
    else:
        from hybrid_gguf import FTYPES
        if a.type not in FTYPES:
            raise SystemExit(f"llama_cuda: --type {a.type} is not one of {', '.join(sorted(FTYPES))}")
        (profile if a.cmd == "profile" else compare)(a)


if __name__ == "__main__":
    main()
