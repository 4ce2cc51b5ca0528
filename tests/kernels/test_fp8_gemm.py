"""FP8 prefill on the FP8 tensor cores (models/kernels/cuda/fp8_gemm.py): the input rows quantized
to e4m3 per 128-wide group, then cuBLAS's block-scaled GEMM.

Documented tolerances (rms of the difference over rms of the reference, Gaussian inputs):
  - matmul against `oracle` (the same quantized input and weights, one fp32 matmul): <= 5e-3 and
    max <= 1.5e-2 of the largest |value| (the tensor cores' FP8 sums; set AC measured ~1.5e-3);
  - matmul, and oracle, against the exact product of the bf16 input and the dequantized weights:
    <= 4e-2 (the input's rounding to e4m3, ~2.6% rms; the dequantize-then-bf16 form: ~2e-3);
  - a tiny FP8 checkpoint's whole-prompt logits, this form against the dequantize-then-GEMM form
    (CHAT_FP8_PREFILL=dequant), bf16: <= 5e-2 of the largest |logit|.
quantize_rows equals the oracle's quantization bit for bit. (Triton's interpreter casts fp32 to
e4m3 with other roundings, so the kernel has no CPU test; the CPU tests check the oracle and the
serving rule.)
"""
import pytest
import torch

from models.kernels.cuda import fp8_gemm

CUDA = torch.device("cuda")


def _rms(a, b):
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt())


def _weight(n, k, group, device, seed=0):
    """An FP8 QWeight of random codes (|w| up to ~12 before the scales) and random block scales
    (one per 128 x 128 block, or one per row and 128 columns where group is 1)."""
    from models.quant.layers import QWeight
    g = torch.Generator().manual_seed(seed)
    codes = (torch.randn(n, k, generator=g) * 4).to(torch.float8_e4m3fn)
    scales = torch.rand(-(-n // group), k // 128, generator=g) * 1e-2 + 1e-3
    return QWeight("FP8", codes.to(device), n, k, scales=scales.to(device), group=group)


def test_oracle_departs_from_the_exact_product_by_the_inputs_rounding():
    """The oracle (the tensor form's arithmetic) against the bf16 input's exact product: the e4m3
    input's ~2.6% rms; an all-zero group quantizes to zeros (its scale 1), not NaN."""
    qw = _weight(256, 384, 128, "cpu")
    x = torch.randn(40, 384, generator=torch.Generator().manual_seed(1)).bfloat16()
    x[3, 128:256] = 0
    w = qw.data.float() * qw.scales.repeat_interleave(128, 0).repeat_interleave(128, 1)
    exact = x.float() @ w.t()
    o = fp8_gemm.oracle(x, qw)
    assert torch.isfinite(o).all()
    assert 5e-3 < _rms(o, exact) <= 4e-2


def test_serves_only_a_cuda_half_input_and_scales_it_can_index(monkeypatch):
    qw = _weight(256, 256, 128, "cpu")
    assert not fp8_gemm.serves(torch.zeros(4, 256, dtype=torch.bfloat16), qw)  # the CPU
    if torch.cuda.is_available():
        x = torch.zeros(4, 256, dtype=torch.bfloat16, device=CUDA)
        hopper = torch.cuda.get_device_capability() == (9, 0) and hasattr(torch.nn.functional, "scaled_mm")
        assert fp8_gemm.serves(x, _weight(256, 256, 128, CUDA)) == hopper
        assert not fp8_gemm.serves(x.float(), _weight(256, 256, 128, CUDA))
        assert not fp8_gemm.serves(x, _weight(200, 256, 128, CUDA))  # a partial block of rows
        assert fp8_gemm.serves(x, _weight(208, 256, 1, CUDA)) == hopper  # a scale a row, N a multiple of 16
        monkeypatch.setattr(fp8_gemm, "MODE", "dequant")
        assert not fp8_gemm.serves(x, _weight(256, 256, 128, CUDA))


def _hopper():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the block-scaled FP8 GEMM runs on Hopper")


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 57, 300])
@pytest.mark.parametrize("k", [128, 640, 5120])
def test_quantize_rows_is_the_oracles_quantization(m, k):
    _hopper()
    g = torch.Generator(device=CUDA).manual_seed(m + k)
    x = torch.randn(m, k, device=CUDA, generator=g) * torch.logspace(-3, 3, m, device=CUDA)[:, None]
    x = x.bfloat16()
    x[0, :128] = 0  # an all-zero group
    q, s = fp8_gemm.quantize_rows(x)
    mp = -(-m // fp8_gemm.ROW_MULTIPLE) * fp8_gemm.ROW_MULTIPLE
    assert q.shape == (mp, k) and s.shape == (k // 128, mp)
    grp = x.float().view(m, k // 128, 128)
    amax = grp.abs().amax(-1, keepdim=True)
    sc = torch.where(amax > 0, amax / torch.full_like(amax, 448.0), torch.ones_like(amax))
    qq = (grp / sc).clamp(-448, 448).to(torch.float8_e4m3fn).view(m, k)
    assert torch.equal(q[:m].view(torch.uint8), qq.view(torch.uint8))
    assert torch.equal(s[:, :m], sc.view(m, -1).t())
    assert not q[m:].view(torch.uint8).any() and bool((s[:, m:] == 1).all())  # the padding rows


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,group", [(256, 128, 128), (384, 640, 128), (2048, 5120, 128), (256, 384, 1),
                                       (1040, 5120, 1)])
@pytest.mark.parametrize("m", [1, 57, 2048])
def test_matmul_is_the_oracle(n, k, group, m):
    """Both scale recipes (128 x 128 blocks, K blocks padded where fewer than a multiple of 4; a
    scale a row), rows padded to 16 or not, against the same arithmetic in fp32 and against the
    exact product."""
    _hopper()
    qw = _weight(n, k, group, CUDA, seed=n + k)
    x = torch.randn(m, k, device=CUDA, generator=torch.Generator(device=CUDA).manual_seed(m)).bfloat16()
    assert fp8_gemm.serves(x, qw)
    y = fp8_gemm.matmul(x, qw, torch.float32)
    o = fp8_gemm.oracle(x, qw)
    assert y.shape == (m, n)
    assert _rms(y, o) <= 5e-3 and float((y - o).abs().max()) <= 1.5e-2 * float(o.abs().max())
    w = qw.data.float() * qw.scales.repeat_interleave(group, 0)[:n].repeat_interleave(128, 1)
    assert _rms(y, x.float() @ w.t()) <= 4e-2
    yb = fp8_gemm.matmul(x, qw)  # bf16 out: the same sums rounded once
    assert yb.dtype == torch.bfloat16 and _rms(yb.float(), y) <= 4e-3


@pytest.mark.gpu
@pytest.mark.parametrize("group", [128, 1])
def test_matmul_takes_fp16_and_strided_rows(group):
    """fp16 rows in and out, and rows strided past K (a view of a wider buffer, as a fused
    projection's slice is): the oracle's sums, the same as the contiguous bf16 form's bounds."""
    _hopper()
    n, k, m = 384, 640, 57
    qw = _weight(n, k, group, CUDA, seed=7)
    wide = torch.randn(m, k + 256, device=CUDA, generator=torch.Generator(device=CUDA).manual_seed(3))
    for x in (wide[:, 128:128 + k].half(), wide.bfloat16()[:, 128:128 + k]):
        assert fp8_gemm.serves(x, qw) and (x.dtype == torch.float16 or x.stride(0) == k + 256)
        y = fp8_gemm.matmul(x, qw)
        o = fp8_gemm.oracle(x, qw)
        assert y.dtype == x.dtype and y.shape == (m, n)
        assert _rms(y.float(), o) <= 5e-3


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["llama", "qwen3_5"])
def test_fp8_checkpoint_prefill_takes_the_tensor_cores(tmp_path, monkeypatch, kind):
    """A tiny FP8 checkpoint's whole-prompt forward in bf16: the FP8 linears that `serves` takes
    run through matmul (counted), and the logits stay within 5e-2 of the dequantize-then-GEMM
    form's, the same greedy tokens at most positions."""
    _hopper()
    import models
    from engine.reference import full_logits
    from tests.support.tiny_hf_quant import write_quantized
    qdir, _ = write_quantized(kind, str(tmp_path), "fp8")
    lm = models.load(qdir, CUDA, torch.bfloat16, quantized=True)
    prompt = list(range(3, 120))
    calls = []
    real = fp8_gemm.matmul
    monkeypatch.setattr(fp8_gemm, "matmul", lambda *a, **k: calls.append(1) or real(*a, **k))
    tensor = full_logits(lm.model, prompt, CUDA).float()
    assert calls
    monkeypatch.setattr(fp8_gemm, "MODE", "dequant")
    calls.clear()
    dequant = full_logits(lm.model, prompt, CUDA).float()
    assert not calls
    assert float((tensor - dequant).abs().max()) <= 5e-2 * float(dequant.abs().max())
    assert float((tensor.argmax(-1) == dequant.argmax(-1)).float().mean()) >= 0.9
