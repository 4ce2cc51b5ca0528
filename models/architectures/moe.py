"""Mixture-of-experts MLPs: a softmax top-k router over SwiGLU experts, with an optional shared
expert (sigmoid-gated). Used by Qwen3-MoE (no shared expert), Qwen3-Next and Qwen3.5-MoE.

The experts are stored as 3D tensors (the transformers 5 layout: `gate_up_proj` [E, 2*I, H] with
gate rows first, `down_proj` [E, H, I]); `stack_experts` turns hub checkpoints' per-expert 2D
weights into it. The layer takes [T, H] and returns [T, H]; routing weights stay fp32.

Forms, each tested against the next (tests/kernels/test_moe_kernels.py, tests/engine/test_graphs.py): the per-expert
loop (the oracle, as transformers computes), grouped GEMMs over the tokens sorted by expert
(prefill: torch._grouped_mm, no host sync, no atomics), the gather of the chosen experts (decode
on the CPU), and on CUDA in half precision the Triton decode of ops.experts (routing and
the chosen experts read on the device: three launches and the shared expert's, inside the graph).
A CUDA prefill in half precision routes with the decode's kernel too, a program a token, sorts the
pairs by expert in three launches (ops.experts.sort_pairs, the stable argsort's order),
and through the grouped GEMMs hands its combine to the next add_norm (PendingCombine: the combine,
the residual add and the RMSNorm in one launch).
"""
from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn

from ..quant.layers import PlanarExperts
from ..ops import experts as experts_ops, linear as linear_ops, serving
from .layers import FusedLinear, Linear, SwiGLU

# Test-only switch: the multi-token form of the experts ("grouped" where it serves, or "loop").
EXPERTS_FORM = "grouped"
# False: the CUDA grouped prefill through torch._grouped_mm over a sorted copy of the rows, not
# the grouped GEMMs of ops.experts (slower: bench/moe_prefill_sweep.py, bench/ab_prefill.py)
TRITON_GROUPED = True


def grouped_serves(x: torch.Tensor, intermediate: int) -> bool:
    """Whether torch._grouped_mm takes these operands: its rows must be 16-byte aligned, and on
    CUDA it computes in bf16 (other dtypes take the loop)."""
    return grouped_takes(x.shape[-1], intermediate, x.dtype, cpu=x.device.type == "cpu")


def grouped_takes(hidden: int, intermediate: int, dtype: torch.dtype, cpu: bool = False) -> bool:
    """grouped_serves' rule on sizes and a dtype: torch._grouped_mm present, rows of hidden and
    intermediate 16-byte aligned, and bf16 (any dtype on the CPU)."""
    size = dtype.itemsize
    if not hasattr(torch, "_grouped_mm") or (hidden * size) % 16 or (intermediate * size) % 16:
        return False
    return cpu or dtype == torch.bfloat16


class Experts(nn.Module):
    """Routed SwiGLU experts stored as 3D tensors."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))

    def forward(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H]; idx (int64), weights (fp32) [T, top_k]."""
        if x.shape[0] == 1:  # decode: gather the chosen experts (no data-dependent control flow)
            gate, up = torch.einsum("kih,h->ki", self.gate_up_proj[idx[0]], x[0]).chunk(2, dim=-1)
            y = torch.einsum("khi,ki->kh", self.down_proj[idx[0]], F.silu(gate) * up)
            return (y * weights[0][:, None].to(y.dtype)).sum(0, keepdim=True)
        if EXPERTS_FORM == "grouped" and grouped_serves(x, self.down_proj.shape[-1]):
            return self.grouped(x, idx, weights)
        out = torch.zeros_like(x)
        for e in idx.unique().tolist():
            tok, slot = torch.where(idx == e)
            gate, up = F.linear(x[tok], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[e]) * weights[tok, slot, None].to(x.dtype)
            out.index_add_(0, tok, y)
        return out

    def grouped(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, shared: torch.Tensor | None = None,
                shared_gate: torch.Tensor | None = None, defer: bool = False) -> "torch.Tensor | PendingCombine":
        """The T*k (token, expert) pairs sorted by expert, two grouped GEMMs over the experts'
        row ranges (offsets computed on the device), then each token's k results summed in
        slot order (a fixed order: no atomics). On CUDA the sort is three launches
        (experts_ops.sort_pairs: the same order), the GEMMs experts_ops.grouped_* (x's rows read in
        place, the SwiGLU in the first's epilogue; else x's rows copied into the sorted order for
        torch._grouped_mm, then the silu_mul kernel), and the weighted sum one kernel (experts_ops.combine).
        `shared` and `shared_gate` (CUDA only: SparseMoe.forward's prefill): a shared expert's
        output and its gate's logits, added in combine's sum. `defer`: the grouped GEMMs' form returns
        the combine not run yet (PendingCombine: the next add_norm runs it in its own launch)."""
        T, k = idx.shape
        E = self.gate_up_proj.shape[0]
        cuda = serving.rows(x)
        if cuda and x.stride(-1) != 1:
            x = x.contiguous()
        if cuda and TRITON_GROUPED and experts_ops.grouped_fits(x.shape[1], self.down_proj.shape[2]) \
                and self.gate_up_proj.is_contiguous() and self.down_proj.is_contiguous():
            # the sort without the rows' copy, the GEMMs reading x's rows in place, SwiGLU in the first's epilogue
            src, inv, starts, offs = experts_ops.sort_pairs(x, idx.contiguous(), E, copy=False)
            h = experts_ops.grouped_gate_up(x, src, starts, offs, self.gate_up_proj)
            ys = experts_ops.grouped_down(h, starts, offs, self.down_proj)
            pending = PendingCombine(ys, inv, weights.float().contiguous(), shared, shared_gate)
            return pending if defer else pending.materialize()
        if cuda:  # the sort in three launches (no radix sort)
            xs, inv, offs = experts_ops.sort_pairs(x, idx.contiguous(), E)
        else:
            assert shared is None
            flat = idx.reshape(-1)
            # the ids as 16-bit keys where they fit: a stable radix sort makes a pass per key byte
            # (8 for int64), and a stable sort's order depends only on the keys' order
            order = (flat.to(torch.int16) if E <= 1 << 15 else flat).argsort(stable=True)
            # (bincount would read its largest id on the host first; an integer scatter-add is exact)
            counts = torch.zeros(E, dtype=torch.int32, device=x.device)
            offs = counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32)).cumsum(0, dtype=torch.int32)
            xs = x[order // k]
        gu = torch._grouped_mm(xs, self.gate_up_proj.transpose(1, 2), offs=offs)
        if cuda:
            h = linear_ops.silu_mul_kernel(gu)
        else:
            gate, up = gu.chunk(2, dim=-1)
            h = F.silu(gate) * up
        ys = torch._grouped_mm(h, self.down_proj.transpose(1, 2), offs=offs)
        if cuda:
            return experts_ops.combine(ys, inv, weights.float().contiguous(), shared, shared_gate)
        y = torch.empty_like(ys)
        y[order] = ys
        return (y.view(T, k, -1) * weights[..., None].to(y.dtype)).sum(1)


class PendingCombine:
    """A grouped CUDA prefill's branch whose last launch (experts_ops.combine: each token's weighted
    sum of its experts' rows) has not run: `Residual.branch` as add_norm takes it, which runs it
    with the residual add and the next RMSNorm in one launch (experts_ops.combine_add_rms_norm: the
    same bits as combine and then add_rms_norm). Anything else takes materialize()'s tensor.
    `first`: the branch of tokens first .. T - 1 only (last_row), the kernels handed the whole
    tensors and the token to start at."""
    __slots__ = ("ys", "inv", "weights", "shared", "shared_gate", "first")

    def __init__(self, ys, inv, weights, shared=None, shared_gate=None, first: int = 0):
        self.ys, self.inv, self.weights, self.shared, self.shared_gate = ys, inv, weights, shared, shared_gate
        self.first = first

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.weights.shape[0] - self.first, self.ys.shape[1]))

    def materialize(self) -> torch.Tensor:
        return experts_ops.combine(self.ys, self.inv, self.weights, self.shared, self.shared_gate, self.first)

    def last_row(self) -> "PendingCombine":
        """The last token's branch. Not views at its rows (inv[-k:], ...): their alignment would
        follow the prompt's length, and with it the kernels' compiled variants."""
        return PendingCombine(self.ys, self.inv, self.weights, self.shared, self.shared_gate,
                              self.weights.shape[0] - 1)

    def add_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 out_dtype: torch.dtype | None) -> "tuple[torch.Tensor, torch.Tensor] | None":
        """(x + branch, rms_norm(x + branch) * weight) in one launch, or None where x is not rows
        the kernel takes (then add_norm adds materialize()'s tensor)."""
        if not (x.is_contiguous() and x.dtype == self.ys.dtype and x.shape == self.shape):
            return None
        return experts_ops.combine_add_rms_norm(self.ys, self.inv, self.weights, x, weight, eps, self.shared,
                                                self.shared_gate, out_dtype, self.first)


# False: the grouped prefill's combine as its own launch, the next add_norm apart (the A/B of
# bench/ab_prefill.py)
FUSED_COMBINE = True


def branch(mlp: nn.Module, h: torch.Tensor) -> "torch.Tensor | PendingCombine":
    """mlp(h) for a decoder layer's Residual: a SparseMoe's grouped CUDA prefill hands on its
    combine not run yet (PendingCombine), for the next add_norm to join. Not where hooks watch the
    module's output (tensor parallelism's all-reduce: sharding.install_collectives), which must
    see the tensor."""
    if (FUSED_COMBINE and isinstance(mlp, SparseMoe) and not mlp._forward_hooks and not mlp._forward_pre_hooks
            and not nn.modules.module._global_forward_hooks and isinstance(h, torch.Tensor)):
        return mlp.forward(h, defer=True)
    return mlp(h)


def prefill_syncless(mlp: nn.Module, dtype: torch.dtype) -> bool:
    """Whether `mlp`'s multi-token CUDA forward in `dtype` runs without a host sync (so that a CUDA
    graph can record it): anything but a SparseMoe, or one whose experts take the grouped form
    (the per-expert loops read the chosen ids on the host)."""
    if not isinstance(mlp, SparseMoe):
        return True
    ex = mlp.experts
    if type(ex) is not Experts or EXPERTS_FORM != "grouped":
        return False
    return grouped_takes(ex.down_proj.shape[1], ex.down_proj.shape[2], dtype)


def decode_serves(ex: nn.Module) -> bool:
    """Whether the CUDA decode kernels read these experts: moe.Experts' contiguous 3D weights, or
    PlanarExperts (its planar halves through the planar expert GEMVs)."""
    if isinstance(ex, PlanarExperts):
        return True
    return isinstance(ex, Experts) and ex.gate_up_proj.is_contiguous() and ex.down_proj.is_contiguous()


def decode_experts(x: torch.Tensor, ex: nn.Module, idx: torch.Tensor, weights: torch.Tensor,
                   shared: torch.Tensor | None = None, shared_gate: torch.Tensor | None = None) -> torch.Tensor:
    """One token's routed experts on CUDA (decode_serves(ex)): x [1, H] contiguous, idx and weights
    [1, k] from experts_ops.route; plus shared * sigmoid(shared_gate) where given. Each half of
    PlanarExperts through the planar GEMVs where planar, else through the half's launch for dense
    experts (h, the fp32 intermediate, passes between them); moe.Experts through experts_ops.experts."""
    if not isinstance(ex, PlanarExperts):
        return experts_ops.experts(x, ex.gate_up_proj, ex.down_proj, idx, weights, shared, shared_gate)
    gu, dn, E = ex.qweight("gate_up"), ex.qweight("down"), ex.num_experts
    h = experts_ops.planar_gate_up(x, gu, idx, E) if gu is not None else \
        experts_ops.experts_gate_up(x, ex.gate_up_proj, idx)
    if dn is not None:
        return experts_ops.planar_down(h, dn, idx, weights, E, x.dtype, shared, shared_gate)
    return experts_ops.experts_down(h, ex.down_proj, idx, weights, x.dtype, shared, shared_gate)


class Router(nn.Module):
    """Softmax over all experts in fp32, then the top k (renormalised to sum 1 if norm_topk)."""

    def __init__(self, num_experts: int, hidden: int, top_k: int, norm_topk: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden))
        self.top_k, self.norm_topk = top_k, norm_topk

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids [T, k] int64, weights [T, k] fp32) of x's rows."""
        return self.route(x)[1:]

    def route(self, x: torch.Tensor, rows: torch.Tensor | None = None):
        """(logits [T, len(rows)] in x's dtype, ids, weights) of x's rows; `rows` as decode_cuda's
        (the experts' softmax and top k over the first num_experts logits only)."""
        E = self.weight.shape[0]
        logits = F.linear(x, self.weight if rows is None else rows)
        if serving.rows(x):  # one launch, not ~5; and a token routes as decode routes it
            return (logits, *experts_ops.route(logits, self.top_k, self.norm_topk, E))
        probs = logits[:, :E].float().softmax(-1)
        weights, idx = probs.topk(self.top_k, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        return logits, idx, weights

    def decode_cuda(self, x: "torch.Tensor | linear_ops.NormedRow", rows: torch.Tensor | None = None):
        """One token on CUDA: (logits [1, len(rows)] in x's dtype, as the torch form rounds them;
        the input row as a tensor; ids [1, k]; weights [1, k] fp32), with no host sync. `rows`:
        the router's weight, or it with more rows below (a shared expert's gate) whose logits
        come back too. The GEMV normalizes a deferred row (NormedRow) in its prologue and writes
        it for the experts, which read it next."""
        logits, row = linear_ops.gemv_and_row(x, self.weight if rows is None else rows)
        E = self.weight.shape[0]
        idx, weights = experts_ops.route(logits, self.top_k, self.norm_topk, E)
        return logits, row, idx, weights


class SparseMoe(nn.Module):
    """`mlp.*` in checkpoint names: gate (the router), experts, and where shared_intermediate > 0
    shared_expert + shared_expert_gate."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, intermediate: int, norm_topk: bool = True,
                 shared_intermediate: int = 0):
        super().__init__()
        self.gate = Router(num_experts, hidden, top_k, norm_topk)
        self.experts = Experts(num_experts, hidden, intermediate)
        if shared_intermediate:
            self.shared_expert = SwiGLU(hidden, shared_intermediate)
            self.shared_expert_gate = Linear(hidden, 1, bias=False)

    def forward(self, x: "torch.Tensor | linear_ops.NormedRow", defer: bool = False) -> torch.Tensor:
        """x may be a NormedRow (a deferred norm, one row on CUDA: the decoder layer's add_norm
        with defer), which the CUDA decode path takes as it is and the torch form materializes.
        `defer` (moe.branch): the grouped CUDA prefill returns a PendingCombine."""
        row = linear_ops.is_row(x)
        if decode_serves(self.experts) and (row or serving.one_row(x)):
            return self.decode_cuda(x)
        if row:
            x = x.materialize()
        fused = hasattr(self, "router_rows")
        if (fused or not hasattr(self, "shared_expert")) and self.grouped_on_cuda(x):
            # the router's and the shared gate's logits from one GEMM (fuse()); the shared expert's
            # gated output added in the routed experts' combine (four launches fewer)
            E = self.gate.weight.shape[0]
            logits, idx, weights = self.gate.route(x, self.router_rows if fused else None)
            shared = (self.shared_expert(x), logits[:, E:E + 1]) if fused else (None, None)
            return self.experts.grouped(x, idx, weights, *shared, defer=defer)
        idx, weights = self.gate(x)
        out = self.experts(x, idx, weights)
        if hasattr(self, "shared_expert"):
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def grouped_on_cuda(self, x: torch.Tensor) -> bool:
        """Whether these rows take Experts.grouped's CUDA form (a multi-row forward)."""
        return (x.shape[0] > 1 and type(self.experts) is Experts and EXPERTS_FORM == "grouped"
                and serving.rows(x) and grouped_serves(x, self.experts.down_proj.shape[-1]))

    def fuse(self) -> None:
        """After loading: the router's rows and the shared expert's gate row in one weight, so
        that one GEMV gives both on the CUDA decode path (a launch fewer per layer), and one GEMM
        both on the grouped prefill's."""
        if hasattr(self, "shared_expert_gate") and isinstance(self.shared_expert_gate, nn.Linear) \
                and self.gate.weight.is_cuda and self.shared_expert_gate.weight.dtype == self.gate.weight.dtype:
            w = self.gate.weight
            # zero rows up to a multiple of 8: the prefill GEMM's output rows then lie 16-byte
            # aligned (at E + 1 = 257 rows cuBLAS took an sm_75 kernel, slower than the two GEMMs
            # it replaced: bench/profile_step.py --prefill 2048)
            pad = w.new_zeros(-(w.shape[0] + 1) % 8, w.shape[1])
            self.register_buffer("router_rows", torch.cat([w, self.shared_expert_gate.weight, pad]), persistent=False)

    def decode_cuda(self, x: torch.Tensor) -> torch.Tensor:
        """One token on CUDA: the router's logits (rounded to x's dtype, as the torch form; the
        shared gate's too, where fused), the top k on the device, the chosen experts in two
        launches, with the shared expert as one more of them where its weights allow (else its
        output is added in the second one's epilogue)."""
        x = x if linear_ops.is_row(x) else x.contiguous()
        E = self.gate.weight.shape[0]
        fused = hasattr(self, "router_rows")  # [E + 1 + padding] logits: logit E the shared gate's
        logits, x, idx, weights = self.gate.decode_cuda(x, self.router_rows if fused else None)
        gate = logits[:, E:E + 1] if fused else self.shared_expert_gate(x) if hasattr(self, "shared_expert") else None
        ex = self.experts
        if not hasattr(self, "shared_expert"):
            return decode_experts(x, ex, idx, weights)
        se = self.shared_expert
        if isinstance(ex, PlanarExperts):
            return decode_experts(x, ex, idx, weights, se(x), gate)
        gu, dn = getattr(se, "gate_up_proj", None), se.down_proj
        if (isinstance(gu, FusedLinear) and isinstance(dn, nn.Linear) and gu.weight.shape == ex.gate_up_proj.shape[1:]
                and gu.weight.dtype == dn.weight.dtype == ex.gate_up_proj.dtype and dn.weight.is_contiguous()):
            # the shared expert as one more expert of both launches
            return experts_ops.experts(x, ex.gate_up_proj, ex.down_proj, idx, weights, shared_gate=gate,
                                       shared_gate_up=gu.weight, shared_down=dn.weight)
        return experts_ops.experts(x, ex.gate_up_proj, ex.down_proj, idx, weights, se(x), gate)


def stack_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hub checkpoints' `...mlp.experts.<e>.{gate,up,down}_proj.weight` (2D each) → the 3D
    `...mlp.experts.gate_up_proj` / `down_proj`; every other name passes through. The dict is
    consumed as it is read (no second copy of the experts is held)."""
    out: dict[str, torch.Tensor] = {}
    per: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name in list(tensors):
        t = tensors.pop(name)
        prefix, sep, rest = name.partition(".mlp.experts.")
        parts = rest.split(".")
        if sep and len(parts) == 3 and parts[0].isdigit() and parts[2] == "weight":
            per.setdefault(prefix, {}).setdefault(int(parts[0]), {})[parts[1]] = t
        else:
            out[name] = t
    for prefix, experts in per.items():
        ids = sorted(experts)
        if ids != list(range(len(ids))) or any(len(experts[e]) != 3 for e in ids):
            raise ValueError(f"{prefix}.mlp.experts: the per-expert weights are incomplete")
        out[prefix + ".mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([experts[e]["gate_proj"], experts[e]["up_proj"]]) for e in ids])
        out[prefix + ".mlp.experts.down_proj"] = torch.stack([experts[e]["down_proj"] for e in ids])
    return out


def num_experts(config: dict) -> int:
    """The routed experts' count: `num_experts` in hub configs, `num_local_experts` where
    transformers 5 writes it (its attribute map renames the key on save)."""
    return int(config.get("num_experts") or config.get("num_local_experts") or 0)
