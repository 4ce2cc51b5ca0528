"""Tiny hybrid models and mixers for the tests of the CPU library's recurrent ops against their torch
forms: a Qwen3.5 / OLMo-Hybrid in GGUF blocks, a Gated DeltaNet layer with random states, a Granite
4.0-H Q8_0 file, and the checks that a model's decode is the same with an op and without it."""
from __future__ import annotations

import torch

import models


# what the C++ steps' tests feed: a prompt, then one token at a time
STEP_PROMPT, STEP_TOKENS = list(range(3, 40)), [5, 9, 200, 7, 7, 31, 4, 100]


def cpu_session(lm, kernel: str):
    """A CPU fp32 session over the loaded model with `cpu_kernel: kernel`."""
    from engine.session import DecodeSession
    return DecodeSession(lm.model, max_context=256, device=torch.device("cpu"), dtype=torch.float32,
                         cpu_kernel=kernel)


def steps_after_prompt(s) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(the logits of STEP_TOKENS' one-token steps after a prefill of STEP_PROMPT, the fixed states
    left behind)."""
    s.prefill(STEP_PROMPT)
    logits = torch.stack([s.step(t)[-1] for t in STEP_TOKENS])
    return logits, [t.clone() for t in s.state.fixed_tensors()]


def tiny(tmp_path, qtype=None, tiled=False, kind="qwen3_5", nope=False):
    """A tiny Qwen3.5 (3 DeltaNet layers around a gated attention one) or OLMo-Hybrid (`nope`: its
    attention without RoPE), its layers' linears as GGUF blocks of qtype (quantized by gguf-py)
    where given."""
    from gguf import quants

    from models.quant import layers as quant
    from tests.support.tiny import write_checkpoint
    d = tmp_path / kind
    if not d.exists():
        write_checkpoint(kind, str(d))
    lm = models.load(str(d))
    for layer in lm.model.model.layers:
        if nope and not layer.linear:
            layer.self_attn.rope = False
    if qtype is not None:
        for parent in list(lm.model.model.layers.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, torch.nn.Linear) and child.weight.shape[1] % 32 == 0:
                    raw = quants.quantize(child.weight.detach().numpy(), qtype)
                    setattr(parent, name, quant.BlockLinear(torch.from_numpy(raw), int(qtype),
                                                            getattr(child, "sizes", None)))
    for layer in lm.model.model.layers:
        if layer.linear:
            layer.linear_attn.out_tiled = tiled
    return lm


def delta_layer_and_states(device, dtype, nk=2, nv=2, dk=64, dv=128, olmo=True, fuse=True):
    """A GatedDeltaNet (hidden 256) with random weights and random states: as OLMo-Hybrid
    configures it (beta = 2 sigmoid(b), gated-norm eps 1e-5), or as Qwen3.5 does (olmo=False).
    tests/kernels/test_delta_split.py's kernel tests take it too. fuse False: the projections left
    apart (a test replaces some first: test_delta_projections.py)."""
    from models.architectures.qwen3_5 import GatedDeltaNet, HybridConfig
    cfg = HybridConfig(vocab_size=8, hidden_size=256, intermediate_size=8, layer_types=("linear_attention",),
                       num_heads=2, num_kv_heads=1, head_dim=16, rope_theta=1e4, rotary_dim=16, rms_eps=1e-6,
                       max_position=64, tie_embeddings=False, attention_bias=False, lin_k_heads=nk, lin_v_heads=nv,
                       lin_k_dim=dk, lin_v_dim=dv, conv_kernel=4,
                       **(dict(beta_scale=2.0, linear_norm_eps=1e-5) if olmo else {}))
    torch.manual_seed(0)
    layer = GatedDeltaNet(cfg)
    with torch.no_grad():
        layer.A_log.uniform_(0, 2)
        layer.norm.weight.uniform_(0.5, 1.5)
        for lin in (layer.in_proj_qkv, layer.in_proj_z, layer.in_proj_b, layer.in_proj_a, layer.out_proj):
            lin.weight.normal_(0, 0.05)
    layer = layer.to(device, dtype)
    layer.reset_buffers(device)
    if fuse:
        layer.fuse()
    states = {name: torch.randn(shape, device=device, dtype=dt or dtype) * 0.3
              for name, shape, dt in layer.state().tensors}
    return layer, states


def library_step_is_torch_step(layer, states: dict, x: torch.Tensor, op, written: str) -> None:
    """`layer` (a module whose `cpu_kernel` is `op` for one-token steps) over x's 7 rows, a 3-token
    prefill then four steps from `states`, with the op and with its torch form: equal prefills,
    the same outputs and states to fp32 summation order, the `written` state updated in place."""
    def run(kernel):
        layer.cpu_kernel = kernel
        st = {k: v.clone() for k, v in states.items()}
        with torch.inference_mode():
            outs = [layer(x[:3], st)] + [layer(x[i:i + 1], st) for i in range(3, 7)]
        return torch.cat(outs), st

    want, st_want = run(None)
    got, st_got = run(op)
    assert torch.equal(got[:3], want[:3])  # (the prefill stays the torch form)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    for k in st_want:
        torch.testing.assert_close(st_got[k], st_want[k], rtol=1e-4, atol=1e-5)
    assert not torch.equal(st_got[written], states[written])  # (the step wrote the state in place)


def q8_0_gguf(tmp_path, kind: str, options: tuple[str, ...] = (), **over):
    """A tiny checkpoint of `kind` as a Q8_0 GGUF (llama.cpp's converter, with `options`), loaded
    with its blocks kept; the file written once a tmp_path."""
    import models
    from tests.support.llama_cpp_tree import convert
    from tests.support.tiny import as_released
    from tests.support.tiny import hf_model, write_checkpoint
    path = tmp_path / f"{kind}.q8.gguf"
    if not path.exists():
        d = write_checkpoint(kind, str(tmp_path / f"{kind}-hf"), model=hf_model(kind, seed=3, **over))
        as_released(d, kind)
        convert(d, str(path), "q8_0", pre="gpt-2", options=options)
    return models.load(str(path), quantized=True)


def granite_q8_0(tmp_path, kind: str = "granitemoehybrid", **over):
    """A tiny Granite 4.0-H checkpoint of `kind` as a Q8_0 GGUF, loaded with its blocks kept."""
    return q8_0_gguf(tmp_path, kind, **over)


def decode_logits_with_op(lm, cls, op, on: bool) -> torch.Tensor:
    """A CPU session's one-token forwards of the torch model after an 8-token prefill, the
    library's per-linear kernels on the model's blocks (as the torch step takes them where no whole
    C++ step serves): the `cls` modules through their library `op`, or (off) their torch form."""
    from engine.session import DecodeSession
    from models.kernels.cpu import step as cpu_step
    from tests.support.parity import rand_ids
    modules = [m for m in lm.model.modules() if isinstance(m, cls)]
    ids = rand_ids(12, 7)
    s = DecodeSession(lm.model, max_context=64, device=torch.device("cpu"), dtype=torch.float32)
    cpu_step.attach_block_kernels(lm.model, norms=True)
    assert modules and all(m.cpu_kernel is op for m in modules)
    if not on:
        for m in modules:
            m.cpu_kernel = None
    s.prefill(ids[:8])
    return torch.stack([s.prefill([t], all_logits=True)[-1] for t in ids[8:]])
