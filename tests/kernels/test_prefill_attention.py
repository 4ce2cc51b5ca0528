"""The Triton causal prefill attention (models/kernels/cuda/prefill_attention.py) against the fp32
masked SDPA form, run by Triton's interpreter on the CPU where Triton is importable (PYTHONPATH);
on CUDA (gpu-marked), the compiled kernel against the fp32 form and the torch forms it replaces
(flash from position 0, whose call attend_cached makes itself, and the masked form over a prefix)."""
import importlib.util

import pytest
import torch
import torch.nn.functional as F

from tests.support.interpreted import run_interpreted

INTERPRETED = r"""
import sys
sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[1] + "/bench")
import torch
from models.kernels.cuda import prefill_attention
from prefill_attention_sweep import reference  # the fp32 masked form, as the sweep checks the kernel

def case(H, KVH, D, start, T, config, seed, qmem="hd"):
    g = torch.Generator().manual_seed(seed)
    if qmem == "th":   # qk_rope_kv_write's [T, H, D] memory, viewed as [H, T, D]
        q = torch.randn(T, H, D, generator=g).half().transpose(0, 1)
    else:
        q = torch.randn(H, T, D, generator=g).half()
    kc = torch.randn(KVH, start + T + 9, D, generator=g).half()   # slots past the live ones: never read
    vc = torch.randn(KVH, start + T + 9, D, generator=g).half()
    kc[:, start + T:] = float("nan")
    vc[:, start + T:] = float("nan")
    got = prefill_attention.causal(q, kc, vc, start, config).float()
    ref = reference(q, kc, vc, start)
    err = (got - ref).abs().max().item()
    assert err <= 2e-3, (H, KVH, D, start, T, config, err)
    return got

# from position 0 and over a prefix; GQA; a padded head size; blocks cut mid-way; q strided
case(4, 2, 32, 0, 70, (32, 16, 4, 1), 1)
case(4, 1, 40, 21, 37, (16, 16, 4, 1), 2, "th")
case(2, 2, 16, 50, 1, (16, 32, 4, 1), 3)
case(6, 3, 64, 0, 33, None, 4, "th")
# a later turn's queries over the cached prefix give a cold prefill's values for the same q, k, v
g = torch.Generator().manual_seed(9)
H, KVH, D, T = 4, 2, 32, 45
q = torch.randn(H, T, D, generator=g).half()
kc, vc = (torch.randn(KVH, T, D, generator=g).half() for _ in range(2))
cold = prefill_attention.causal(q, kc, vc, 0, (16, 16, 4, 1))
warm = prefill_attention.causal(q[:, 29:].contiguous(), kc, vc, 29, (16, 16, 4, 1))
assert torch.equal(cold[29:], warm)
# the start read from the positions on the device (a graph's replay at any start) gives the same bits
positions = torch.arange(29, 29 + T - 29)
assert torch.equal(prefill_attention.causal(q[:, 29:].contiguous(), kc, vc, positions, (16, 16, 4, 1)), warm)
print("ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (its interpreter) importable")
def test_causal_prefill_attention_interpreted():
    run_interpreted(INTERPRETED, portable_blas=True)  # (its cold = warm check compares bits)


@pytest.mark.gpu
@pytest.mark.parametrize("H,KVH,D,T", [(32, 4, 128, 2048), (16, 2, 256, 37), (8, 8, 64, 300), (6, 2, 96, 129)])
def test_prefill_flash_call_equals_sdpa(H, KVH, D, T, monkeypatch):
    """attend_cached's prefill from position 0 with the Triton kernel off (and on GPUs before
    sm_90) calls flash's kernel itself: the same bits as SDPA restricted to its flash backend
    (GQA read grouped), q in the [T, H, D] memory qk_rope_kv_write leaves it in; and the slower
    forms' fp32 result to bf16 rounding."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from models.architectures import layers
    from models.architectures.layers import attend_cached
    monkeypatch.setattr(layers, "TRITON_PREFILL_ATTENTION", False)
    g = torch.Generator(device="cuda").manual_seed(H * D + T)
    q = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16, generator=g).transpose(0, 1)
    kc, vc = (torch.randn(KVH, T + 20, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    out = attend_cached(q, kc, vc, T, None)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        ref = F.scaled_dot_product_attention(q[None], kc[None, :, :T], vc[None, :, :T], is_causal=True,
                                             enable_gqa=KVH != H)[0].transpose(0, 1).reshape(T, -1)
    assert torch.equal(out, ref)
    rep = H // KVH
    exact = F.scaled_dot_product_attention(q[None].float(), kc[None, :, :T].float().repeat_interleave(rep, 1),
                                           vc[None, :, :T].float().repeat_interleave(rep, 1), is_causal=True)
    assert torch.allclose(out.float(), exact[0].transpose(0, 1).reshape(T, -1), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("H,KVH,D,start,T", [(32, 4, 128, 0, 2048), (24, 4, 256, 0, 700), (16, 2, 256, 3000, 201),
                                             (14, 2, 64, 0, 129), (6, 2, 96, 77, 65), (8, 8, 64, 1, 2),
                                             (32, 4, 128, 9000, 1000)])
def test_triton_prefill_attention_is_closer_to_fp32_than_torchs(H, KVH, D, start, T):
    """attend_cached's prefill (from position 0 or over a cached prefix) by the Triton kernel on
    sm_90+: within bf16 rounding of the fp32 masked form and no further from it than the form it
    replaced (flash from position 0, the masked kernel over a prefix) by more than a rounding; a
    continued prefill gives the bits of a cold prefill of the whole text (the kernel's contract);
    slots past the live ones (NaN here) are never read."""
    from models.architectures import layers
    from models.kernels.cuda import prefill_attention
    if not torch.cuda.get_device_capability()[0] >= 9:
        pytest.skip("the Triton prefill attention serves sm_90 and newer")
    g = torch.Generator(device="cuda").manual_seed(H * D + T + start)
    qa = torch.randn(start + T, H, D, device="cuda", dtype=torch.bfloat16, generator=g).transpose(0, 1)
    q = qa[:, start:]
    kc, vc = (torch.randn(KVH, start + T + 40, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    kc[:, start + T:], vc[:, start + T:] = float("nan"), float("nan")
    mask = layers.causal_mask(torch.arange(start, start + T, device="cuda"), start + T, torch.bfloat16) if start else None
    n = start + T
    rep = H // KVH
    exact = F.scaled_dot_product_attention(
        q[None].float(), kc[None, :, :n].float().repeat_interleave(rep, 1), vc[None, :, :n].float().repeat_interleave(rep, 1),
        attn_mask=None if mask is None else mask.float(), is_causal=mask is None)[0].transpose(0, 1).reshape(T, -1)
    assert layers._triton_prefill_takes(q, kc, vc)
    out = layers.attend_cached(q, kc, vc, n, mask)
    assert torch.equal(out, prefill_attention.causal(q, kc, vc, start))
    layers.TRITON_PREFILL_ATTENTION = False
    try:
        before = layers.attend_cached(q, kc, vc, n, mask)
    finally:
        layers.TRITON_PREFILL_ATTENTION = True
    err, err_before = ((o.float() - exact).abs().max().item() for o in (out, before))
    print(f"max |error| against fp32: triton {err:.3g}, torch's {err_before:.3g}")
    assert err <= max(2 * err_before, 4e-3)
    if start:
        assert torch.equal(prefill_attention.causal(qa, kc, vc, 0)[start:], out)
