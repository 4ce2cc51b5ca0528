"""What a speculative verify's rows would cost in the CUDA GEMV, and whether they keep the one-row
GEMV's bits: the groundwork of a CUDA verify (engine/speculative.py's contract: each verify row's
logits bit for bit a one-token step's).

    python3 bench/verify_gemv.py [--shapes 576x1536,1024x3584,5120x17408] [--rows 1,2,4,8] [--dtype bfloat16]

For each weight shape [N, K] (bf16 random, x random) and row count M, three ways of multiplying M
rows, each timed by triton.testing.do_bench (median, CUDA events):
- `steps`: M launches of the one-row kernel from Python, one after another (host-bound at these
  sizes: an upper bound of what M decode steps' GEMVs cost; in a CUDA graph, about M one-row times);
- `grid`: one launch of the same per-program code over a grid of (row, tile): a row's program is
  the one-row program, so its bits are the one-row kernel's by construction; the rows of a tile
  run side by side and share its weights through L2;
- `regs`: one launch, each program's M rows sharing its weight tiles in registers (a [M, BLOCK_N,
  BLOCK_K] accumulator): the weights read once; its bits are checked, not assumed;
- `unrolled` (up to 4 rows): one launch, each weight tile loaded once and each row's accumulator
  the one-row program's [BLOCK_N, BLOCK_K] with the one-row program's operations (the rows unrolled
  into accumulators of their own); its bits are checked, not assumed.
The configs are the library's (models/kernels/cuda/linear.py pick_config). Each row of `grid` and
`regs` is compared with the one-row kernel's output for that row alone: `exact` where every bit
agrees. The kernels here mirror the library GEMV's core (no norm prologue, SwiGLU or PDL).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _one_row(x, w, out, N, K, stride_w, row_x, row_out, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             ROW_AXIS: tl.constexpr):
    """The one-row GEMV program; ROW_AXIS: the grid's axis 0 names the row (x and out rows at
    row_x / row_out apart), axis 1 the tile."""
    if ROW_AXIS:
        r = tl.program_id(0)
        pid = tl.program_id(1)
    else:
        r = 0
        pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < N
    kk = tl.arange(0, BLOCK_K)
    w_rows = w + n[:, None] * stride_w
    xr = x + r * row_x
    acc = tl.load(w_rows + kk[None, :], mask=nm[:, None] & (kk[None, :] < K), other=0.0).to(tl.float32) * \
        tl.load(xr + kk, mask=kk < K, other=0.0).to(tl.float32)[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        kc = k0 + tl.arange(0, BLOCK_K)
        acc += tl.load(w_rows + kc[None, :], mask=nm[:, None] & (kc[None, :] < K), other=0.0).to(tl.float32) * \
            tl.load(xr + kc, mask=kc < K, other=0.0).to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    tl.store(out + r * row_out + n, y.to(out.dtype.element_ty), mask=nm)


@triton.jit
def _rows_in_registers(x, w, out, N, K, stride_w, row_x, row_out, M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < N
    m = tl.arange(0, M)
    kk = tl.arange(0, BLOCK_K)
    w_rows = w + n[:, None] * stride_w
    wv = tl.load(w_rows + kk[None, :], mask=nm[:, None] & (kk[None, :] < K), other=0.0).to(tl.float32)
    xv = tl.load(x + m[:, None] * row_x + kk[None, :], mask=kk[None, :] < K, other=0.0).to(tl.float32)
    acc = wv[None, :, :] * xv[:, None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        kc = k0 + tl.arange(0, BLOCK_K)
        wv = tl.load(w_rows + kc[None, :], mask=nm[:, None] & (kc[None, :] < K), other=0.0).to(tl.float32)
        xv = tl.load(x + m[:, None] * row_x + kc[None, :], mask=kc[None, :] < K, other=0.0).to(tl.float32)
        acc += wv[None, :, :] * xv[:, None, :]
    y = tl.sum(acc, axis=2)
    tl.store(out + m[:, None] * row_out + n[None, :], y.to(out.dtype.element_ty), mask=nm[None, :])


@triton.jit
def _rows_unrolled(x, w, out, N, K, stride_w, row_x, row_out, M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    """Up to four rows sharing each weight tile loaded once, each row with an accumulator of its own
    of the one-row program's shape and the one-row program's operations on it, in its order (the
    rows unrolled: acc0..acc3), so each row's sums are the one-row kernel's."""
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < N
    kk = tl.arange(0, BLOCK_K)
    w_rows = w + n[:, None] * stride_w
    wv = tl.load(w_rows + kk[None, :], mask=nm[:, None] & (kk[None, :] < K), other=0.0).to(tl.float32)
    acc0 = wv * tl.load(x + kk, mask=kk < K, other=0.0).to(tl.float32)[None, :]
    acc1 = acc0
    acc2 = acc0
    acc3 = acc0
    if M > 1:
        acc1 = wv * tl.load(x + row_x + kk, mask=kk < K, other=0.0).to(tl.float32)[None, :]
    if M > 2:
        acc2 = wv * tl.load(x + 2 * row_x + kk, mask=kk < K, other=0.0).to(tl.float32)[None, :]
    if M > 3:
        acc3 = wv * tl.load(x + 3 * row_x + kk, mask=kk < K, other=0.0).to(tl.float32)[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        kc = k0 + tl.arange(0, BLOCK_K)
        wv = tl.load(w_rows + kc[None, :], mask=nm[:, None] & (kc[None, :] < K), other=0.0).to(tl.float32)
        acc0 += wv * tl.load(x + kc, mask=kc < K, other=0.0).to(tl.float32)[None, :]
        if M > 1:
            acc1 += wv * tl.load(x + row_x + kc, mask=kc < K, other=0.0).to(tl.float32)[None, :]
        if M > 2:
            acc2 += wv * tl.load(x + 2 * row_x + kc, mask=kc < K, other=0.0).to(tl.float32)[None, :]
        if M > 3:
            acc3 += wv * tl.load(x + 3 * row_x + kc, mask=kc < K, other=0.0).to(tl.float32)[None, :]
    tl.store(out + n, tl.sum(acc0, axis=1).to(out.dtype.element_ty), mask=nm)
    if M > 1:
        tl.store(out + row_out + n, tl.sum(acc1, axis=1).to(out.dtype.element_ty), mask=nm)
    if M > 2:
        tl.store(out + 2 * row_out + n, tl.sum(acc2, axis=1).to(out.dtype.element_ty), mask=nm)
    if M > 3:
        tl.store(out + 3 * row_out + n, tl.sum(acc3, axis=1).to(out.dtype.element_ty), mask=nm)


def rows_unrolled(x, w, config):
    (M, K), N = x.shape, w.shape[0]
    assert M <= 4, "the unrolled form holds up to four rows"
    bn, bk, warps = config
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    _rows_unrolled[(triton.cdiv(N, bn),)](x, w, out, N, K, w.stride(0), x.stride(0), out.stride(0), M=M,
                                          BLOCK_N=bn, BLOCK_K=bk, num_warps=warps)
    return out


def one_row(x, w, config, row_axis=False):
    (M, K), N = x.shape, w.shape[0]
    bn, bk, warps = config
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    grid = (M, triton.cdiv(N, bn)) if row_axis else (triton.cdiv(N, bn),)
    _one_row[grid](x, w, out, N, K, w.stride(0), x.stride(0), out.stride(0), BLOCK_N=bn, BLOCK_K=bk,
                   ROW_AXIS=row_axis, num_warps=warps)
    return out


def rows_in_registers(x, w, config):
    (M, K), N = x.shape, w.shape[0]
    bn, bk, warps = config
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    _rows_in_registers[(triton.cdiv(N, bn),)](x, w, out, N, K, w.stride(0), x.stride(0), out.stride(0), M=M,
                                              BLOCK_N=bn, BLOCK_K=bk, num_warps=warps)
    return out


def main() -> None:
    from models.kernels.cuda.linear import pick_config
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="576x1536,1536x576,1024x3584,3584x1024,5120x17408,17408x5120",
                   help="weights N x K (output rows x input features)")
    p.add_argument("--rows", default="1,2,4,8")
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    g = torch.Generator(device="cuda").manual_seed(0)
    print(f"{torch.cuda.get_device_name()}; us a call (median), and each way's time over one row's; "
          "exact: every row's bits those of the one-row kernel on that row alone")
    print(f"{'N x K':>12} {'config':>14} {'rows':>4} {'1 row':>8} {'steps':>16} {'grid':>22} {'regs':>22} "
          f"{'unrolled':>22}")
    for shape in args.shapes.split(","):
        N, K = (int(v) for v in shape.split("x"))
        w = torch.randn(N, K, device="cuda", dtype=dtype, generator=g) * 0.02
        config = pick_config(K, N)
        single = None
        for M in (int(v) for v in args.rows.split(",")):
            x = torch.randn(M, K, device="cuda", dtype=dtype, generator=g)
            alone = torch.cat([one_row(x[i:i + 1], w, config) for i in range(M)])
            grid = one_row(x, w, config, row_axis=True)
            try:
                regs = rows_in_registers(x, w, config)
            except Exception as e:  # (a config whose M-row accumulator does not fit: reported, not fatal)
                regs = None
                why = type(e).__name__
            t_steps = triton.testing.do_bench(lambda: [one_row(x[i:i + 1], w, config) for i in range(M)]) * 1e3
            t_grid = triton.testing.do_bench(lambda: one_row(x, w, config, row_axis=True)) * 1e3
            t_regs = triton.testing.do_bench(lambda: rows_in_registers(x, w, config)) * 1e3 if regs is not None else None
            unrolled = rows_unrolled(x, w, config) if M <= 4 else None
            t_unr = triton.testing.do_bench(lambda: rows_unrolled(x, w, config)) * 1e3 if unrolled is not None else None
            if single is None:
                single = t_steps / M
            exact_grid = torch.equal(grid, alone)
            cell_regs = (f"{t_regs:7.1f} {t_regs / single:5.2f}x {'exact' if torch.equal(regs, alone) else 'DIFF '}"
                         if regs is not None else f"{'(' + why + ')':>22}")
            cell_unr = (f"{t_unr:7.1f} {t_unr / single:5.2f}x {'exact' if torch.equal(unrolled, alone) else 'DIFF '}"
                        if unrolled is not None else f"{'-':>22}")
            print(f"{shape:>12} {str(config):>14} {M:>4} {single:8.1f} {t_steps:8.1f} {t_steps / single:6.2f}x "
                  f"{t_grid:7.1f} {t_grid / single:5.2f}x {'exact' if exact_grid else 'DIFF '} {cell_regs} {cell_unr}")


if __name__ == "__main__":
    main()
