"""Hybrid LinearAttention models: Qwen3.5 (dense MLP), Qwen3-Next and Qwen3.5-MoE (the MoE MLP of
moe.py with a shared expert; Qwen3.5-MoE has it in every layer and no dense MLP size).

`layer_types` interleaves Gated DeltaNet layers (fixed conv + recurrent state) with gated full
attention (GQA, per-head zero-centred q/k norm, partial RoPE, a sigmoid output gate from a doubled
q projection). The model declares each layer's state; the engine's StateManager owns it. A
multi-token forward on an existing state continues from it: the conv window is prepended and the
recurrent state is the chunked scan's initial state. Qwen3-Next's fused in_proj_qkvz / in_proj_ba
are split into the Qwen3.5 layout once, in `checkpoint_names` (the one place renames live).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from . import gated_delta
from ..ops import attention as attention_ops, linear as linear_ops, recurrent as recurrent_ops, serving
from ..sharding import Plan, Split, divisible, expert_splits
from .causal_conv import conv_prefill, conv_step
from .causal_lm import Body, CausalLM
from . import moe
from .moe import SparseMoe, num_experts, stack_experts
from ..formats.checkpoints import MTP_LOADED
from .mtp import MtpHead
from .layers import (Linear, QKVProjections, Residual, RMSNorm, Rope, SwiGLU, add_norm, attend_cached,
                     cached_attention, fuse_linears)
from .state_spec import AttentionState, FixedState, StateView

# Test-only switch: the chunked prefill or the naive recurrent oracle for multi-token forwards.
PREFILL_FORM = "chunked"
# Whether a CUDA prefill normalises q and k, computes g and beta (inside recurrent_ops.scan_prepare_raw)
# and the gated output norm (recurrent_ops.gated_norm) in the fused kernels, not in torch
# (bench/ab_prefill.py's noraw variants)
FUSED_PROLOGUE = True


@dataclass(frozen=True)
class HybridConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    layer_types: tuple[str, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rotary_dim: int
    rms_eps: float
    max_position: int
    tie_embeddings: bool
    attention_bias: bool
    lin_k_heads: int
    lin_v_heads: int
    lin_k_dim: int
    lin_v_dim: int
    conv_kernel: int
    # MoE (Qwen3-Next, Qwen3.5-MoE); num_experts 0 = dense MLP everywhere
    num_experts: int = 0
    experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: tuple[bool, ...] = ()
    # OLMo-Hybrid's DeltaNet (olmo_hybrid.py): beta = 2 sigmoid(b) (negative eigenvalues allowed)
    # and its own gated-norm epsilon; None = rms_eps
    beta_scale: float = 1.0
    linear_norm_eps: float | None = None
    # out_proj's columns in llama.cpp's tiled value-head order (a qwen35 GGUF's blocks, which
    # cannot be reordered: checkpoints._gguf_values); the layer then writes its heads that way
    linear_out_tiled: bool = False
    # the multi-token-prediction layer (mtp.py): 1 where models.loader.count_mtp_layers found one
    # to load (only the first is read, as llama.cpp reads one)
    mtp_layers: int = 0

    @classmethod
    def from_hf(cls, c: dict, moe: bool = False) -> "HybridConfig":
        rope = c.get("rope_parameters") or {}
        head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        factor = rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 0.25))
        n = c["num_hidden_layers"]
        types = c.get("layer_types") or ["full_attention" if (i + 1) % c.get("full_attention_interval", 4) == 0
                                         else "linear_attention" for i in range(n)]
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"rope_type {rope.get('rope_type')!r} (only default RoPE is supported here)")
        moe_layers = ()
        if moe and num_experts(c) > 0:
            step, only = c.get("decoder_sparse_step", 1), set(c.get("mlp_only_layers") or [])
            moe_layers = tuple(i not in only and (i + 1) % step == 0 for i in range(n))
        return cls(
            vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
            # every layer routing (Qwen3.5-MoE), the config need not name a dense MLP size
            intermediate_size=(c.get("intermediate_size", 0) if moe_layers and all(moe_layers)
                               else c["intermediate_size"]),
            layer_types=tuple(types), num_heads=c["num_attention_heads"], num_kv_heads=c["num_key_value_heads"],
            head_dim=head_dim, rope_theta=float(rope.get("rope_theta", c.get("rope_theta", 10000.0))),
            rotary_dim=int(head_dim * factor), rms_eps=float(c.get("rms_norm_eps", 1e-6)),
            max_position=int(c.get("max_position_embeddings", 32768)),
            tie_embeddings=bool(c.get("tie_word_embeddings", False)),
            attention_bias=bool(c.get("attention_bias", False)),
            lin_k_heads=c["linear_num_key_heads"], lin_v_heads=c["linear_num_value_heads"],
            lin_k_dim=c["linear_key_head_dim"], lin_v_dim=c["linear_value_head_dim"],
            conv_kernel=c.get("linear_conv_kernel_dim", 4),
            num_experts=num_experts(c) if moe else 0, experts_per_tok=c.get("num_experts_per_tok", 0),
            moe_intermediate_size=c.get("moe_intermediate_size", 0),
            shared_expert_intermediate_size=c.get("shared_expert_intermediate_size", 0),
            norm_topk_prob=bool(c.get("norm_topk_prob", True)), moe_layers=moe_layers,
            linear_out_tiled=bool(c.get("linear_out_proj_tiled", False)),
            # (models.loader.count_mtp_layers: only where an exact verify serves its drafts)
            mtp_layers=min(1, int(c.get(MTP_LOADED, 0))))


class GatedRMSNorm(nn.Module):
    """RMSNorm(x) * w * SiLU(z): the DeltaNet output norm (its weight is not zero-centred)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    cpu_kernel = None  # as RMSNorm's
    cpu_kernel_name = "rms_norm_rows"

    def forward(self, x, z):
        if self.cpu_kernel is not None and x.dtype == self.weight.dtype == torch.float32 \
                and x.shape[0] <= RMSNorm.KERNEL_ROWS and not x.is_cuda:
            return self.cpu_kernel(x, self.weight, self.eps) * F.silu(z)
        # the fused norm accumulates in fp32 and applies the weight (one kernel, not seven)
        return F.rms_norm(x.to(self.weight.dtype), (x.shape[-1],), self.weight, self.eps) * F.silu(z)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x * rsqrt(sum(x^2) + eps): the reference form (tests compare the fused form with it)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def l2norm_scaled(x: torch.Tensor, scale: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """l2norm(x) * scale as one fused RMSNorm: rsqrt(sum/d + eps/d) = sqrt(d) * rsqrt(sum + eps),
    so rms_norm(x, eps/d) with a constant weight scale/sqrt(d) is exactly that."""
    d = x.shape[-1]
    return F.rms_norm(x, (d,), scale, eps / d)


class GatedDeltaNet(nn.Module):
    cpu_kernel = None  # the C++ library's delta_decode for one token on the CPU (kernels.cpu_block_kernels)
    cpu_kernel_name = "delta_decode"

    def __init__(self, cfg: HybridConfig):
        super().__init__()
        self.nk, self.nv, self.dk, self.dv = cfg.lin_k_heads, cfg.lin_v_heads, cfg.lin_k_dim, cfg.lin_v_dim
        self.key_dim, self.value_dim = self.nk * self.dk, self.nv * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = cfg.conv_kernel
        h = cfg.hidden_size
        self.in_proj_qkv = Linear(h, self.conv_dim, bias=False)
        self.in_proj_z = Linear(h, self.value_dim, bias=False)
        self.in_proj_b = Linear(h, self.nv, bias=False)
        self.in_proj_a = Linear(h, self.nv, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.nv))
        self.A_log = nn.Parameter(torch.zeros(self.nv))
        self.norm = GatedRMSNorm(self.dv, cfg.rms_eps if cfg.linear_norm_eps is None else cfg.linear_norm_eps)
        self.beta_scale = cfg.beta_scale
        self.out_proj = Linear(self.value_dim, h, bias=False)
        # value head h = key head kh's j-th (h = kh r + j) feeds out_proj's slot j nk + kh
        self.out_tiled = cfg.linear_out_tiled and self.nk != self.nv

    def project_out(self, out: torch.Tensor) -> torch.Tensor:
        """out_proj of the normed, gated output [T, value_dim] in HF's grouped head order (with
        `out_tiled`, its heads reordered to the tiled order out_proj's columns are in)."""
        if self.out_tiled:  # (one copy of T x value_dim values: small beside out_proj's read of its weights)
            T = out.shape[0]
            out = out.view(T, self.nk, self.nv // self.nk, self.dv).transpose(1, 2).reshape(T, self.value_dim)
        return self.out_proj(out)

    def reset_buffers(self, device) -> None:
        """After loading: the decay rate -exp(A_log) and dt_bias in fp32, the constant weights
        of the fused q/k l2 norms (q also takes the 1/sqrt(dk) attention scale), and the decode
        step's counters."""
        self.register_buffer("neg_A", -self.A_log.detach().float().exp(), persistent=False)
        self.register_buffer("dt_bias32", self.dt_bias.detach().float(), persistent=False)
        d = self.dk
        self.register_buffer("q_norm_w", torch.full((d,), 1.0 / d, device=device), persistent=False)
        self.register_buffer("k_norm_w", torch.full((d,), d ** -0.5, device=device), persistent=False)
        # the counters through which the CUDA decode step's programs of a head meet (recurrent_ops.delta_step)
        self.register_buffer("delta_sync", recurrent_ops.delta_counters(self.nv, device), persistent=False)

    def state(self) -> FixedState:
        return FixedState((("conv", (self.conv_dim, self.kernel - 1), None),
                           ("recurrent", (self.nv, self.dk, self.dv), torch.float32)))

    def fuse(self) -> None:
        """After loading: the four input projections in as few matmuls as their storage allows:
        one where all four share a format; else qkv with z and b with a, each pair one matmul
        where its two do (a quantized file stores them apart: llama.cpp's Q4_K_M gives attn_qkv
        Q6_K in some layers and attn_gate Q4_K, GPTQ checkpoints leave b and a in bf16). `in_projs`
        holds the groups in qkv, z, b, a order; project_in joins their outputs. Once: a second
        call leaves them as they are."""
        if hasattr(self, "in_projs"):
            return
        parts = [self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a]
        fused = fuse_linears(parts)
        if fused is not None:
            groups = [fused]
        else:
            groups = []
            for pair in (parts[:2], parts[2:]):
                joined = fuse_linears(pair)
                groups += [joined] if joined is not None else pair
        self.in_projs = nn.ModuleList(groups)
        del self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a

    def project_in(self, x) -> torch.Tensor:
        """[T, conv_dim + value_dim + 2 nv]: qkv, z, b and a side by side, as the CUDA decode
        step's kernel reads them (several groups: their outputs joined, one small copy)."""
        if not hasattr(self, "in_projs"):
            return torch.cat([self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)], dim=-1)
        outs = [m(x) for m in self.in_projs]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)

    def projections(self, x) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(qkv, z, b, a) of x: the groups' outputs split where a group holds several (no copy)."""
        if not hasattr(self, "in_projs"):
            return self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)
        return tuple(y for m in self.in_projs for y in (m.split(x) if hasattr(m, "split") else (m(x),)))

    def forward(self, x: torch.Tensor, st: dict[str, torch.Tensor]) -> torch.Tensor:
        T = x.shape[0]
        if serving.one_row(x) and serving.fits(self.dk, self.dv):
            # the conv, the delta rule and the gated norm in two kernels
            out = recurrent_ops.delta_step(self.project_in(x), st["conv"], self.conv1d.weight, st["recurrent"],
                                           self.neg_A, self.dt_bias32, self.norm.weight, self.norm.eps, self.nk,
                                           self.nv, self.dk, self.dv, beta_scale=self.beta_scale, sync=self.delta_sync,
                                           int8_out=linear_ops.reads_int8(self.out_proj, x.dtype, "delta"),
                                           tiled=self.out_tiled)
            return self.out_proj(out)  # already in out_proj's head order
        mixed, z, b, a = self.projections(x)
        if self.cpu_kernel is not None and T == 1 and not x.is_cuda and x.dtype == torch.float32:
            # the torch form below for one token, in one library call (models/kernels/cpu/delta_step.h)
            return self.project_out(self.cpu_kernel(
                mixed, z, b, a, st["conv"], self.conv1d.weight, st["recurrent"], self.neg_A, self.dt_bias32,
                self.q_norm_w, self.k_norm_w, self.norm.weight, self.norm.eps, self.nk, self.nv, self.dk, self.dv,
                self.beta_scale))
        conv_state = st["conv"]
        if recurrent_ops.conv_serves(mixed, self.conv1d.weight):  # one kernel, read where the projection left it
            mixed = recurrent_ops.causal_conv(mixed, conv_state, self.conv1d.weight, silu=True)
        else:  # continues the stream
            mixed = F.silu((conv_step if T == 1 else conv_prefill)(mixed, conv_state, self.conv1d.weight[:, 0], None))
        if T > 1 and FUSED_PROLOGUE and PREFILL_FORM == "chunked" and serving.rows(x) \
                and recurrent_ops.scan_fits(64, self.dk, self.dv):
            # the l2 norms, g and beta inside the chunks' first kernel, the gated norm in one more
            # (where the torch form below runs ~12 elementwise kernels)
            kd = self.key_dim
            q, k = mixed[:, :kd].unflatten(1, (self.nk, self.dk)), mixed[:, kd:2 * kd].unflatten(1, (self.nk, self.dk))
            out = gated_delta.chunked_raw(q, k, mixed[:, 2 * kd:].unflatten(1, (self.nv, self.dv)), a, b, self.neg_A,
                                          self.dt_bias32, self.beta_scale, st["recurrent"])
            return self.project_out(recurrent_ops.gated_norm(out, z.unflatten(1, (self.nv, self.dv)),
                                                             self.norm.weight, self.norm.eps))
        qk = mixed[:, :2 * self.key_dim].float().view(T, 2 * self.nk, self.dk)
        if self.norm.cpu_kernel is not None and T <= RMSNorm.KERNEL_ROWS and not qk.is_cuda:
            q = self.norm.cpu_kernel(qk[:, :self.nk], self.q_norm_w, 1e-6 / self.dk)  # l2norm_scaled's form
            k = self.norm.cpu_kernel(qk[:, self.nk:], self.k_norm_w, 1e-6 / self.dk)
        else:
            q = l2norm_scaled(qk[:, :self.nk], self.q_norm_w)  # l2norm(q) / sqrt(dk)
            k = l2norm_scaled(qk[:, self.nk:], self.k_norm_w)  # l2norm(k)
        if self.nv != self.nk and (T == 1 or PREFILL_FORM != "chunked"):
            # each key head serves nv/nk consecutive value heads (chunked takes them unrepeated)
            q = q.repeat_interleave(self.nv // self.nk, dim=1)
            k = k.repeat_interleave(self.nv // self.nk, dim=1)
        v = mixed[:, 2 * self.key_dim:].reshape(T, self.nv, self.dv)
        beta = b.float().sigmoid() if self.beta_scale == 1.0 else b.float().sigmoid() * self.beta_scale
        g = self.neg_A * F.softplus(a.float() + self.dt_bias32)
        rec = st["recurrent"]
        if T == 1:
            out = gated_delta.step(q, k, v, g, beta, rec)
        elif PREFILL_FORM == "chunked":
            out = gated_delta.chunked(q, k, v, g, beta, rec, fused=serving.rows(x))
        else:
            out = gated_delta.recurrent_naive(q, k, v, g, beta, rec)
        z = z.reshape(T, self.nv, self.dv)
        out = self.norm(out.to(x.dtype), z).reshape(T, self.value_dim)
        return self.project_out(out)


class GatedAttention(QKVProjections):
    def __init__(self, cfg: HybridConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.nh, self.nkv, self.d = cfg.num_heads, cfg.num_kv_heads, d
        self.q_proj = Linear(h, self.nh * d * 2, bias=cfg.attention_bias)
        self.k_proj = Linear(h, self.nkv * d, bias=cfg.attention_bias)
        self.v_proj = Linear(h, self.nkv * d, bias=cfg.attention_bias)
        self.o_proj = Linear(self.nh * d, h, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(d, cfg.rms_eps, offset=1.0)
        self.k_norm = RMSNorm(d, cfg.rms_eps, offset=1.0)

    def forward(self, x, positions, rope: Rope, cos, sin, kv, kv_len, mask):
        T = x.shape[0]
        if attention_ops.rope_serves(x, self.d):
            # q/k norms, partial RoPE and the KV write in one kernel; a one-token attention applies the gate
            qkv = self.project_joint(x)
            q = attention_ops.rope_kv_write(qkv, cos, sin, positions, kv[0], kv[1], self.nh, self.nkv,
                                            q_stride=2 * self.d, eps=self.q_norm.eps,
                                            norm_weights=(self.q_norm.fused_weight(), self.k_norm.fused_weight()))
            if attention_ops.decode_serves(x, self.d):
                return self.o_proj(attention_ops.decode(q, kv[0], kv[1], positions, qkv[:, self.d:], 2 * self.d,
                                                        int8_out=linear_ops.reads_int8(self.o_proj, x.dtype, "merge")))
            gate = qkv[:, :self.nh * 2 * self.d].view(T, self.nh, 2 * self.d)[..., self.d:]
            out = attend_cached(q, kv[0], kv[1], kv_len, mask).view(T, self.nh, self.d) * torch.sigmoid(gate)
            return self.o_proj(out.view(T, -1))
        qg, k, v = self.project_qkv(x)  # q comes with its output gate, per head
        q, gate = qg.view(T, self.nh, 2 * self.d).chunk(2, dim=-1)
        q = rope.apply(self.q_norm(q).transpose(0, 1), cos, sin)
        k = rope.apply(self.k_norm(k.view(T, self.nkv, self.d)).transpose(0, 1), cos, sin)
        v = v.view(T, self.nkv, self.d).transpose(0, 1)
        out = cached_attention(q, k, v, positions, kv[0], kv[1], kv_len, mask)
        return self.o_proj(out * torch.sigmoid(gate.reshape(T, -1)))


class HybridLayer(nn.Module):
    def __init__(self, cfg: HybridConfig, i: int):
        super().__init__()
        self.linear = cfg.layer_types[i] == "linear_attention"
        if self.linear:
            self.linear_attn = GatedDeltaNet(cfg)
        else:
            self.self_attn = GatedAttention(cfg)
        if cfg.moe_layers and cfg.moe_layers[i]:
            self.mlp = SparseMoe(cfg.hidden_size, cfg.num_experts, cfg.experts_per_tok, cfg.moe_intermediate_size,
                                 cfg.norm_topk_prob, cfg.shared_expert_intermediate_size)
        else:
            self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps, offset=1.0)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps, offset=1.0)

    def forward(self, x, i, positions, rope, cos, sin, state: StateView, mask) -> Residual:
        x, h = add_norm(x, self.input_layernorm, defer=True)  # both mixers read h through linears only
        if self.linear:
            h = self.linear_attn(h, state.fixed(i))
        else:
            h = self.self_attn(h, positions, rope, cos, sin, state.kv(i), state.kv_len, mask)
        x, h = add_norm(Residual(x, h), self.post_attention_layernorm, defer=isinstance(self.mlp, (SwiGLU, SparseMoe)))
        return Residual(x, moe.branch(self.mlp, h))  # an MoE prefill's combine joins the next add_norm


class HybridForCausalLM(CausalLM):
    def __init__(self, cfg: HybridConfig):
        body = Body(cfg.vocab_size, cfg.hidden_size, [HybridLayer(cfg, i) for i in range(len(cfg.layer_types))],
                    RMSNorm(cfg.hidden_size, cfg.rms_eps, offset=1.0))
        super().__init__(cfg, body, Rope(cfg.head_dim, cfg.rope_theta, rotary_dim=cfg.rotary_dim))
        self.mtp = MtpHead(cfg, HybridLayer) if cfg.mtp_layers else None

    cpu_step_kind = "hybrid"  # (models/kernels/cpu/hybrid_step.py)

    def offers_cpu_step(self) -> bool:
        return True  # (routed experts too where they are GGUF blocks: hybrid_step.supports)

    def state_spec(self):
        c = self.config
        return [layer.linear_attn.state() if layer.linear else AttentionState(c.num_kv_heads, c.head_dim)
                for layer in self.model.layers]

    def checkpoint_names(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """HF names → ours: multimodal prefixes, Qwen3-Next's fused projections, per-expert weights."""
        c = self.config
        out: dict[str, torch.Tensor] = {}
        for name, t in tensors.items():
            if name.startswith(("model.visual.", "visual.")):
                continue  # the vision tower is not part of the text model
            name = name.replace("model.language_model.", "model.").replace("model.mtp.", "mtp.")
            if name.startswith("mtp."):  # the MTP layer's where the model has one, its first layer's only
                if self.mtp is None or (name.startswith("mtp.layers.") and not name.startswith("mtp.layers.0.")):
                    continue
            if name.endswith("conv1d.weight") and t.dim() == 2:
                t = t[:, None, :]
            if name.endswith("in_proj_qkvz.weight"):
                # per key head: q, k, v (r heads), z (r heads) rows; to all q, all k, all v, and z
                base = name[: -len("in_proj_qkvz.weight")]
                r = c.lin_v_heads // c.lin_k_heads
                q, k, v, z = _head_rows(c.lin_k_heads, [c.lin_k_dim, c.lin_k_dim, r * c.lin_v_dim, r * c.lin_v_dim])
                out[base + "in_proj_qkv.weight"] = _take_rows(t, torch.cat([q, k, v]))
                out[base + "in_proj_z.weight"] = _take_rows(t, z)
                continue
            if name.endswith("in_proj_ba.weight"):
                base = name[: -len("in_proj_ba.weight")]
                r = c.lin_v_heads // c.lin_k_heads
                b, a = _head_rows(c.lin_k_heads, [r, r])
                out[base + "in_proj_b.weight"] = _take_rows(t, b)
                out[base + "in_proj_a.weight"] = _take_rows(t, a)
                continue
            out[name] = t
        return stack_experts(out)


def _head_rows(heads: int, sizes: list[int]) -> list[torch.Tensor]:
    """A fused weight whose rows run head by head, each head's parts of `sizes` rows in turn: for
    each part, its rows' indices across the heads (head-major)."""
    per, starts = sum(sizes), torch.tensor([0, *sizes]).cumsum(0)
    return [torch.cat([h * per + torch.arange(int(starts[i]), int(starts[i + 1])) for h in range(heads)])
            for i in range(len(sizes))]


def _take_rows(t, rows: torch.Tensor):
    """Rows `rows` of a weight: a tensor's, or a GGUF matrix's blocks as stored (whole rows of
    blocks: exact; a Qwen3-Next GGUF loaded with its blocks kept)."""
    if isinstance(t, torch.Tensor):
        return t[rows]
    return t.permute_rows(lambda a: a[rows.numpy()].copy())


def from_hf_config(c: dict, flags: dict) -> HybridForCausalLM:
    return HybridForCausalLM(HybridConfig.from_hf(c, **flags))


def tensor_parallel_plan(cfg: HybridConfig, world: int) -> Plan:
    """Attention heads, Gated DeltaNet heads, MLP widths and each expert's width split over
    `world` ranks (models/sharding.py); routers replicated."""
    H, KV, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    nk, nv, dk, dv = cfg.lin_k_heads, cfg.lin_v_heads, cfg.lin_k_dim, cfg.lin_v_dim
    I, MI, SI = cfg.intermediate_size, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    counts = {"attention heads": H, "key/value heads": KV, "linear-attention key heads": nk,
              "linear-attention value heads": nv, "MLP width": I}
    if cfg.num_experts:
        counts.update({"expert width": MI, "shared expert width": SI})
    divisible(counts, world)
    local = replace(cfg, num_heads=H // world, num_kv_heads=KV // world, lin_k_heads=nk // world,
                    lin_v_heads=nv // world, intermediate_size=I // world,
                    moe_intermediate_size=MI // world, shared_expert_intermediate_size=SI // world)
    layer, qkv = r"model\.layers\.\d+\.", (nk * dk, nk * dk, nv * dv)
    return Plan(local, (
        Split(layer + r"self_attn\.q_proj\.(weight|bias)", 0, (H * D * 2,)),  # [q; gate] per head
        Split(layer + r"self_attn\.[kv]_proj\.(weight|bias)", 0, (KV * D,)),
        Split(layer + r"self_attn\.o_proj\.weight", 1, (H * D,)),
        Split(layer + r"linear_attn\.(in_proj_qkv|conv1d)\.weight", 0, qkv),
        Split(layer + r"linear_attn\.in_proj_z\.weight", 0, (nv * dv,)),
        Split(layer + r"linear_attn\.(in_proj_[ba]\.weight|dt_bias|A_log)", 0, (nv,)),
        Split(layer + r"linear_attn\.out_proj\.weight", 1, (nv * dv,)),
        Split(layer + r"mlp\.(gate|up)_proj\.weight", 0, (I,)),
        Split(layer + r"mlp\.down_proj\.weight", 1, (I,)),
        *expert_splits(layer, MI, SI),
    ), reduce_after=layer + r"(self_attn|linear_attn|mlp)", rank0=layer + r"self_attn\.o_proj\.bias")
