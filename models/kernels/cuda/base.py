"""Triton kernels for CUDA forwards, where torch would launch several kernels.

Contract: each function computes what its torch form computes, in fp32 inside and one rounding to
the output dtype (torch's forms round between ops, so results agree to bf16 rounding, and
tests/kernels/test_rope_norm.py compares them). The eager decode step and the CUDA graph that records it run
the same kernels; the CPU, fp32 models, torch.compile and machines without Triton use the torch
forms. `CHAT_TRITON=0` turns them off.
- qk_rope_kv_write: the optional per-head q/k RMSNorm (Qwen3, Qwen3.5) and RoPE (full or
  partial rotary) over the query and key heads of the fused QKV output, keys and values written
  into the caches at the positions read from the device (5 to 20 kernels -> 1), for one token
  (decode) or many (prefill: the queries come out in the [T, H, D] memory flash attention reads);
- add_rms_norm: the residual add and the next RMSNorm over any number of rows (2 -> 1);
- silu_mul: a SwiGLU's silu(gate) * up over any number of rows (2 -> 1; prefill's MLPs).
cuda_linear.py (GEMVs, SwiGLU), cuda_attention.py, cuda_delta.py and cuda_scan.py hold the others.
"""
from __future__ import annotations

import contextlib
import functools
import os

import torch

from . import launcher

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch forms run instead
    triton = None

# Process-wide switches, the engine's Environment (CHAT_TRITON, CHAT_PDL, CHAT_PRECOMPILE:
# engine/config.py) set by models.configure; a test or a benchmark that compares forms sets them here
ENABLED = triton is not None


HALF = (torch.bfloat16, torch.float16)


def interpreted() -> bool:
    """Whether Triton runs its interpreter here (its own TRITON_INTERPRET): the kernels then take
    the branches the interpreter runs. Triton's knobs say (3.4 on); before them, whether Triton
    made this module's kernels interpreted functions when it decorated them."""
    if triton is None:
        return False
    if launcher.knobs is not None:
        return bool(launcher.knobs.runtime.interpret)
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        return False
    return isinstance(_pdl_enter, InterpretedFunction)


def cdiv(a: int, b: int) -> int:
    """triton.cdiv for the host's launch arithmetic: Triton 3.6 wraps its own as a constexpr
    function, slow a call in Python, and a MoE prefill makes hundreds of such calls
    (bench/profile_step.py --prefill 2048 --host)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """triton.next_power_of_2 (0 for 0) without its constexpr-function wrapper (see cdiv)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def serves(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the kernels serve forwards on this device in this dtype: CUDA, half precision (an
    fp32 model keeps the exact torch forms: the kernels' tensor-core dots would round to TF32),
    Triton present and on."""
    return ENABLED and device.type == "cuda" and dtype in HALF


def usable(x: torch.Tensor) -> bool:
    """Whether the fused kernels serve this forward: `serves`, one token, and not inside
    torch.compile (Inductor fuses the torch forms itself)."""
    return serves(x.device, x.dtype) and x.shape[0] == 1 and not torch.compiler.is_compiling()


def prefill_usable(x: torch.Tensor) -> bool:
    """Whether the multi-token kernels (cuda_scan, the T-row forms here) serve this forward:
    `serves`, and not inside torch.compile."""
    return serves(x.device, x.dtype) and not torch.compiler.is_compiling()


PRECOMPILE_ENABLED = True
_submitted: list | None = None  # inside precompiling(): what each launch submitted


def launch(kernel, grid: tuple, *args, **kwargs) -> None:
    """kernel[grid](*args, **kwargs): every kernel here launches through this, so that inside
    `precompiling()` a launch submits the kernel's compile instead (nothing runs); else through
    launcher.py (the compiled kernel's C launcher called directly once Triton has launched it)."""
    if _submitted is not None:
        _submitted.append(kernel.warmup(*args, grid=grid, **kwargs))
    else:
        launcher.launch(kernel, grid, args, kwargs)


def precompiling_now() -> bool:
    """Whether launches are being skipped (inside `precompiling()`): outputs they would fill hold
    garbage, so a torch op that reads them as indices must get zeros instead."""
    return _submitted is not None


def can_precompile() -> bool:
    """Whether `precompiling()` compiles in parallel here (Triton >= 3.4 has AsyncCompileMode)."""
    return ENABLED and PRECOMPILE_ENABLED and hasattr(triton, "AsyncCompileMode")


@contextlib.contextmanager
def precompiling(workers: int | None = None):
    """Inside: every launch() submits its kernel's compile to a thread pool and returns (nothing
    runs); on leaving, waits for them (a failed compile raises here), then readies each kernel's
    first launch (ready_launchers). Torch ops inside still run, on whatever the
    skipped kernels left in their outputs: callers run a throwaway forward on scratch state.
    Triton releases the GIL in its compiler passes, and ptxas and the C compiler are processes,
    so the work overlaps. Why: a cold start compiled ~13 kernels one at a time at their first
    launch (the 0.8B-like model: 6.1 s of graph capture on an H200 host); later launches find
    them in Triton's caches (in memory, and on disk for later processes)."""
    global _submitted
    from concurrent.futures import ThreadPoolExecutor
    workers = workers or min(16, os.cpu_count() or 1)
    # the pool's threads compile for the caller's device: a thread starts on device 0, whatever
    # device the calling thread chose (a tensor-parallel rank's cuda:RANK)
    device = torch.cuda.current_device()
    with ThreadPoolExecutor(workers, thread_name_prefix="triton-compile", initializer=torch.cuda.set_device,
                            initargs=(device,)) as pool:
        pending: list = []
        with triton.AsyncCompileMode(pool):
            _submitted = pending
            try:
                yield
            finally:
                _submitted = None
        # (a warmup answers a FutureKernel, or the kernel itself where it was compiled before)
        kernels = {id(k): k for k in (p.result() if hasattr(p, "future") else p for p in pending) if k is not None}
    ready_launchers(kernels.values())


def ready_launchers(kernels) -> None:
    """Each compiled kernel's first launch readied (CompiledKernel.run: the launcher Triton builds
    for it, a C compile per signature in Triton 3.6 where its disk cache lacks it, and the kernel's
    module loaded on the device), one kernel after another on the calling thread. Not side by
    side: Triton's launchers loaded by threads side by side sometimes came back as another
    kernel's, whose first launch raised "function takes exactly N arguments (M given)"; loaded
    one at a time they never did (bench/launcher_race.py). A cold cache pays its C compiles in
    turn; a warm one only loads."""
    for k in kernels:
        k.run  # (a property: builds the launcher and loads the module where not yet done)


PDL_ENABLED = True


@functools.cache
def _pdl_supported(device_index: int) -> bool:
    """Programmatic dependent launch: Hopper or newer, and a Triton that launches with it."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
    except ImportError:
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {}) and \
        torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl(x: torch.Tensor) -> dict:
    """Launch options for the kernels here: with PDL, a kernel may start while the one before it
    finishes (each kernel signals at its start and waits for its predecessor before it reads
    activations or writes anything, so only constant loads such as weights overlap). Saves most
    of a launch's latency per kernel, on a step of ~200 small kernels."""
    on = PDL_ENABLED and x.is_cuda and _pdl_supported(
        x.device.index if x.device.index is not None else torch.cuda.current_device())
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


def fits(*dims: int, least: int = 1) -> bool:
    """Whether per-head kernels take these sizes: powers of two (Triton's blocks), at least `least`."""
    return all(d >= least and d & (d - 1) == 0 for d in dims)


def attention_fits(head_dim: int) -> bool:
    """The decode attention kernel's head sizes (its tensor-core dots need 16 at least)."""
    return fits(head_dim, least=16) and head_dim <= 256


def rope_usable(x: torch.Tensor, head_dim: int) -> bool:
    """Whether qk_rope_kv_write serves this forward (any number of tokens)."""
    return prefill_usable(x) and fits(head_dim, least=16)


def attention_usable(x: torch.Tensor, head_dim: int) -> bool:
    """Whether the Triton decode attention serves this forward. The attention layers and
    CausalLM (which then builds no mask) must agree on it: this is the one rule."""
    return usable(x) and attention_fits(head_dim)


if triton is not None:
    @triton.jit
    def _pdl_enter(PDL: tl.constexpr):
        """A kernel with nothing to prefetch: let the next launch, then wait for the previous."""
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()

    @triton.jit(do_not_specialize=["T"])
    def _qk_rope_kv_kernel(src, cos, sin, pos_ptr, q_w, k_w, q_out, k_cache, v_cache, stride_kh, stride_vh, eps,
                           src_row, T,
                           Q_STRIDE: tl.constexpr, K_OFF: tl.constexpr, V_OFF: tl.constexpr, H: tl.constexpr,
                           KVH: tl.constexpr, D: tl.constexpr, R: tl.constexpr, NORM: tl.constexpr,
                           BLOCK_T: tl.constexpr, PDL: tl.constexpr):
        _pdl_enter(PDL)
        head = tl.program_id(0)
        # BLOCK_T tokens a program: one per program made a 2k-token prefill ~80k programs of one
        # 128-wide row each, whose launch and load latencies, not bytes, set the time
        t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
        tm = t < T
        d = tl.arange(0, D)
        m2 = tm[:, None]
        pos = tl.load(pos_ptr + t, mask=tm, other=0)
        row = src + t[:, None].to(tl.int64) * src_row
        off = tl.where(head < H, head * Q_STRIDE,
                       tl.where(head < H + KVH, K_OFF + (head - H) * D, V_OFF + (head - H - KVH) * D))
        x = tl.load(row + off + d[None, :], mask=m2, other=0.0).to(tl.float32)
        if head < H + KVH:
            # rotate-half over the first R dims: roll(x, R/2) * signed sin; dims past R pass through
            rd = tl.where(d < R, (d + R // 2) % R, d)
            rolled = tl.load(row + off + rd[None, :], mask=m2, other=0.0).to(tl.float32)
            if NORM:  # the per-head RMSNorm first (the same factor scales x and its rolled copy)
                r = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
                if head < H:
                    wx = tl.load(q_w + d).to(tl.float32)
                    wr = tl.load(q_w + rd).to(tl.float32)
                else:
                    wx = tl.load(k_w + d).to(tl.float32)
                    wr = tl.load(k_w + rd).to(tl.float32)
                x = x * r[:, None] * wx[None, :]
                rolled = rolled * r[:, None] * wr[None, :]
            cs = t[:, None] * R + d[None, :]
            rm = m2 & (d[None, :] < R)
            c = tl.load(cos + cs, mask=rm, other=1.0).to(tl.float32)
            s = tl.load(sin + cs, mask=rm, other=0.0).to(tl.float32)
            y = x * c + rolled * s
            if head < H:
                tl.store(q_out + (t[:, None] * H + head) * D + d[None, :], y.to(q_out.dtype.element_ty), mask=m2)
            else:
                tl.store(k_cache + (head - H) * stride_kh + pos[:, None] * D + d[None, :],
                         y.to(k_cache.dtype.element_ty), mask=m2)
        else:
            tl.store(v_cache + (head - H - KVH) * stride_vh + pos[:, None] * D + d[None, :],
                     x.to(v_cache.dtype.element_ty), mask=m2)

    @triton.jit
    def _silu_mul_kernel(gu, out, N, stride, BLOCK: tl.constexpr, PDL: tl.constexpr):
        _pdl_enter(PDL)
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = c < N
        g = tl.load(gu + row * stride + c, mask=m, other=0.0).to(tl.float32)
        u = tl.load(gu + row * stride + N + c, mask=m, other=0.0).to(tl.float32)
        tl.store(out + row * N + c, (g / (1.0 + tl.exp(-g)) * u).to(out.dtype.element_ty), mask=m)

    @triton.jit
    def _add_rms_norm_kernel(x, y, w, sum_out, norm_out, eps, N: tl.constexpr, BLOCK: tl.constexpr,
                             PDL: tl.constexpr, EARLY: tl.constexpr, LATE: tl.constexpr):
        nw = tl.load(w + tl.arange(0, BLOCK), mask=tl.arange(0, BLOCK) < N, other=0.0)  # a weight: before the wait
        if PDL:  # EARLY: the next kernel may launch now; LATE: once the previous one has ended;
            if EARLY:  # neither: when this one ends
                tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
            if LATE:
                tl.extra.cuda.gdc_launch_dependents()
        offs = tl.program_id(0) * N + tl.arange(0, BLOCK)  # one program per row
        mask = tl.arange(0, BLOCK) < N
        s = (tl.load(x + offs, mask=mask, other=0.0).to(tl.float32)
             + tl.load(y + offs, mask=mask, other=0.0).to(tl.float32))
        s = s.to(sum_out.dtype.element_ty)  # the residual stream keeps its dtype, as `x + y` would
        tl.store(sum_out + offs, s, mask=mask)
        sf = s.to(tl.float32)
        r = 1.0 / tl.sqrt(tl.sum(sf * sf, axis=0) / N + eps)
        out = sf * r * nw.to(tl.float32)
        tl.store(norm_out + offs, out.to(norm_out.dtype.element_ty), mask=mask)


def qk_rope_kv_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, n_heads: int, n_kv: int, q_stride: int | None = None,
                     norm_weights: tuple[torch.Tensor, torch.Tensor] | None = None, eps: float = 0.0) -> torch.Tensor:
    """qkv: [T, q part + 2 KVH D] with contiguous rows, the query heads `q_stride` apart (D; 2D
    where each head carries its output gate after it), then the key and value heads; cos, sin:
    [T, R] from Rope.cos_sin (signed sin, R = rotary dims <= D); caches [KVH, S, D] with
    contiguous rows; norm_weights: the per-head q and k RMSNorm weights (offset already added),
    or None. Returns q [H, T, D] (a view of a [T, H, D] tensor, the layout flash attention reads
    and writes); writes k and v at `positions`."""
    T, D = qkv.shape[0], k_cache.shape[-1]
    q_stride = q_stride or D
    q = torch.empty(T, n_heads, D, dtype=qkv.dtype, device=qkv.device)
    q_w, k_w = norm_weights if norm_weights is not None else (cos, cos)  # unread without NORM
    block_t = 1 if T == 1 else 16  # (two compiled forms: decode's and prefill's)
    launch(_qk_rope_kv_kernel, (n_heads + 2 * n_kv, cdiv(T, block_t)),
        qkv, cos, sin, positions, q_w, k_w, q, k_cache, v_cache, k_cache.stride(0), v_cache.stride(0), eps,
        qkv.stride(0), T,
        Q_STRIDE=q_stride, K_OFF=n_heads * q_stride, V_OFF=n_heads * q_stride + n_kv * D, H=n_heads, KVH=n_kv,
        D=D, R=cos.shape[-1], NORM=norm_weights is not None, BLOCK_T=block_t, **pdl(qkv))
    return q.transpose(0, 1)


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for rows [gate | up] of gu [M, 2N] (rows contiguous): [M, N] in gu's dtype,
    in fp32 and rounded once (the torch form, F.silu(gate) * up, is two kernels that round
    twice and read the gate twice: most of the elementwise launches of the 30B-A3B-like model's
    2k-token prefill, bench/profile_step.py --prefill 2048)."""
    M, N = gu.shape[0], gu.shape[1] // 2
    out = torch.empty(M, N, dtype=gu.dtype, device=gu.device)
    block = min(1024, next_pow2(N))
    launch(_silu_mul_kernel, (M, cdiv(N, block)), gu, out, N, gu.stride(0), BLOCK=block, **pdl(gu))
    return out


def add_rms_norm(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float,
                 sum_out: torch.Tensor | None = None, early: str = "start",
                 out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + y, rms_norm(x + y) * weight) for contiguous [T, n] rows; x + y written into `sum_out`
    where given; the normed rows in out_dtype (x's by default). `early`: under PDL the next kernel
    launches as this one starts ("start"), once the kernel before this one has ended ("wait"), or
    only when this one ends ("end")."""
    if early not in ("start", "wait", "end"):
        raise ValueError(f"early={early!r}: one of 'start', 'wait', 'end'")
    n = x.shape[-1]
    s, out = sum_out if sum_out is not None else torch.empty_like(x), torch.empty_like(x, dtype=out_dtype)
    launch(_add_rms_norm_kernel, (x.shape[0],), x, y, weight, s, out, eps, N=n, BLOCK=next_pow2(n),
           EARLY=early == "start", LATE=early == "wait", **pdl(x))
    return s, out
