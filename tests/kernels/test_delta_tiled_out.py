"""A qwen35 GGUF's Gated DeltaNet out_proj kept in its blocks reads its value heads in llama.cpp's
tiled order (head kh r + j at slot j nk + kh): GatedDeltaNet.out_tiled feeds it that way, on the
torch path (project_out) and in the CUDA decode step's kernel (cuda_delta.decode(tiled=True)
writes each head, and its int8 words, at its slot). Without the reorder the layer computes
another function: the layer test checks that it differs from the grouped weights' layer.

Kernel tests on CUDA (`gpu`) and under Triton's interpreter (TRITON_INTERPRET=1)."""
import copy

import pytest
import torch

from tests.support.hybrid import delta_layer_and_states


def _tiled_columns(w: torch.Tensor, nk: int, nv: int, dv: int) -> torch.Tensor:
    """out_proj's weight [H, nv dv] (HF's grouped columns) with its columns in the tiled order."""
    r = nv // nk
    return w.view(w.shape[0], nk, r, dv).transpose(1, 2).reshape(w.shape)


@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("int8_out", [False, True])
def test_the_decode_kernel_writes_each_head_at_its_tiled_slot(device, split, int8_out):
    from models.kernels.cuda import delta as cuda_delta, qruns
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    nk, nv, dk, dv = 2, 6, 64, 128
    layer, states = delta_layer_and_states(device, dtype, nk=nk, nv=nv, dk=dk, dv=dv, olmo=False)
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(7)).to(device, dtype)
    sync = cuda_delta.counters(nv, device) if split else None
    outs = []
    for tiled in (False, True):
        st = {k: v.clone() for k, v in states.items()}
        with torch.inference_mode():
            out = cuda_delta.decode(layer.project_in(x.clone()), st["conv"], layer.conv1d.weight, st["recurrent"],
                                    layer.neg_A, layer.dt_bias32, layer.norm.weight, layer.norm.eps, nk, nv, dk, dv,
                                    sync=sync, int8_out=int8_out, tiled=tiled)
        outs.append((out, st))
    (grouped, st0), (tiled_row, st1) = outs
    if int8_out:
        from models.kernels.cuda.linear import NormedRow
        assert isinstance(tiled_row, NormedRow) and isinstance(grouped, NormedRow)
        words = tiled_row.forms[qruns.INT8_RUNS]
        grouped, tiled_row = grouped._h, tiled_row._h
        assert torch.equal(words, qruns.quantize_input(tiled_row))
    expect = grouped.view(1, nk, nv // nk, dv).transpose(1, 2).reshape(1, nv * dv)
    assert torch.equal(tiled_row, expect) and not torch.equal(tiled_row, grouped)
    assert all(torch.equal(st0[k], st1[k]) for k in st0)
    if split:
        assert int(sync.abs().sum()) == 0


def test_a_tiled_out_proj_layer_computes_the_grouped_layers_function():
    """The torch path (prefill and CPU decode): the layer with out_tiled and out_proj's columns
    tiled equals the grouped layer; with out_tiled off the same weights give other outputs."""
    nk, nv, dk, dv = 2, 6, 32, 32
    ref, states = delta_layer_and_states(torch.device("cpu"), torch.float32, nk=nk, nv=nv, dk=dk, dv=dv, olmo=False)
    tiled = copy.deepcopy(ref)
    with torch.no_grad():
        tiled.out_proj.weight.copy_(_tiled_columns(ref.out_proj.weight, nk, nv, dv))
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(3))
    results = {}
    for name, layer, flag in (("ref", ref, False), ("tiled", tiled, True), ("unflagged", tiled, False)):
        layer.out_tiled = flag
        st = {k: v.clone() for k, v in states.items()}
        with torch.no_grad():  # a prefill, then two one-token steps
            results[name] = torch.cat([layer(x[:3], st), layer(x[3:4], st), layer(x[4:], st)])
    torch.testing.assert_close(results["tiled"], results["ref"], rtol=1e-5, atol=1e-5)
    assert (results["unflagged"] - results["ref"]).abs().max() > 1e-3
