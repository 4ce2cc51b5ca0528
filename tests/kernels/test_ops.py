"""models/ops' contract on the CPU: each op looks its kernel up at call time (a benchmark's A/B or
a test's stand-in of the kernel function holds for the op too) and carries the kernel's name and
docstring; where no kernel serves a call (every CPU tensor), the predicates say so and the ops
that own a torch form give that form's bits."""
import torch
import torch.nn.functional as F

from models.kernels.cuda import attention as cuda_attention, moe as cuda_moe
from models.ops import attention, experts, linear, norm, serving


def test_an_op_calls_its_kernel_as_the_kernels_module_holds_it_now(monkeypatch):
    assert attention.decode.__name__ == "decode" and attention.decode.__doc__ == cuda_attention.decode.__doc__
    monkeypatch.setattr(cuda_attention, "decode", lambda *a, **k: ("stand-in", a, k))
    assert attention.decode(1, 2, positions=3) == ("stand-in", (1, 2), {"positions": 3})
    monkeypatch.setattr(cuda_moe, "route", lambda *a, **k: "routed")
    assert experts.route(None, 2, True, 8) == "routed"


def test_no_kernel_serves_cpu_rows():
    x = torch.randn(1, 64)
    assert not serving.serves(x.device, torch.bfloat16) and not serving.one_row(x) and not serving.rows(x)
    assert not attention.decode_serves(x, 64) and not attention.rope_serves(x, 64)
    assert not linear.gemv_serves(x, x.dtype) and not linear.head_gemv_serves(x, x.dtype)
    assert norm.add_rms_norm(x, torch.randn(1, 64), torch.ones(64), 1e-6, defer=True) is None


def test_the_ops_with_a_torch_form_give_its_bits_on_the_cpu():
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(3, 48, generator=g).to(dtype)
        w, b = torch.randn(40, 48, generator=g).to(dtype), torch.randn(40, generator=g).to(dtype)
        assert torch.equal(linear.dense(x, w, b), F.linear(x, w, b))
        assert torch.equal(linear.dense(x[:1], w, None), F.linear(x[:1], w))
        gu = torch.randn(3, 64, generator=g).to(dtype)
        gate, up = gu.chunk(2, dim=-1)
        assert torch.equal(linear.silu_mul(gu), F.silu(gate) * up)
        assert linear.as_tensor(x) is x and not linear.is_row(x)
