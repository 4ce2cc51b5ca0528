"""The Gated DeltaNet decode step's kernels (models/kernels/cuda/delta.py) against the layer's torch
form over several tokens (outputs, conv window, recurrent state), and with a head's value columns
split over programs (_delta_step_kernel with BV < DV): against the one-program-a-head kernel and
the layer's torch form, the counters left at zero, the same bits on every run.

On CUDA (gpu-marked) and under Triton's interpreter (TRITON_INTERPRET=1), where the programs run
one after another: the last column block of each head then finishes it.
"""
import os

import pytest
import torch

from tests.support.hybrid import delta_layer_and_states
from models import kernels


def _steps(layer, states, xs, sync):
    """decode() over the tokens xs from copies of the states: (outputs, states after). Each token
    starts with a torch op (x's copy), launched without PDL, as a model's step starts with its
    embedding: the delta step reads its state before its PDL wait (delta.py), so with only PDL
    launches between two steps it could read the state before the step before had written it."""
    from models.kernels.cuda import delta as cuda_delta
    st = {k: v.clone() for k, v in states.items()}
    with torch.inference_mode():
        outs = [cuda_delta.decode(layer.project_in(x.clone()), st["conv"], layer.conv1d.weight, st["recurrent"],
                                  layer.neg_A, layer.dt_bias32, layer.norm.weight, layer.norm.eps, layer.nk, layer.nv,
                                  layer.dk, layer.dv, beta_scale=layer.beta_scale, sync=sync) for x in xs]
    return outs, st


def check_split(device, dtype, bv, warps, monkeypatch, out_tol, state_tol):
    from models.kernels.cuda import base as cuda_base, delta as cuda_delta
    layer, states = delta_layer_and_states(device, dtype, nk=2, nv=6, dk=64, dv=128, olmo=False)
    xs = torch.randn(4, 1, 256, device=device, dtype=dtype, generator=torch.Generator(device=device).manual_seed(5))
    launched = []
    real_launch = cuda_base.launch

    def counting(kernel, grid, *args, **kwargs):
        launched.append((kernel, grid))
        return real_launch(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(cuda_delta, "launch", counting)
    monkeypatch.setattr(cuda_delta, "SPLIT_CONFIG", (bv, warps))
    sync = cuda_delta.counters(layer.nv, device)
    split, st_s = _steps(layer, states, xs, sync)
    assert (cuda_delta._delta_step_kernel, (6, 128 // bv)) in launched  # the split form ran (not vacuous)
    assert int(sync.abs().sum()) == 0  # every launch left its counters at zero
    again, st_again = _steps(layer, states, xs, sync)
    assert all(torch.equal(a, b) for a, b in zip(split, again))  # the same bits, whatever the arrival order
    assert torch.equal(st_s["recurrent"], st_again["recurrent"])
    one, st_o = _steps(layer, states, xs, None)
    assert (cuda_delta._delta_step_kernel, (6, 1)) in launched
    for a, b in zip(split, one):
        assert (a.float() - b.float()).abs().max() <= out_tol * (1 + b.float().abs().max()), \
            float((a.float() - b.float()).abs().max())
    assert torch.equal(st_s["conv"], st_o["conv"])
    assert (st_s["recurrent"] - st_o["recurrent"]).abs().max() <= state_tol
    kernels.switch(triton=False)  # and the layer's torch form: its gated norm's output
    st_t = {k: v.clone() for k, v in states.items()}
    for a, x in zip(split, xs):
        b = _gated_norm_output(layer, x, st_t).float().reshape(a.shape)
        assert (a.float() - b).abs().max() <= 4 * out_tol * (1 + b.abs().max()), float((a.float() - b).abs().max())


def _gated_norm_output(layer, x, st):
    """The layer's torch form run on x (st updated), returning its gated norm's output."""
    seen = {}
    handle = layer.norm.register_forward_hook(lambda m, args, out: seen.setdefault("out", out))
    try:
        with torch.inference_mode():
            layer(x, st)
    finally:
        handle.remove()
    return seen["out"]


@pytest.mark.gpu
@pytest.mark.parametrize("bv,warps", [(16, 2), (32, 4), (64, 4)])
def test_delta_split_matches_one_program_a_head(bv, warps, monkeypatch):
    from models.kernels.cuda import base as cuda_base
    if not cuda_base.ENABLED:
        pytest.skip("Triton is not installed here")
    check_split(torch.device("cuda"), torch.bfloat16, bv, warps, monkeypatch, out_tol=2e-2, state_tol=1e-4)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="set TRITON_INTERPRET=1 (Triton's interpreter)")
@pytest.mark.parametrize("bv", [32, 64])
def test_delta_split_matches_one_program_a_head_under_the_interpreter(bv, monkeypatch):
    pytest.importorskip("triton")
    check_split(torch.device("cpu"), torch.float32, bv, 4, monkeypatch, out_tol=1e-5, state_tol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("nk,nv", [(2, 2), (2, 6)])
def test_gated_delta_decode_kernels_match_the_torch_layer(nk, nv, monkeypatch):
    """The two-kernel DeltaNet step against GatedDeltaNet's torch form, over several tokens from
    the same states: outputs, the conv window and the fp32 recurrent state."""
    from models.kernels.cuda import base as cuda_base
    from tests.support.hybrid import delta_layer_and_states
    if not cuda_base.ENABLED:
        pytest.skip("Triton is not installed here")
    dev, bf = torch.device("cuda"), torch.bfloat16
    layer, states = delta_layer_and_states(dev, bf, nk=nk, nv=nv, dk=128, dv=64, olmo=False)
    xs = torch.randn(5, 1, 256, device=dev, dtype=bf)

    def run():
        st = {k: v.clone() for k, v in states.items()}
        with torch.inference_mode():
            return [layer(x, st).float() for x in xs], st

    fused, st_f = run()
    kernels.switch(triton=False)
    plain, st_p = run()
    for a, b in zip(fused, plain):
        assert torch.allclose(a, b, atol=2e-2, rtol=3e-2), float((a - b).abs().max())
    assert torch.equal(st_f["conv"], st_p["conv"])
    assert torch.allclose(st_f["recurrent"], st_p["recurrent"], atol=1e-2, rtol=1e-2)
