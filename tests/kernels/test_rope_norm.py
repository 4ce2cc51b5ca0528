"""The Triton kernels of an attention layer's input (models/kernels/cuda/base.py) against their torch
forms, on CUDA: the q/k norms + RoPE + KV write of one token (decode) and of several (prefill),
Qwen3.5's gated heads with zero-centred norms and partial RoPE among them, and the residual add +
RMSNorm."""
import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu


def test_fused_kernels_match_torch_forms():
    """RoPE + KV write and add + RMSNorm, for one token (decode) and for several (prefill)."""
    from models.kernels.cuda import base as cuda_base
    from models.architectures.layers import Rope
    if not cuda_base.ENABLED:
        pytest.skip("Triton is not installed here")
    dev, bf = torch.device("cuda"), torch.bfloat16
    H, KVH, D, S = 9, 3, 64, 32
    rope = Rope(D, 10000.0)
    rope.reset_buffers(dev)
    for first, T in ((13, 1), (9, 5)):
        qkv = torch.randn(T, (H + 2 * KVH) * D, device=dev, dtype=bf)
        pos = torch.arange(first, first + T, device=dev)
        cos, sin = rope.cos_sin(pos, bf)
        kc, vc = torch.randn(KVH, S, D, device=dev, dtype=bf), torch.randn(KVH, S, D, device=dev, dtype=bf)
        kc0, vc0 = kc.clone(), vc.clone()
        q = cuda_base.qk_rope_kv_write(qkv, cos, sin, pos, kc, vc, H, KVH)
        assert q.shape == (H, T, D)
        heads = qkv.view(T, H + 2 * KVH, D).transpose(0, 1).float()
        ref = rope.apply(heads[:H + KVH], cos.float(), sin.float())
        assert torch.allclose(q.float(), ref[:H], atol=2e-2, rtol=1e-2)
        live = slice(first, first + T)
        assert torch.allclose(kc[:, live].float(), ref[H:], atol=2e-2, rtol=1e-2)
        assert torch.equal(vc[:, live], heads[H + KVH:].to(bf))
        untouched = torch.ones(S, dtype=torch.bool)
        untouched[live] = False
        assert torch.equal(kc[:, untouched], kc0[:, untouched]) and torch.equal(vc[:, untouched], vc0[:, untouched])

    for T in (1, 7):
        x, y = (torch.randn(T, 576, device=dev, dtype=bf) for _ in range(2))
        w = torch.randn(576, device=dev, dtype=bf)
        s, n = cuda_base.add_rms_norm(x, y, w, 1e-5)
        assert torch.equal(s, x + y)
        assert torch.allclose(n.float(), F.rms_norm((x + y).float(), (576,), w.float(), 1e-5), atol=3e-2, rtol=1e-2)


@pytest.mark.parametrize("T", [1, 3, 37])
def test_qk_norm_partial_rope_kernel_matches_torch_forms(T):
    """Qwen3.5's gated attention: q heads 2D apart (each followed by its gate), zero-centred q/k
    norms, RoPE over the first quarter of each head; one token (decode's form), and a prefill's
    tokens in one partial block of 16 and in several."""
    from models.kernels.cuda import base as cuda_base
    from models.architectures.layers import Rope
    if not cuda_base.ENABLED:
        pytest.skip("Triton is not installed here")
    dev, bf = torch.device("cuda"), torch.bfloat16
    H, KVH, D, R, S = 8, 2, 256, 64, 64
    qkv = torch.randn(T, H * 2 * D + 2 * KVH * D, device=dev, dtype=bf)
    rope = Rope(D, 1e7, rotary_dim=R)
    rope.reset_buffers(dev)
    pos = torch.arange(21, 21 + T, device=dev)
    cos, sin = rope.cos_sin(pos, bf)
    kc, vc = torch.zeros(KVH, S, D, device=dev, dtype=bf), torch.zeros(KVH, S, D, device=dev, dtype=bf)
    qw, kw = torch.rand(D, device=dev) + 0.5, torch.rand(D, device=dev) + 0.5
    q = cuda_base.qk_rope_kv_write(qkv, cos, sin, pos, kc, vc, H, KVH, q_stride=2 * D, norm_weights=(qw, kw), eps=1e-6)
    x = qkv.float()
    qh = F.rms_norm(x[:, :H * 2 * D].view(T, H, 2 * D)[..., :D], (D,), qw, 1e-6)
    kh = F.rms_norm(x[:, H * 2 * D:H * 2 * D + KVH * D].view(T, KVH, D), (D,), kw, 1e-6)
    want_q = rope.apply(qh.transpose(0, 1), cos.float(), sin.float())
    want_k = rope.apply(kh.transpose(0, 1), cos.float(), sin.float())
    assert torch.allclose(q.float(), want_q, atol=3e-2, rtol=1e-2)
    assert torch.allclose(kc[:, 21:21 + T].float(), want_k, atol=3e-2, rtol=1e-2)
    assert torch.equal(vc[:, 21:21 + T], qkv[:, H * 2 * D + KVH * D:].view(T, KVH, D).transpose(0, 1))
    assert int(kc[:, :21].count_nonzero()) == 0 and int(vc[:, 21 + T:].count_nonzero()) == 0
