"""GatedDeltaNet.fuse where its four input projections are stored in different formats (a qwen35
Q4_K_M file of llama.cpp's quantizer holds attn_qkv in Q6_K in some layers, attn_gate in Q4_K;
GPTQ checkpoints leave b and a in bf16): qkv with z and b with a each become one matmul where the
pair shares a format, the groups kept in order; `projections` splits their outputs for the torch
path and `project_in` joins them for the CUDA decode step's kernel, which so runs for every mix
of formats. The layer computes what the same layer computes on the dequantized weights (fp32 on
the CPU; bf16 on CUDA, the kernel step against the torch step)."""
import copy

import pytest
import torch

from models.plan import bind_forms
from tests.support.hybrid import delta_layer_and_states
from tests.support.quant import int4_linear

NK, NV, DK, DV = 2, 4, 64, 64

# projections stored 4-bit (the others stay plain) → the groups fuse makes: their types and sizes
CASES = {
    "qkv+z 4-bit": (("in_proj_qkv", "in_proj_z"), [("GroupInt4Linear", [512, 256]), ("FusedLinear", [4, 4])]),
    "qkv 4-bit": (("in_proj_qkv",), [("GroupInt4Linear", [512]), ("Linear", None), ("FusedLinear", [4, 4])]),
    "plain": ((), [("FusedLinear", [512, 256, 4, 4])]),
}


def _plain(w: torch.Tensor):
    from models.architectures.layers import Linear
    lin = Linear(w.shape[1], w.shape[0], bias=False)
    lin.weight.data = w
    return lin


def _layers(device, dtype, quantized):
    """(the layer with `quantized` projections in 4-bit groups, the same layer on their dequantized
    weights, the states), both fused."""
    ref, states = delta_layer_and_states(device, dtype, nk=NK, nv=NV, dk=DK, dv=DV, olmo=False, fuse=False)
    mixed = copy.deepcopy(ref)
    for i, name in enumerate(quantized):
        lin = int4_linear(getattr(ref, name).out_features, 256, 128, i, device)
        setattr(mixed, name, lin)
        setattr(ref, name, _plain(lin.dequantize(torch.float64).to(device, dtype)))
    mixed.fuse()
    ref.fuse()
    bind_forms(mixed)  # (as a CUDA plan binds them: the quantized projections' CUDA forms)
    return mixed, ref, states


def _run(layer, states, x):
    """A 3-token prefill and two one-token steps from copies of the states."""
    st = {k: v.clone() for k, v in states.items()}
    with torch.inference_mode():
        return torch.cat([layer(x[:3], st), layer(x[3:4], st), layer(x[4:], st)]), st


@pytest.mark.parametrize("case", list(CASES))
def test_projections_group_by_format_and_compute_the_dequantized_layers_function(case):
    quantized, groups = CASES[case]
    mixed, ref, states = _layers(torch.device("cpu"), torch.float32, quantized)
    assert [(type(m).__name__, getattr(m, "sizes", None)) for m in mixed.in_projs] == groups
    assert not any(hasattr(mixed, n) for n in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"))
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(4))
    parts = mixed.projections(x)
    assert [p.shape[-1] for p in parts] == [512, 256, NV, NV]
    assert torch.equal(mixed.project_in(x), torch.cat(parts, dim=-1))
    got, st_got = _run(mixed, states, x)
    want, st_want = _run(ref, states, x)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    for k in st_want:
        torch.testing.assert_close(st_got[k], st_want[k], rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES))
def test_the_cuda_decode_step_runs_for_every_mix_of_formats(monkeypatch, case):
    """On CUDA in bf16: each one-token step goes through cuda_delta.decode on project_in's joined
    row, and gives the torch step's outputs and states (the kernel switched off by the ops' `fits`)."""
    from models.kernels.cuda import delta as cuda_delta
    from models.ops import serving
    device = torch.device("cuda")
    mixed, _, states = _layers(device, torch.bfloat16, CASES[case][0])
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(4)).to(device, torch.bfloat16)
    calls = []
    monkeypatch.setattr(cuda_delta, "decode", lambda *a, _real=cuda_delta.decode, **kw: (calls.append(1), _real(*a, **kw))[1])
    got, st_got = _run(mixed, states, x)
    assert len(calls) == 2  # the two one-token steps
    monkeypatch.setattr(serving, "fits", lambda *a, **k: False)
    want, st_want = _run(mixed, states, x)
    assert len(calls) == 2
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    for k in st_want:
        torch.testing.assert_close(st_got[k].float(), st_want[k].float(), rtol=2e-2, atol=2e-2)
