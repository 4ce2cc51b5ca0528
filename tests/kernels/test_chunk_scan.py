"""The chunked gated delta rule's Triton kernels (models/kernels/cuda/scan.py: a prefill's terms and
its scan) against the torch loop and the naive recurrence, on CUDA."""
import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("T,H,dk,dv,Hk", [(200, 4, 128, 128, 4), (64, 3, 64, 32, 3), (1000, 2, 128, 64, 2),
                                          (300, 4, 128, 128, 2)])
def test_chunk_scan_kernel_matches_the_torch_scan(T, H, dk, dv, Hk):
    """The chunked gated delta rule with its terms and its scan in Triton kernels (cuda_scan)
    against the torch loop and the naive recurrence: outputs and the final state, from a non-zero
    state, over a partial last chunk; with Hk < H, the key heads unrepeated and v with a feature
    stride of T (as a torch conv's transposed output leaves it)."""
    from models.architectures import gated_delta
    from models.kernels.cuda import base as cuda_base
    if not cuda_base.ENABLED:
        pytest.skip("Triton is not installed here")
    q, k, v, gate, beta, s0 = gated_delta.example_inputs(T, H, dk, dv, torch.device("cuda"))
    if Hk < H:
        q, k = q[:, ::H // Hk].repeat_interleave(H // Hk, 1), k[:, ::H // Hk].repeat_interleave(H // Hk, 1)
        v = v.reshape(T, H * dv).t().contiguous().t().reshape(T, H, dv)
    s_loop, s_fused, s_naive = s0.clone(), s0.clone(), s0.clone()
    loop = gated_delta.chunked(q, k, v, gate, beta, s_loop)
    qf, kf = (q[:, ::H // Hk], k[:, ::H // Hk]) if Hk < H else (q, k)  # (the repeated heads' sources)
    fused = gated_delta.chunked(qf, kf, v, gate, beta, s_fused, fused=True)
    naive = gated_delta.recurrent_naive(q, k, v, gate, beta, s_naive)
    assert torch.allclose(fused, loop, atol=1e-4, rtol=1e-4)
    assert torch.allclose(s_fused, s_loop, atol=1e-4, rtol=1e-4)
    assert torch.allclose(fused, naive, atol=2e-3, rtol=2e-3)
    assert torch.allclose(s_fused, s_naive, atol=2e-3, rtol=2e-3)
