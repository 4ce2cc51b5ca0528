"""Triton launches with less host work a call than `kernel[grid](*args, **kwargs)`.

Contract: `launch(kernel, grid, args, kwargs)` runs what `kernel[grid](*args, **kwargs)` runs: the
same compiled kernel, given the same arguments in the same order, on the current device's current
stream. A key's first launch goes through Triton's own call, which compiles (or finds the kernel in
its caches) and launches; the compiled kernel is then kept under a key made of Triton's own
specialization of the arguments (the binder Triton's JIT runs before every launch: each argument's
type, a pointer's 16-byte alignment, an integer's divisibility by 16 and whether it is 1, every
constexpr's value), the launch options (num_warps, launch_pdl, ...), the kernel and the device.
Later launches under that key call the kernel's C launcher directly.

What a launch skips (the host's time, not the GPU's): Triton's cache key (a str() of the options
dict a launch), the launch metadata it builds for launch hooks, the calls of its empty hook chains
in the C launcher, and its Python launcher's scratch allocation (kernels that need global or
profile scratch always take Triton's call). A prefill launches hundreds of these kernels, each a
few microseconds of GPU time, so the host's cost a launch is what bounds it on slower hosts
(bench/profile_step.py --prefill 2048 --host; bench/ab_prefill.py's bf16-tritonlaunch). Where a
launch hook is installed (a profiler such as proton), launches take Triton's call, which runs it.
Kernels that are not JITFunctions (Triton's interpreter) take Triton's call too. Not seen after a
key's first launch (the engine changes none of them): Triton's debug and instrumentation knobs,
and the module globals a kernel reads (Triton's call recompiles or raises where they change).
"""
from __future__ import annotations


import torch

try:
    from triton import knobs  # (Triton >= 3.4; its launcher's arguments as launch() passes them)
except ImportError:  # CPU-only installs, older Tritons: Triton's own call
    knobs = None

# False: every launch through Triton's own call (the A/B of bench/ab_prefill.py, and the
# equivalence test: tests/engine/test_graphs.py::test_fast_launch_identical)
ENABLED = knobs is not None

_entries: dict = {}  # (kernel, device, specialization, options) -> _Entry


class _Entry:
    """A compiled kernel's C launcher and what it takes besides the arguments."""
    __slots__ = ("launch", "function", "packed", "cooperative", "pdl")

    def __init__(self, compiled):
        runner = compiled.run  # (CompiledKernel.run: the CudaLauncher, built and loaded on first use)
        self.launch = runner.launch
        self.function = compiled.function
        self.packed = compiled.packed_metadata
        self.cooperative, self.pdl = runner.launch_cooperative_grid, runner.launch_pdl


def _served(compiled) -> bool:
    """Whether the direct call passes this kernel what Triton's launcher would: no scratch
    memory to allocate a launch, one CTA per program (the CUDA launcher's attributes)."""
    runner = getattr(compiled, "run", None)
    return (runner is not None and hasattr(runner, "launch")
            and getattr(runner, "global_scratch_size", 1) == 0 and getattr(runner, "profile_scratch_size", 1) == 0
            and getattr(runner, "num_ctas", 0) == 1 and hasattr(compiled, "packed_metadata"))


def _hooks_idle() -> bool:
    enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    return not getattr(enter, "calls", enter) and not getattr(leave, "calls", leave)


def launch(kernel, grid: tuple, args: tuple, kwargs: dict) -> None:
    caches = getattr(kernel, "device_caches", None)
    if not ENABLED or caches is None or not _hooks_idle():
        kernel[grid](*args, **kwargs)
        return
    device = torch.cuda.current_device()
    bound, spec, options = caches[device][4](*args, **kwargs)  # Triton's binder for this device
    try:
        key = (kernel, device, tuple(spec), tuple(options.items()))
        entry = _entries.get(key)
    except TypeError:  # an unhashable constexpr: Triton's call
        kernel[grid](*args, **kwargs)
        return
    if entry is None:
        compiled = kernel[grid](*args, **kwargs)
        if compiled is not None and not hasattr(compiled, "result") and _served(compiled):
            _entries[key] = _Entry(compiled)
        return
    g = len(grid)
    entry.launch(grid[0], grid[1] if g > 1 else 1, grid[2] if g > 2 else 1,
                 torch._C._cuda_getCurrentRawStream(device), entry.function, entry.cooperative, entry.pdl,
                 None, None, entry.packed, None, None, None, *bound.values())


def cached() -> int:
    """How many (kernel, specialization) pairs launch directly (a test's check that they do)."""
    return len(_entries)
