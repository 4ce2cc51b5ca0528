"""Whether a kernel serves a call: the one place outside models/kernels that asks the kernels'
availability checks (the switches, devices, dtypes and sizes each kernel takes;
tests/chat/test_imports.py holds every other module to it). The planner's rules (table.py) ask
these at load to say what each op site runs; the ops (models/ops) ask the same at call time, for
what only a call knows (its rows, torch.compile, a deferred norm), so a plan and the forwards it
describes follow one set of rules.

Rows are [T, K]; `one_row` is a decode token's forward, `rows` any number of them."""
from __future__ import annotations

import functools

import torch

from ..kernels import cpu_blocks_served as _cpu_blocks_served, cpu_step_serves as _cpu_step_serves
from ..kernels.cuda import base as _base, conv as _conv, grouped as _grouped, linear as _linear
from ..kernels.cuda import qlinear as _qlinear, qruns as _qruns, scan as _scan, ssd as _ssd

# ---- the device, dtype and switches ----


def enabled() -> bool:
    """The Triton kernels are importable here and switched on (kernels.configure)."""
    return _base.ENABLED


def serves(device: torch.device, dtype: torch.dtype) -> bool:
    """The Triton kernels serve forwards on this device in this dtype (CUDA, half precision, on)."""
    return _base.serves(device, dtype)


def one_row(x: torch.Tensor) -> bool:
    """The one-token kernels serve this forward: `serves`, one row, outside torch.compile."""
    return _base.usable(x)


def rows(x: torch.Tensor) -> bool:
    """The multi-token kernels serve this forward: `serves`, outside torch.compile."""
    return _base.prefill_usable(x)


def fits(*dims: int, least: int = 1) -> bool:
    """The per-head kernels take these sizes (powers of two, at least `least`)."""
    return _base.fits(*dims, least=least)


def precompiles(device: torch.device, dtype: torch.dtype) -> bool:
    """Forwards on `device` in `dtype` can submit their kernels' compiles ahead of a graph capture
    (the kernels serve them, and this Triton compiles in parallel)."""
    return _base.serves(device, dtype) and _base.can_precompile()


# ---- linears ----


def gemv_serves(x, dtype: torch.dtype) -> bool:
    """The Triton GEMV takes x against a weight of `dtype`: a NormedRow (a deferred norm, which
    only a GEMV computes), or one contiguous CUDA row of that dtype where the kernels serve."""
    return isinstance(x, _linear.NormedRow) or (_base.usable(x) and x.dtype == dtype and x.is_contiguous())


def head_gemv_serves(h, dtype: torch.dtype) -> bool:
    """An LM head of `dtype` takes h by the Triton GEMV with fp32 output: a NormedRow, or one row
    on a device and dtype the kernels serve, outside torch.compile."""
    return isinstance(h, _linear.NormedRow) or (h.shape[0] == 1 and _base.serves(h.device, dtype)
                                                and not torch.compiler.is_compiling())


def silu_mul_serves(gu: torch.Tensor) -> bool:
    """The one-launch silu(gate) * up takes these rows [T, 2N]: contiguous, where the kernels serve."""
    return _base.prefill_usable(gu) and gu.dim() == 2 and gu.is_contiguous()


def quant_fits(fmt: str, k: int, group: int | None) -> bool:
    """The quantized linears' CUDA kernels take a weight of this format, input width and group."""
    return _qlinear.fits(fmt, k, group)


def quant_serves(fmt: str, k: int, group: int | None, x) -> bool:
    """The quantized linears' CUDA forms take rows x of a weight of this format, input width and
    group: `quant_fits`, and x rows on CUDA the kernels serve (a NormedRow always is one)."""
    return _qlinear.fits(fmt, k, group) and (not isinstance(x, torch.Tensor) or _qlinear.usable(x))


def quant_tensor_serves(t: torch.Tensor) -> bool:
    """The dequantizing kernels read this quantized tensor (on CUDA, the kernels on, outside
    torch.compile)."""
    return _qlinear.usable(t)


def reads_int8(linear, dtype: torch.dtype, producer: str) -> bool:
    """`linear`'s one-row GEMV reads int8 runs of its input, which the launch making that input
    (`producer`: "merge", "delta", "pair") then makes too (qruns.FUSED_INT8)."""
    return _qruns.reads_int8(linear, dtype, producer)


def add_norm_serves(x: torch.Tensor, branch: torch.Tensor | None) -> bool:
    """The add + RMSNorm kernel (or a deferred norm) takes x and the branch added to it."""
    return _base.prefill_usable(x) and (branch is None or branch.dtype == x.dtype)


# ---- attention ----


def decode_attention_fits(head_dim: int) -> bool:
    """The decode attention kernel's head sizes."""
    return _base.attention_fits(head_dim)


def decode_attention_serves(x: torch.Tensor, head_dim: int) -> bool:
    """The decode attention kernel serves this layer input's forward. The attention layers and
    CausalLM (which then builds no mask) must agree on it: this is the one rule."""
    return _base.attention_usable(x, head_dim)


def rope_serves(x: torch.Tensor, head_dim: int) -> bool:
    """The q/k norms + RoPE + KV write kernel serves this forward (any number of tokens)."""
    return _base.rope_usable(x, head_dim)


def rope_fits(head_dim: int) -> bool:
    """The RoPE + KV write kernel's head sizes."""
    return _base.fits(head_dim, least=16)


def prefill_attention_fits(device: torch.device, dtype: torch.dtype, head_dim: int, kv_dtype: torch.dtype) -> bool:
    """The causal prefill kernel serves the device and dtype, caches of that dtype, head sizes up
    to 256 (its tiles' shared memory), on sm_90 or newer (measured there; older GPUs keep flash)."""
    return _base.serves(device, dtype) and head_dim <= 256 and kv_dtype == dtype and _sm90(device.index)


@functools.cache
def _sm90(index: "int | None") -> bool:
    return torch.version.hip is None and torch.cuda.get_device_capability(index)[0] >= 9


# ---- the hybrids' fixed-state mixers ----


def conv_serves(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The causal conv kernel serves x [T, C] against weight [C, K]."""
    return _conv.usable(x, weight)


def ssd_step_fits(head_dim: int, state_size: int) -> bool:
    """Mamba2's step kernel takes these head and state sizes."""
    return _ssd.decode_fits(head_dim, state_size)


def ssd_scan_fits(chunk: int, head_dim: int, state_size: int) -> bool:
    """Mamba2's chunked scan kernel takes these sizes."""
    return _ssd.scan_fits(chunk, head_dim, state_size)


def scan_fits(chunk: int, dk: int, dv: int) -> bool:
    """The Gated DeltaNet chunked scan kernel takes these sizes."""
    return _scan.scan_fits(chunk, dk, dv)


def scan_solve_fits(chunk: int) -> bool:
    """The Gated DeltaNet chunk's solve-and-products kernel takes this chunk."""
    return _scan.solve_fits(chunk)


# ---- routed experts ----


def grouped_fits(hidden: int, intermediate: int) -> bool:
    """The prefill's grouped GEMMs take experts of these sizes."""
    return _grouped.fits(hidden, intermediate)


# ---- the CPU's C++ library ----


def cpu_library_enabled() -> bool:
    """The C++ library's kernels are switched on in this process (the `cpu_kernel` setting)."""
    from ..kernels.cpu import step
    return step.ENABLED


def cpu_rows16_forms() -> bool:
    """The library's 16-row interleaved products are built here (AVX2 with FMA and F16C, or
    AVX-512 VNNI)."""
    from ..kernels.cpu import step
    return step.rows16_forms()


def cpu_avx512_forms() -> bool:
    """The library's AVX-512 forms run here (the CPU has them, cpu_isa is not avx2)."""
    from ..kernels.cpu import step
    return step.avx512_forms()


def cpu_step_serves(model, dtype: torch.dtype) -> bool:
    """The C++ whole decode step serves this model in `dtype` (built or not)."""
    return _cpu_step_serves(model, dtype)


def cpu_blocks_served(model, dtype: torch.dtype) -> bool:
    """The C++ per-linear kernels serve this model's GGUF blocks (built or not)."""
    return _cpu_blocks_served(model, dtype)


def cpu_rows16_types() -> tuple[int, ...]:
    """The ggml types whose 16-row interleaved forms the library built here computes."""
    from ..kernels.cpu import step
    return step.rows16_types()
