"""Triton's kernel launchers built and loaded by threads side by side, against one at a time.

    python bench/launcher_race.py [--processes 4] [--threads 16] [--rounds 8] [--repeats 3]

Each round starts `--processes` processes on one fresh Triton cache folder; each builds the
launchers of 48 kernel signatures (1-24 arguments, i32 or i64 scalars with every third a pointer;
the one-argument pair is the same signature twice), `--repeats` times over, in a pool of
`--threads` threads, through Triton's own compile_module_from_src (the C compile, the cache
folder, the module load). A launcher's arity is read off the TypeError its call with no
arguments raises; a launcher whose arity is not its signature's is another kernel's. Variants:
side by side (Triton's own), and one at a time (the module loads under one lock, the builds
still side by side: what models/kernels/cuda/base.ready_launchers gets by readying launchers on
one thread). Prints each variant's processes with a wrong launcher.

Where no libcuda.so.1 is installed (a machine without a GPU), a stub of the symbols the
launchers link is built first (launchers are built and loaded, never launched).
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

STUB = ("cuCtxGetCurrent", "cuCtxSetCurrent", "cuDeviceGet", "cuDevicePrimaryCtxRetain", "cuFuncSetAttribute",
        "cuGetErrorString", "cuPointerGetAttribute", "cuLaunchKernelEx", "cuGetProcAddress")
SIGNATURES = [(n, kind) for n in range(1, 25) for kind in ("i32", "i64")]


def arity(n: int, kind: str) -> int:
    from triton.backends.nvidia.driver import include_dirs, libraries, library_dirs, make_launcher
    from triton.runtime.build import compile_module_from_src
    src = make_launcher({}, {i: (kind if i % 3 else "*fp32") for i in range(n)}, None)
    mod = compile_module_from_src(src=src, name="__triton_launcher", library_dirs=library_dirs(),
                                  include_dirs=include_dirs, libraries=libraries)
    try:
        mod.launch()
    except TypeError as e:
        m = re.search(r"exactly (\d+)", str(e))
        if m:
            return int(m.group(1))
    raise RuntimeError(f"the launcher of {n} {kind} arguments took no arguments")


def child(threads: int, repeats: int, lock: bool) -> None:
    from concurrent.futures import ThreadPoolExecutor
    if lock:
        import threading

        import triton.runtime.build as build
        guard, load = threading.Lock(), build._load_module_from_path

        def one_at_a_time(name, path):
            with guard:
                return load(name, path)
        build._load_module_from_path = one_at_a_time
    jobs = SIGNATURES * repeats
    with ThreadPoolExecutor(threads) as pool:
        got = list(pool.map(lambda j: arity(*j), jobs))
    base = got[0] - jobs[0][0]  # the launcher's own arguments (the first signature's built first)
    print(sum(g != base + n for (n, _), g in zip(jobs, got)))


def stub_libcuda(folder: str) -> dict:
    """The environment that makes Triton link and load launchers against a stub libcuda."""
    src = os.path.join(folder, "stub.c")
    with open(src, "w") as f:
        f.write("".join(f"int {name}(void) {{ return 0; }}\n" for name in STUB))
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", os.path.join(folder, "libcuda.so.1"),
                    "-Wl,-soname,libcuda.so.1", src], check=True)
    os.symlink("libcuda.so.1", os.path.join(folder, "libcuda.so"))
    return {"TRITON_LIBCUDA_PATH": folder,
            "LD_LIBRARY_PATH": folder + os.pathsep + os.environ.get("LD_LIBRARY_PATH", "")}


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        child(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1")
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--processes", type=int, default=4)
    p.add_argument("--threads", type=int, default=16)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ)
        if "libcuda.so.1" not in subprocess.run(["/sbin/ldconfig", "-p"], capture_output=True, text=True).stdout:
            env.update(stub_libcuda(tmp))
        for label, lock in (("side by side (Triton's own)", "0"), ("one at a time", "1")):
            bad = wrong = 0
            for r in range(a.rounds):
                cache = os.path.join(tmp, f"cache-{lock}-{r}")
                procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", str(a.threads),
                                           str(a.repeats), lock], env=dict(env, TRITON_CACHE_DIR=cache),
                                          stdout=subprocess.PIPE, text=True) for _ in range(a.processes)]
                for proc in procs:
                    out, _ = proc.communicate()
                    if proc.returncode != 0:
                        raise SystemExit(f"a child failed ({proc.returncode})")
                    n = int(out.strip().splitlines()[-1])
                    bad += n > 0
                    wrong += n
                shutil.rmtree(cache, ignore_errors=True)
            total = a.rounds * a.processes
            print(f"{label:28}: {bad} of {total} processes loaded a wrong launcher ({wrong} launchers of "
                  f"{total * len(SIGNATURES) * a.repeats})", flush=True)


if __name__ == "__main__":
    main()
