"""Tensor parallelism of a model over the ranks of a torch.distributed group: the plan, the
slices each rank reads, and the collectives each rank's forward runs.

An architecture offers `tensor_parallel_plan(cfg, world) -> Plan`: the config of one rank's
model (the same hidden size and vocabulary, 1/world of the heads, key/value heads, linear-attention
heads, MLP and expert widths), the rules that cut each checkpoint tensor for a rank, and the
modules whose outputs are partial sums. A rank's model is that architecture built from the local
config, so its forward, its kernels and the state it declares (state_spec: its own KV heads and
conv/recurrent heads) are the one-device code on smaller shapes. What differs:

- column-parallel tensors (q/k/v, gate/up, the linear-attention input projections, the conv
  channels, per-head parameters) keep 1/world of their rows: a `Split` names the dimension and
  the segments it is made of (a fused [q; k; v] is cut per segment, so each rank keeps whole
  heads of each);
- row-parallel tensors (o_proj, down_proj, out_proj, the experts' down) keep 1/world of their
  columns; their biases stay on rank 0 only (`rank0`), since their outputs are summed;
- every module matched by `reduce_after` (a layer's mixer and its MLP or MoE block) ends with one
  all-reduce of its output: the sum of the ranks' partial products, what one device computes
  (in another order of additions: results agree to rounding, not bit for bit);
- the LM head is split by vocabulary: each rank computes ceil(V / world) rows of logits (the last
  rank's padding rows are zero weights) and one all-gather gives every rank the full fp32 row,
  so every rank's sampler sees what one device's would;
- embeddings and norms are replicated; MoE routers are replicated (every rank routes the same
  tokens to the same experts) and each expert is split by its width, which keeps the ranks'
  work equal at batch 1 (expert parallelism would leave it to where the top-k experts live).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn


class ShardingError(ValueError):
    """The model cannot be split over this many ranks; the message is one line for the user."""


@dataclass(frozen=True)
class Shard:
    rank: int
    world: int
    group: Any = None  # the process group of the model's collectives (None: the default group)


@dataclass(frozen=True)
class Split:
    """Cut dimension `dim` of the tensors whose canonical names fullmatch `pattern`: it is made
    of consecutive segments of the global sizes `parts`, each split evenly over the ranks."""
    pattern: str
    dim: int
    parts: tuple[int, ...]


@dataclass(frozen=True)
class Plan:
    config: Any
    splits: tuple[Split, ...]
    reduce_after: str  # module names (fullmatch) whose outputs are partial sums
    rank0: str = r"$^"  # tensors (fullmatch) kept on rank 0 and zero elsewhere: row-parallel biases


def expert_splits(layer: str, expert_width: int, shared_width: int = 0) -> tuple[Split, ...]:
    """An MoE MLP (moe.SparseMoe) split by width: each routed expert's gate/up rows and down
    columns, and the shared expert's where there is one; the router is replicated."""
    splits = (Split(layer + r"mlp\.experts\.gate_up_proj", 1, (expert_width, expert_width)),
              Split(layer + r"mlp\.experts\.down_proj", 2, (expert_width,)))
    if shared_width:
        splits += (Split(layer + r"mlp\.shared_expert\.(gate|up)_proj\.weight", 0, (shared_width,)),
                   Split(layer + r"mlp\.shared_expert\.down_proj\.weight", 1, (shared_width,)))
    return splits


def divisible(what: dict[str, int], world: int) -> None:
    """Raise ShardingError naming the first count that `world` does not divide."""
    for name, n in what.items():
        if n % world:
            raise ShardingError(f"tensor_parallel {world} does not divide the model's {name} ({n}); "
                                f"use a tensor_parallel that divides it")


def cut(t, dim: int, parts: tuple[int, ...], rank: int, world: int) -> torch.Tensor:
    """This rank's piece of each segment along `dim`, concatenated. `t` is a tensor or a
    safetensors slice (only the pieces are read from the file)."""
    pieces, start = [], 0
    ndim = len(t.get_shape()) if hasattr(t, "get_shape") else t.dim()
    for size in parts:
        n = size // world
        index = [slice(None)] * ndim
        index[dim] = slice(start + rank * n, start + (rank + 1) * n)
        pieces.append(t[tuple(index)])
        start += size
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)


def vocab_rows(vocab: int, world: int) -> int:
    return -(-vocab // world)


def head_rows(t, vocab: int, rank: int, world: int) -> torch.Tensor:
    """Rows [rank * n, (rank + 1) * n) of an LM head or embedding (n = ceil(vocab / world)), zero
    rows past the vocabulary."""
    n = vocab_rows(vocab, world)
    lo, hi = min(vocab, rank * n), min(vocab, (rank + 1) * n)
    rows = t[lo:hi]
    if hi - lo < n:
        rows = torch.cat([rows, torch.zeros((n - (hi - lo),) + tuple(rows.shape[1:]), dtype=rows.dtype)])
    return rows


class Slicer:
    """The rule for each canonical tensor name: what of it this rank keeps."""

    def __init__(self, plan: Plan, shard: Shard, vocab: int):
        self.plan, self.shard, self.vocab = plan, shard, vocab
        self._splits = [(re.compile(s.pattern), s) for s in plan.splits]
        self._rank0 = re.compile(plan.rank0)

    def rule(self, name: str) -> Callable | None:
        """A function (tensor or safetensors slice) → this rank's tensor; None: the whole tensor."""
        r, w = self.shard.rank, self.shard.world
        if name == "lm_head.weight":
            return lambda t: head_rows(t, self.vocab, r, w)
        for pattern, s in self._splits:
            if pattern.fullmatch(name):
                return lambda t, s=s: cut(t, s.dim, s.parts, r, w)
        if self._rank0.fullmatch(name) and r != 0:
            return lambda t: torch.zeros_like(t[...] if not isinstance(t, torch.Tensor) else t)
        return None

    def __call__(self, name: str, t) -> torch.Tensor:
        rule = self.rule(name)
        if rule is None:
            return t if isinstance(t, torch.Tensor) else t[...]
        return rule(t).contiguous()


def local_head(model: nn.Module, shard: Shard) -> None:
    """Before loading: the LM head of a rank's model holds ceil(V / world) rows."""
    cfg = model.config
    old = model.lm_head
    model.lm_head = type(old)(old.in_features, vocab_rows(cfg.vocab_size, shard.world), bias=False,
                              device=old.weight.device, dtype=old.weight.dtype)


def untie_head(model: nn.Module, shard: Shard) -> None:
    """After loading a tied model: the head becomes this rank's rows of the embedding."""
    w = model.model.embed_tokens.weight.detach()
    rows = head_rows(w.cpu(), model.config.vocab_size, shard.rank, shard.world).to(w.device)
    head = type(model.lm_head)(w.shape[1], rows.shape[0], bias=False, device="meta")
    head.weight = nn.Parameter(rows, requires_grad=False)
    model.lm_head = head


def install_collectives(model: nn.Module, plan: Plan, shard: Shard) -> None:
    """The all-reduce after each partial-sum module and the all-gather of the head's logits."""
    group, world, vocab = shard.group, shard.world, model.config.vocab_size
    pattern = re.compile(plan.reduce_after)

    def reduce(module, args, out):
        dist.all_reduce(out, group=group)
        return out

    n = 0
    for name, module in model.named_modules():
        if pattern.fullmatch(name):
            module.register_forward_hook(reduce)
            n += 1
    if n == 0:
        raise ShardingError(f"no module of {type(model).__name__} matches the plan's reductions")

    def gather(module, args, logits):
        local = logits.contiguous()
        if local.is_cuda:
            out = torch.empty((world,) + tuple(local.shape), dtype=local.dtype, device=local.device)
            dist.all_gather_into_tensor(out, local, group=group)
            parts = out.unbind(0)
        else:
            parts = [torch.empty_like(local) for _ in range(world)]
            dist.all_gather(parts, local, group=group)
        return torch.cat(parts, dim=-1)[..., :vocab]

    model.register_forward_hook(gather)
    model.shard = shard
