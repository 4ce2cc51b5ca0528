"""The Triton decode attention (models/kernels/cuda/attention.py: one token over the live slots,
split over slices and merged) against the torch form in fp32, on CUDA."""
import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("H,KVH,D,S", [(9, 3, 64, 8192), (14, 2, 64, 600), (8, 2, 256, 300)])
def test_decode_attention_kernel_matches_torch_form(H, KVH, D, S):
    """Live slots only (stale slots past the position hold garbage that must not leak in), at
    positions that leave slices empty, fill one block exactly, and span many slices. Compared
    with the torch form in fp32: its bf16 form rounds the scores before the softmax (the kernel
    keeps them fp32), so on sharp softmaxes it is the less exact of the two."""
    from models.kernels.cuda import attention as cuda_attention, base as cuda_base
    from models.architectures.layers import decode_attention
    if not cuda_base.ENABLED:
        pytest.skip("Triton is not installed here")
    dev, bf = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(3)
    kc = torch.randn(KVH, S, D, device=dev, dtype=bf, generator=g) * 3
    vc = torch.randn(KVH, S, D, device=dev, dtype=bf, generator=g)
    q = torch.randn(H, 1, D, device=dev, dtype=bf, generator=g)
    gate = torch.randn(1, H * 2 * D, device=dev, dtype=bf, generator=g)
    for pos in sorted({0, 1, 63, 64, 200, S // 2 + 7, S - 1}):
        p = torch.tensor([pos], device=dev)
        ref = decode_attention(q.float(), kc[:, :pos + 1].float(), vc[:, :pos + 1].float(), None)
        out = cuda_attention.decode(q, kc, vc, p)
        assert torch.allclose(out.float(), ref, atol=2e-2, rtol=2e-2), (pos, float((out.float() - ref).abs().max()))
        assert torch.equal(out, cuda_attention.decode(q, kc, vc, p))  # the same bits every run
        gated = cuda_attention.decode(q, kc, vc, p, gate[:, D:], 2 * D)
        want = ref * torch.sigmoid(gate.view(H, 2 * D)[:, D:].reshape(1, -1).float())
        assert torch.allclose(gated.float(), want, atol=2e-2, rtol=2e-2)
