"""The bf16 one-token GEMV (models/kernels/cuda/linear.py): its configs (pick_config: which matrices
are read in one prefetched K step, and the K steps of long rows; pure Python, no GPU or Triton
needed), and on CUDA (gpu-marked) its results under them against F.linear: plain, SwiGLU, scaled,
with a deferred norm in its prologue, and as the LM head's fp32 GEMV."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from models.kernels.cuda import linear


@pytest.mark.parametrize("K,N", [(2048, 8192), (1024, 3584), (896, 4864), (2048, 16384), (4096, 2048),
                                 (3072, 3072)])
def test_one_k_step_only_for_weights_up_to_the_bound_counting_a_pairs_up_rows(K, N):
    """A SwiGLU pair's launch reads its N gate rows and N up rows: its bytes count both (LFM2-1.2B's
    [2 x 8192, 2048] pair, 64 MiB, read in one step by its gate rows' 32 MiB, ran at 2.8 TB/s
    against 3.8 streamed: bench/RESULTS.md set AI)."""
    for pair in (False, True):
        bn, bk, warps = linear.pick_config(K, N, pair)
        whole = bk >= K
        assert whole == (N * K * 2 * (2 if pair else 1) <= linear.WHOLE_K_MAX_BYTES)


@pytest.mark.parametrize("K,N", [(8192, 2048), (4864, 896), (5120, 640), (6000, 2050), (17408, 1024)])
def test_rows_too_long_to_read_whole_take_long_k_steps(K, N):
    """Few rows of over 4,096 weights (a down projection): steps that give each thread at least
    8 weights (16 bytes) a step, not the 2 of steps of 128 (LFM2-1.2B's down 8.6 against 12.6 us,
    Qwen2.5-0.5B's 3.3 against 5.4: set AI)."""
    bn, bk, warps = linear.pick_config(K, N)
    assert bk < K and bn * bk // (32 * warps) >= 8


@pytest.mark.gpu
@pytest.mark.parametrize("K,N", [(576, 960), (1536, 576), (896, 1000), (1024, 49152), (5120, 640), (6000, 2050),
                                 (2048, 16384)])
def test_gemv_kernel_matches_linear(K, N):
    """The one-token Triton GEMV (one whole prefetched K step, streamed K steps, uneven steps and
    rows, the long steps of long rows, a SwiGLU pair over the one-step bound) and its SwiGLU form."""
    from models.kernels.cuda import base as cuda_base, linear as cuda_linear
    if not cuda_base.ENABLED:
        pytest.skip("Triton is not installed here")
    dev, bf = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(2)
    x = torch.randn(1, K, device=dev, dtype=bf, generator=g)
    w = torch.randn(N, K, device=dev, dtype=bf, generator=g) * 0.05
    b = torch.randn(N, device=dev, dtype=bf, generator=g)
    ref = F.linear(x.float(), w.float(), b.float())
    assert torch.allclose(cuda_linear.gemv(x, w, b).float(), ref, atol=2e-2, rtol=1e-2)
    gate, up = F.linear(x.float(), w.float()).chunk(2, dim=-1)
    assert torch.allclose(cuda_linear.gemv(x, w, swiglu=True).float(), F.silu(gate) * up, atol=2e-2, rtol=1e-2)
    # times a scale in the epilogue (Granite's residual multiplier): the bits of the product after it
    for scale in (0.22, 1.0, 3.0):
        assert torch.equal(cuda_linear.gemv(x, w, b, scale=scale), cuda_linear.gemv(x, w, b) * scale)
        r, nw = x.flip(-1), torch.rand(K, device=dev, generator=g) + 0.5  # a NormedRow input too
        want = cuda_linear.gemv(cuda_linear.NormedRow(x, r, nw, 1e-6), w) * scale
        assert torch.equal(cuda_linear.gemv(cuda_linear.NormedRow(x, r, nw, 1e-6), w, scale=scale), want)


@pytest.mark.gpu
@pytest.mark.parametrize("res,K,N", [(True, 576, 1536), (False, 576, 1536), (True, 5120, 2048)])
def test_gemv_norm_prologue_matches_add_norm_then_linear(res, K, N):
    """A deferred add + RMSNorm (NormedRow) computed in the GEMV's prologue: the stream written
    equals x + res bit for bit, the output matches norm-then-linear, plain and SwiGLU."""
    from models.kernels.cuda import base as cuda_base, linear as cuda_linear
    if not cuda_base.ENABLED:
        pytest.skip("Triton is not installed here")
    dev, bf = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(4)
    x = torch.randn(1, K, device=dev, dtype=bf, generator=g)
    r = torch.randn(1, K, device=dev, dtype=bf, generator=g) if res else None
    nw = torch.rand(K, device=dev, generator=g) + 0.5
    w = torch.randn(N, K, device=dev, dtype=bf, generator=g) * (1.2 / K ** 0.5)  # outputs ~1 at any K
    s = x + r if res else x
    h = F.rms_norm(s.float(), (K,), nw, 1e-5).to(bf).float()
    row = cuda_linear.NormedRow(x, r, nw, 1e-5)
    assert torch.allclose(cuda_linear.gemv(row, w).float(), F.linear(h, w.float()), atol=2e-2, rtol=1e-2)
    assert torch.equal(row.stream, s)
    row = cuda_linear.NormedRow(x, r, nw, 1e-5)
    gate, up = F.linear(h, w.float()).chunk(2, dim=-1)
    assert torch.allclose(cuda_linear.gemv(row, w, swiglu=True).float(), F.silu(gate) * up, atol=2e-2, rtol=1e-2)
    assert torch.equal(row.stream, s)
    assert torch.allclose(cuda_linear.NormedRow(x, r, nw, 1e-5).materialize().float(), h, atol=2e-2, rtol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("N", [1000, 40000])  # the norm in the GEMV's prologue; a separate launch (> 32 MB)
def test_lm_head_hands_fp32_logits_on_cuda(N):
    """The final norm + LM head on the Triton path: fp32 out, sums never rounded to bf16."""
    from models.kernels.cuda.linear import NormedRow
    from models.architectures.layers import Linear, head_logits
    K = 1024
    g = torch.Generator(device="cuda").manual_seed(N)
    head = Linear(K, N, bias=False).cuda().to(torch.bfloat16)
    head.weight.data.normal_(0, 0.05, generator=g)
    x, res = (torch.randn(1, K, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
    norm_w = (1 + 0.1 * torch.randn(K, device="cuda", generator=g)).to(torch.bfloat16)
    stream = (x.float() + res.float()).to(torch.bfloat16).double()
    h = F.rms_norm(stream, (K,), norm_w.double(), 1e-6)
    ref = h @ head.weight.double().t()
    row = NormedRow(x, res, norm_w, 1e-6, torch.float32)
    out = head_logits(head, row)
    assert out.dtype == torch.float32
    rel = float((out.double() - ref).norm() / ref.norm())
    assert rel < 1e-5, rel
    assert torch.equal(row.stream, stream.to(torch.bfloat16))
    plain = head_logits(head, h.float())  # an fp32 tensor row: the GEMV reads it as it is
    assert plain.dtype == torch.float32 and float((plain.double() - ref).norm() / ref.norm()) < 1e-5
