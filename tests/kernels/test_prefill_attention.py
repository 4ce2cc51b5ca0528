"""The Triton causal prefill attention (models/kernels/cuda/prefill_attention.py) against the fp32
masked SDPA form, run by Triton's interpreter on the CPU where Triton is importable (PYTHONPATH);
tests/engine/test_gpu.py runs the compiled kernel against flash and the fp32 form on the device."""
import importlib.util

import pytest

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
