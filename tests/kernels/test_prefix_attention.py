"""The continued prefill's attention in two flash parts (prefix, then the new block) merged by
log-sum-exp (layers.SPLIT_PREFIX on CUDA), against the masked SDPA form."""
import pytest
import torch
import torch.nn.functional as F

from models.architectures.layers import causal_mask, prefix_and_causal_attention


def masked(q, keys, values, start):
    T = q.shape[1]
    mask = causal_mask(torch.arange(start, start + T, device=q.device), start + T, torch.float32)
    rep = q.shape[0] // keys.shape[0]
    k, v = keys.repeat_interleave(rep, 0), values.repeat_interleave(rep, 0)
    return F.scaled_dot_product_attention(q[None].float(), k[None].float(), v[None].float(), attn_mask=mask)[0]


def case(H, KVH, D, start, T, device, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(H, T, D, generator=g).to(device, dtype)
    keys = torch.randn(KVH, start + T, D, generator=g).to(device, dtype)
    values = torch.randn(KVH, start + T, D, generator=g).to(device, dtype)
    return q, keys, values


@pytest.mark.parametrize("H,KVH,D,start,T", [(4, 2, 16, 37, 5), (6, 6, 8, 1, 9), (8, 1, 32, 300, 64)])
def test_split_attention_equals_the_masked_form_on_the_cpu(H, KVH, D, start, T):
    q, k, v = case(H, KVH, D, start, T, "cpu", torch.float32)
    got = prefix_and_causal_attention(q, k, v, start)
    assert torch.allclose(got, masked(q, k, v, start), atol=2e-6, rtol=1e-5)


def test_split_attention_can_fail():
    q, k, v = case(4, 2, 16, 37, 5, "cpu", torch.float32)
    assert not torch.allclose(prefix_and_causal_attention(q, k, v, 36), masked(q, k, v, 37), atol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("H,KVH,D,start,T", [(24, 4, 256, 16000, 201), (8, 2, 256, 2000, 201), (9, 3, 64, 513, 7)])
def test_split_attention_on_cuda_is_within_bf16_rounding_of_the_fp32_masked_form(H, KVH, D, start, T):
    q, k, v = case(H, KVH, D, start, T, "cuda", torch.bfloat16)
    got = prefix_and_causal_attention(q, k, v, start).float()
    ref = masked(q, k, v, start)
    rep = H // KVH
    # the form it replaces, in bf16 as it ran
    mask = causal_mask(torch.arange(start, start + T, device="cuda"), start + T, torch.bfloat16)
    bf16_masked = F.scaled_dot_product_attention(q[None], k.repeat_interleave(rep, 0)[None],
                                                 v.repeat_interleave(rep, 0)[None], attn_mask=mask)[0].float()
    err, err_old = (got - ref).abs().max().item(), (bf16_masked - ref).abs().max().item()
    print(f"max |error| vs fp32: split {err:.3g}, masked bf16 {err_old:.3g}")
    assert err <= max(2 * err_old, 1e-2), (err, err_old)
