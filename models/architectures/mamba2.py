"""Mamba2 (state-space duality, SSD): the scan in three forms sharing one state layout, and the mixer.

Shapes (one sequence): x [T, H, P] (H heads of P channels); dt [T, H] the step (softplus and clamp
already applied), fp32; A [H] < 0 the per-head scalar decay rate, fp32; B, C [T, G, N] (G groups,
each serving H/G consecutive heads); D [H] the skip; state [H, P, N] fp32, read as the initial
state and overwritten in place with the final one. Per step, for each head h of group g:
    S <- exp(dt A) S + (dt x) B^T;   y = S C + D x.        Output y [T, H, P] fp32.
`naive` is the oracle (one token at a time), `chunked` the prefill (SSD: quadratic inside chunks,
a scan across them), `step` the decode update (T == 1, in place, no shape-dependent control flow).

`Mamba2Mixer` is the layer of Mamba2 hybrids (Nemotron-H, Granite 4.0-H): in_proj → z, xBC, dt; a
depthwise causal conv1d (with bias) + SiLU over xBC whose last K-1 inputs are the **conv** state;
the scan above over the **ssm** state; RMSNorm over groups of y * SiLU(z) (the gate before the
norm); out_proj. Parameter names are the checkpoints' (in_proj, conv1d, dt_bias, A_log, D, norm,
out_proj). A multi-token forward on an existing state continues from it (the conv window is
prepended, the ssm state is the scan's initial state). On CUDA in half precision the one-token
step runs the Triton kernels of kernels/cuda/ssd.py (conv, scan step, gated norm) and prefill's
scan across chunks its fused scan; these torch forms are their oracles and run everywhere else.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..ops import recurrent as recurrent_ops, serving
from .causal_conv import conv_prefill, conv_step
from .layers import Linear, scaled_linear
from .state_spec import FixedState

# Test-only switch: the chunked prefill or the naive recurrent oracle for multi-token forwards.
PREFILL_FORM = "chunked"


def example_inputs(T: int, H: int, P: int, N: int, G: int, device="cpu", seed: int = 6) -> tuple[torch.Tensor, ...]:
    """Random (x, dt, A, B, C, D, state) in the ranges a layer produces (steps in (0, 0.5], decay
    rates in [-4, -0.1], a non-zero state): for tests and benchmarks."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(T, H, P, device=device, generator=gen)
    dt = torch.rand(T, H, device=device, generator=gen) * 0.5 + 1e-3
    A = -(torch.rand(H, device=device, generator=gen) * 3.9 + 0.1)
    B = torch.randn(T, G, N, device=device, generator=gen)
    C = torch.randn(T, G, N, device=device, generator=gen)
    D = torch.randn(H, device=device, generator=gen)
    state = torch.randn(H, P, N, device=device, generator=gen) * 0.1
    return x, dt, A, B, C, D, state


def _per_head(t: torch.Tensor, H: int) -> torch.Tensor:
    """[T, G, N] → [T, H, N]: each group's rows serve H/G consecutive heads."""
    return t.repeat_interleave(H // t.shape[1], dim=1)


def naive(x, dt, A, B, C, D, state: torch.Tensor) -> torch.Tensor:
    """The oracle: one token at a time, exactly the rule above."""
    T, H, _ = x.shape
    x, dt, B, C = x.float(), dt.float(), _per_head(B.float(), H), _per_head(C.float(), H)
    S = state.clone()
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    for t in range(T):
        S = S * (dt[t] * A).exp()[:, None, None] + (dt[t][:, None] * x[t])[:, :, None] * B[t][:, None, :]
        out[t] = torch.einsum("hpn,hn->hp", S, C[t]) + D[:, None] * x[t]
    state.copy_(S)
    return out


def step(x, dt, A, B, C, D, state: torch.Tensor) -> torch.Tensor:
    """T == 1, vectorised, in place (the decode path; graph-safe). Returns [1, H, P] fp32."""
    H, P, N = state.shape
    G = B.shape[1]
    x, dt, B, C = x[0].float(), dt[0].float(), B[0].float(), C[0].float()
    state.mul_((dt * A).exp()[:, None, None])
    grouped = state.view(G, (H // G) * P, N)                       # heads of a group share B and C
    grouped.baddbmm_((dt[:, None] * x).reshape(G, -1, 1), B[:, None, :])   # S += (dt x) B^T
    y = torch.bmm(grouped, C[:, :, None]).view(H, P)                # S C
    return (y + D[:, None] * x)[None]


def chunked(x, dt, A, B, C, D, state: torch.Tensor, chunk: int = 64, fused: bool = False) -> torch.Tensor:
    """Prefill: inside each chunk the output is a masked quadratic form (C_l B_s^T weighted by the
    decay from s to l); across chunks the state is carried by a scan of `T / chunk` steps.
    `fused`: the scan as one Triton kernel (recurrent_ops.ssd_chunk_scan, CUDA) instead of the loop."""
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    x32 = x.float()
    a = dt.float() * A                                                  # [T, H] log-decay, <= 0
    xdt = x32 * dt.float()[..., None]
    B, C = B.float(), C.float()
    pad = (chunk - T % chunk) % chunk
    if pad:  # zero steps: decay exp(0) = 1 and no input leave the state untouched
        xdt, B, C = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (xdt, B, C))
        a = F.pad(a, (0, 0, 0, pad))
    n = (T + pad) // chunk
    a = a.t().reshape(H, n, chunk)
    xdt = xdt.permute(1, 0, 2).reshape(H, n, chunk, P)
    Bg, Cg = (t.permute(1, 0, 2).reshape(G, n, chunk, N) for t in (B, C))
    rep = H // G

    cum = a.cumsum(-1)                                                  # [H, n, c]
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=x.device).triu(1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()   # [H, n, c, c]
    scores = (Cg @ Bg.transpose(-1, -2)).repeat_interleave(rep, dim=0)   # C_l . B_s, per head
    out = (scores * decay) @ xdt                                        # within the chunk
    Bh, Ch = Bg.repeat_interleave(rep, dim=0), Cg.repeat_interleave(rep, dim=0)   # [H, n, c, N]
    # each chunk's own contribution to the state at its end, and the decay of C's reads of the state
    chunk_states = xdt.transpose(-1, -2) @ (Bh * (cum[..., -1:] - cum).exp()[..., None])   # [H, n, P, N]
    C_dec = Ch * cum.exp()[..., None]
    chunk_decay = cum[..., -1].exp()                                    # [H, n]
    if fused and recurrent_ops.ssd_scan_fits(chunk, P, N):
        recurrent_ops.ssd_chunk_scan(out, C_dec, chunk_states, chunk_decay, state)
    else:
        S = state.clone()
        for i in range(n):
            out[:, i] += C_dec[:, i] @ S.transpose(-1, -2)              # [H, c, P]
            S = S * chunk_decay[:, i, None, None] + chunk_states[:, i]
        state.copy_(S)
    y = out.reshape(H, n * chunk, P)[:, :T].transpose(0, 1)
    return y + D[:, None] * x32


class GroupedGatedRMSNorm(nn.Module):
    """RMSNorm(y * SiLU(z)) over groups of the channels, times the weight (the gate before the
    norm, as Mamba2's `norm_before_gate=False`); computed in fp32."""

    def __init__(self, dim: int, groups: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.groups, self.eps = groups, eps

    def forward(self, y: torch.Tensor, z: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        T, dim = y.shape
        g = (y.float() * F.silu(z.float())).view(T, self.groups, dim // self.groups)
        g = F.rms_norm(g, (dim // self.groups,), eps=self.eps).view(T, dim)
        return (g * self.weight.float()).to(out_dtype)


class Mamba2Mixer(nn.Module):
    cpu_kernel = None  # the C++ library's mamba2_decode for one token on the CPU (kernels.cpu_block_kernels)
    cpu_kernel_name = "mamba2_decode"

    def __init__(self, hidden: int, n_heads: int, head_dim: int, state_size: int, n_groups: int, conv_kernel: int,
                 eps: float, conv_bias: bool = True, proj_bias: bool = False,
                 dt_limit: tuple[float, float] = (0.0, float("inf")), chunk: int = 64):
        super().__init__()
        self.H, self.P, self.N, self.G, self.K = n_heads, head_dim, state_size, n_groups, conv_kernel
        self.inner = n_heads * head_dim
        self.conv_dim = self.inner + 2 * n_groups * state_size
        self.dt_limit, self.chunk = dt_limit, chunk
        self.in_proj = Linear(hidden, self.inner + self.conv_dim + n_heads, bias=proj_bias)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim, bias=conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(n_heads))
        self.A_log = nn.Parameter(torch.zeros(n_heads))
        self.D = nn.Parameter(torch.ones(n_heads))
        self.norm = GroupedGatedRMSNorm(self.inner, n_groups, eps)
        self.out_proj = Linear(self.inner, hidden, bias=proj_bias)

    def reset_buffers(self, device) -> None:
        """After loading: the decay rate A = -exp(A_log), dt_bias and D in fp32, once."""
        self.register_buffer("A", -self.A_log.detach().float().exp(), persistent=False)
        self.register_buffer("dt_bias32", self.dt_bias.detach().float(), persistent=False)
        self.register_buffer("D32", self.D.detach().float(), persistent=False)

    def state(self) -> FixedState:
        return FixedState((("conv", (self.conv_dim, self.K - 1), None),
                           ("ssm", (self.H, self.P, self.N), torch.float32)))

    def forward(self, h: torch.Tensor, st: dict[str, torch.Tensor], out_scale: float = 1.0) -> torch.Tensor:
        """out_scale: the output times it (layers.scaled_linear: in the out projection's GEMV)."""
        zxbcdt = self.in_proj(h)
        T, dtype = zxbcdt.shape[0], zxbcdt.dtype
        if serving.one_row(zxbcdt) and recurrent_ops.ssd_step_fits(self.P, self.N):
            # the conv, the scan step and the gated norm in three kernels
            out = recurrent_ops.ssd_step(zxbcdt.contiguous(), st["conv"], self.conv1d.weight, self.conv1d.bias, st["ssm"],
                                  self.A, self.dt_bias32, self.D32, self.norm.weight, self.norm.eps, self.dt_limit,
                                  self.H, self.P, self.N, self.G)
            return scaled_linear(self.out_proj, out, out_scale)
        if self.cpu_kernel is not None and T == 1 and not zxbcdt.is_cuda and dtype == torch.float32:
            # the conv, the scan step and the gated norm in one library call
            bias = self.conv1d.bias.detach() if self.conv1d.bias is not None else None
            out = self.cpu_kernel(zxbcdt, st["conv"], self.conv1d.weight.detach(), bias, st["ssm"], self.A,
                                  self.dt_bias32, self.D32, self.norm.weight.detach(), self.norm.eps,
                                  *self.dt_limit, self.H, self.P, self.N, self.G)
            return scaled_linear(self.out_proj, out, out_scale)
        z, xBC, dt = zxbcdt.split([self.inner, self.conv_dim, self.H], dim=-1)
        conv_state = st["conv"]
        if recurrent_ops.conv_serves(xBC, self.conv1d.weight):  # one kernel, read where the projection left it
            xBC = recurrent_ops.causal_conv(xBC, conv_state, self.conv1d.weight, self.conv1d.bias, silu=True)
        else:  # continues the stream
            xBC = F.silu((conv_step if T == 1 else conv_prefill)(xBC, conv_state, self.conv1d.weight[:, 0],
                                                                 self.conv1d.bias))
        x, B, C = xBC.split([self.inner, self.G * self.N, self.G * self.N], dim=-1)
        x = x.reshape(T, self.H, self.P)
        B, C = B.reshape(T, self.G, self.N), C.reshape(T, self.G, self.N)
        dt = F.softplus(dt.float() + self.dt_bias32).clamp(*self.dt_limit)
        ssm = st["ssm"]
        if T == 1:
            y = step(x, dt, self.A, B, C, self.D32, ssm)
        elif PREFILL_FORM == "chunked":
            y = chunked(x, dt, self.A, B, C, self.D32, ssm, self.chunk, fused=serving.rows(zxbcdt))
        else:
            y = naive(x, dt, self.A, B, C, self.D32, ssm)
        return scaled_linear(self.out_proj, self.norm(y.reshape(T, self.inner), z, dtype), out_scale)
