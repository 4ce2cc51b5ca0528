"""Prefill's GEMM for FP8 weights on the FP8 tensor cores (Hopper): the input rows quantized to
e4m3 per 128-wide group by a Triton kernel, then cuBLAS's block-scaled FP8 GEMM
(torch.nn.functional.scaled_mm, the input's scales per 1 x 128 and the weights' per 128 x 128:
the form of the official Qwen and DeepSeek-V3 FP8 checkpoints' reference kernels, transformers'
`finegrained_fp8` and vLLM's `w8a8_block_fp8`).

Contract:
- `quantize_rows(x)` gives (q, s) with, per row r and 128-wide group g of x [M, K] (K a multiple
  of 128): s[g, r] = amax / 448 (1 where the group is all zeros) and q = e4m3(x / s), rounded to
  nearest even and saturated at +-448 (the division's result cast, as torch casts it); rows are
  padded with zeros to a multiple of ROW_MULTIPLE (cuBLAS's block-scaled GEMM takes no other).
- `matmul(x, qw)` equals, for the weights W = code * block scale (hf_layers.Fp8Linear's
  dequantization), y[r, n] = sum_g s[g, r] ws[n // group, g] (q[r, g] . code[n, g]) over the
  128-wide groups g of K, rounded once to the output dtype; cuBLAS sums each group's FP8
  products in the tensor cores (fewer bits than fp32 keep: tests/kernels/test_fp8_gemm.py bounds their
  rms distance to `oracle`, the same sum in fp32) and scales and adds the groups in fp32.
- What departs from the dequantize-then-bf16-GEMM form is the input's rounding to e4m3 (3
  mantissa bits: ~2.6% rms on a Gaussian row, against bf16's ~0.2%), as in those reference
  implementations; the decode GEMV (fp8.py) keeps the bf16 input, since one token reads the
  weights whatever its type. tests/kernels/test_fp8_gemm.py bounds both against the fp32 product.
- Why: a 2k-token prefill of the 27B-like shape in FP8 ran slower than bf16 when each matrix was
  dequantized to bf16 and multiplied by cuBLAS in bf16 (bench/quant_bench.py): the
  dequantization writes twice the FP8 bytes, and the bf16 GEMM runs at half the FP8 tensor
  cores' rate (bench/quant_bench.py --sweep-fp8-prefill times the three forms).

`serves` says where it runs (Hopper, whole scale blocks or a scale per row).
`CHAT_FP8_PREFILL=dequant` keeps the dequantize-then-GEMM form everywhere.
"""
from __future__ import annotations


import torch

from .base import launch, triton

# "tensor": FP8 linears' prefill through `matmul` where it serves; "dequant": dequantized to the
# activations' dtype, then torch's GEMM (the weights as hf_layers.Fp8Linear gives them, a bf16 input);
# CHAT_FP8_PREFILL, engine/config.py's Environment, set by models.configure
MODE = "tensor"
E4M3_MAX = 448.0
ROW_MULTIPLE = 16


def serves(x: torch.Tensor, qw) -> bool:
    """Whether `matmul` takes x [M, K] @ W^T for this QWeight: on (MODE), Triton present, x half
    precision on a Hopper device (compute capability 9.0: what cuBLAS's block-scaled FP8 GEMM and
    these tests cover), torch with `scaled_mm`'s block-wise recipes, an FP8 weight of K a multiple
    of 128, and rows it can scale: 128-row blocks whole (N a multiple of 128), or a scale per row
    (group 1: fused linears whose parts end inside a block) with N a multiple of 16."""
    if MODE != "tensor" or triton is None or not x.is_cuda or x.dtype not in (torch.bfloat16, torch.float16):
        return False
    if qw.fmt != "FP8" or qw.k % 128 or not hasattr(torch.nn.functional, "scaled_mm"):
        return False
    group = qw.group or 128
    if not (group == 128 and qw.n % 128 == 0 or group == 1 and qw.n % 16 == 0):
        return False
    return torch.cuda.get_device_capability(x.device) == (9, 0)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (unit stride along K) -> (e4m3 [Mp, K], fp32 scales [K/128, Mp]: group-major, the
    layout scaled_mm reads for 1 x 128 blocks), Mp = M rounded up to ROW_MULTIPLE (rows past M:
    zeros, scale 1)."""
    m, k = x.shape
    mp = -(-m // ROW_MULTIPLE) * ROW_MULTIPLE
    q = torch.empty(mp, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(k // 128, mp, dtype=torch.float32, device=x.device)
    groups = 8 if (k // 128) % 8 == 0 else 1
    launch(_quantize_rows_kernel, (mp, k // 128 // groups), x, q, s, m, mp, x.stride(0), k, GROUPS=groups,
           num_warps=4)
    return q, s


def matmul(x: torch.Tensor, qw, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [M, K] @ W^T for an FP8 QWeight that `serves` takes (data e4m3 [N, K], scales fp32
    [N/group, K/128]). Returns [M, N] in out_dtype (x's by default)."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    q, s = quantize_rows(x)
    f = torch.nn.functional
    y = f.scaled_mm(q, qw.data.t(), s.t(), f.ScalingType.BlockWise1x128, *weight_scales(qw),
                    output_dtype=out_dtype or x.dtype)
    return y if y.shape[0] == x.shape[0] else y[:x.shape[0]]


def weight_scales(qw) -> tuple[torch.Tensor, "torch.nn.functional.ScalingType"]:
    """The weight's scales as scaled_mm reads them, with their recipe: 128 x 128 blocks as
    [K/128 rounded up to 4 (padded with ones), N/128] of unit stride along K; one scale a row
    (group 1) as 1 x 128 blocks, [N, K/128] of unit stride along N (a copy: 4 bytes a 128
    weights)."""
    f = torch.nn.functional
    sc = qw.scales.contiguous()  # (a no-op as loaded; the strides below assume it)
    if (qw.group or 128) == 1:
        return sc.t().contiguous().t(), f.ScalingType.BlockWise1x128
    kb = sc.shape[1]
    if kb % 4:  # (cuBLAS's layout of 128 x 128 scales: the K blocks padded to a multiple of 4)
        padded = torch.ones(sc.shape[0], -(-kb // 4) * 4, dtype=sc.dtype, device=sc.device)
        padded[:, :kb] = sc
        sc = padded
    return sc.t(), f.ScalingType.BlockWise128x128


def oracle(x: torch.Tensor, qw) -> torch.Tensor:
    """matmul's arithmetic in torch, fp32 (the tests' reference): the input quantized as
    quantize_rows does, the weights dequantized, one fp32 matmul."""
    xf = x.float()
    m, k = xf.shape
    g = xf.view(m, k // 128, 128)
    amax = g.abs().amax(-1, keepdim=True)
    # (a division by a tensor: torch on CUDA divides by a Python number as a product with its
    # reciprocal, one ulp from the kernel's division at times)
    s = torch.where(amax > 0, amax / torch.full_like(amax, E4M3_MAX), torch.ones_like(amax))
    xq = (g / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * s
    group = qw.group or 128
    ws = qw.scales.float().repeat_interleave(group, 0)[:qw.n].repeat_interleave(128, 1)
    return xq.view(m, k) @ (qw.data.float() * ws).t()


if triton is not None:
    import triton.language as tl

    @triton.jit
    def _quantize_rows_kernel(x, q, s, M, MP, stride_x, K, GROUPS: tl.constexpr):
        """Row program_id(0) (rows M.. are padding: zeros), groups GROUPS program_id(1).. of 128:
        quantize_rows' contract."""
        row = tl.program_id(0).to(tl.int64)  # (row * K passes 2**31 past ~123k rows at K = 17,408)
        g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)[:, None]
        offs = g * 128 + tl.arange(0, 128)[None, :]
        v = tl.load(x + row * stride_x + offs, mask=(row < M) & (offs < K), other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(v), axis=1)
        sc = tl.where(amax > 0, tl.div_rn(amax, 448.0), 1.0)
        y = tl.minimum(tl.maximum(tl.div_rn(v, sc[:, None]), -448.0), 448.0)
        tl.store(q + row * K + offs, y.to(tl.float8e4nv))
        tl.store(s + tl.reshape(g, (GROUPS,)) * MP + row, sc)
