"""The multi-token-prediction (MTP) layer of Qwen3.5 / Qwen3.5-MoE / Qwen3-Next checkpoints.

Contract. `MtpHead(cfg)` holds the checkpoints' `mtp.*` weights (a GGUF's `nextn` block, which
llama.cpp's converter writes after the model's own layers, maps to the same names): two
zero-centred norms, `fc` [hidden, 2 * hidden], one full-attention decoder layer of the model's own
kind (gated attention, dense or MoE MLP) and a final norm. It shares the model's embedding table,
RoPE and LM head, as the checkpoints do.

`forward(model, tokens, hidden, positions, cache)` runs the layer over rows whose input is token
t_p at position p with h_{p-1}, the model's final-normed hidden row of the position before (zeros
at position 0): fc([enorm(embed(t_p)); hnorm(h_{p-1})]), the decoder layer (its keys and values
written into `cache` at the rows' positions, attending over the slots up to each row's), then the
final norm. Its rows are the MTP's hidden rows (fp32, the next draft's h) and, through the
model's LM head, the logits of the token after t_p + 1: that is llama.cpp's graph_mtp
(src/models/qwen35.cpp, the "draft-mtp" speculative type) term for term, position for position.

What it computes only proposes tokens: the session verifies every draft against the model itself
(engine/speculative.py), so its numerics decide acceptance, never a reply. That is also why a
draft may be chosen among fewer rows of the LM head than the model's (`DraftHead`): a pass over a
large vocabulary's head is most of a draft's cost on the CPU.
"""
from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from ..quant.layers import BlockLinear
from .layers import Linear, RMSNorm, add_norm, causal_mask, head_logits


class MtpCache:
    """The MTP layer's keys and values ([KVH, slots, D] each; fp32 on the CPU) and its slot count."""

    def __init__(self, kv_heads: int, head_dim: int, slots: int, device, dtype=torch.float32):
        self.slots = slots
        self.k = torch.zeros(kv_heads, slots, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)

    # the decoder layer reads its cache through the StateView calls it makes
    def kv(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k, self.v


class _LayerState:
    """What a decoder layer asks of its state (`kv(i)`, `kv_len`), over an MtpCache."""

    def __init__(self, cache: MtpCache, kv_len: int):
        self.cache, self.kv_len = cache, kv_len

    def kv(self, i: int):
        return self.cache.kv(i)


class MtpHead(nn.Module):
    """`mtp.*` in HF checkpoint names (the module docstring)."""

    def __init__(self, cfg, layer_cls):
        super().__init__()
        h = cfg.hidden_size
        self.pre_fc_norm_embedding = RMSNorm(h, cfg.rms_eps, offset=1.0)
        self.pre_fc_norm_hidden = RMSNorm(h, cfg.rms_eps, offset=1.0)
        self.fc = Linear(2 * h, h, bias=False)
        # the layer's kind: full attention, and the MLP the model's last layer has (MoE or dense)
        moe = bool(cfg.moe_layers) and cfg.moe_layers[-1]
        one = replace(cfg, layer_types=("full_attention",), moe_layers=(moe,) if cfg.moe_layers else ())
        self.layers = nn.ModuleList([layer_cls(one, 0)])
        self.norm = RMSNorm(h, cfg.rms_eps, offset=1.0)
        self.kv_heads, self.head_dim = cfg.num_kv_heads, cfg.head_dim

    def new_cache(self, slots: int, device, dtype=torch.float32) -> MtpCache:
        return MtpCache(self.kv_heads, self.head_dim, slots, device, dtype)

    def forward(self, model, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                cache: MtpCache) -> torch.Tensor:
        """tokens, positions: [T] int64 (consecutive positions); hidden: [T, hidden] fp32, the
        rows' h_{p-1}. Returns the MTP's final-normed rows [T, hidden] fp32; its cache holds their
        keys and values afterwards. `model`: the CausalLM whose embedding and RoPE it shares."""
        e = model.embed(tokens)
        dtype = e.dtype  # the model's activations'
        x = torch.cat([self.pre_fc_norm_embedding(e.float(), torch.float32),
                       self.pre_fc_norm_hidden(hidden.float(), torch.float32)], dim=-1)
        x = self.fc(x.to(dtype))
        kv_len = int(positions[-1]) + 1
        if kv_len > cache.slots:
            raise ValueError(f"the MTP cache has {cache.slots} slots, position {kv_len - 1} asked")
        cos, sin = model.rope.cos_sin(positions, x.dtype)
        mask = causal_mask(positions, kv_len, x.dtype)
        x = self.layers[0](x, 0, positions, model.rope, cos, sin, _LayerState(cache, kv_len), mask)
        return add_norm(x, self.norm, out_dtype=torch.float32)[1]  # (x: a Residual, its branch added here)

    def logits(self, model, normed: torch.Tensor) -> torch.Tensor:
        """The draft logits [T, vocab] fp32 of the MTP's normed rows: the model's LM head."""
        return head_logits(model.lm_head, normed)


# The head's rows a draft is chosen among where the vocabulary has at least 4x as many: its first
# DRAFT_ROWS ids (a BPE vocabulary's ids follow its merges' order, most frequent first; FR-Spec,
# Zhao et al. 2025, restricts its drafts' head alike), the tokens of the conversation and the stop
# ids. Which share of real text that set holds: bench/draft_vocab.py; what a draft then costs:
# bench/spec_bench.py --acceptance ... --mtp. A draft outside the set is only a rejected draft.
DRAFT_ROWS = 32768


class DraftHead:
    """The LM head a draft's greedy token is chosen with: `rows` first rows of `head` (a view of
    its weights: nothing copied) and the rows of the ids `add` names beyond them (dequantized
    once to fp32), or the whole head where it has fewer than 4x `rows` rows (or no row view:
    `BlockLinear.first_rows`, a Linear's weight). `greedy(normed)`: the argmax over those rows of
    the last normed row's logits."""

    def __init__(self, head: nn.Module, rows: int | None = DRAFT_ROWS):
        self.head = head
        self.prefix = _first_rows(head, rows) if rows and 4 * rows <= _out_rows(head) else None
        self.rows = rows if self.prefix is not None else _out_rows(head)
        self.extra_ids: list[int] = []  # ids past the prefix, in the order their rows were added
        self._extra_rows: list[torch.Tensor] = []
        self._extra: torch.Tensor | None = None  # [len(extra_ids), hidden] fp32

    def add(self, ids) -> None:
        """Make these ids draftable (the conversation's tokens, the stop ids)."""
        if self.prefix is None:
            return
        known = set(self.extra_ids)
        for t in dict.fromkeys(int(t) for t in ids):
            if self.rows <= t < _out_rows(self.head) and t not in known:
                self.extra_ids.append(t)
                self._extra_rows.append(_row(self.head, t))
                known.add(t)
                self._extra = None

    def greedy(self, normed: torch.Tensor) -> int:
        row = normed[-1:]
        if self.prefix is None:
            return int(torch.argmax(head_logits(self.head, row)[-1]))
        logits = head_logits(self.prefix, row)[-1]
        best = int(torch.argmax(logits))
        if self.extra_ids:
            if self._extra is None:
                self._extra = torch.cat(self._extra_rows)
            extra = self._extra @ row[-1].float()
            j = int(torch.argmax(extra))
            if extra[j] > logits[best]:
                return self.extra_ids[j]
        return best


def _out_rows(head: nn.Module) -> int:
    return int(getattr(head, "out_features", 0))  # (0: a head of another form, used whole)


def _first_rows(head: nn.Module, n: int) -> nn.Module | None:
    if getattr(head, "bias", None) is not None:  # (Qwen's heads have none)
        return None
    if isinstance(head, BlockLinear):
        return head.first_rows(n)
    if isinstance(head, Linear):
        sub = Linear(head.in_features, n, bias=False, device="meta")
        sub.weight = nn.Parameter(head.weight[:n], requires_grad=False)
        return sub
    return None


def _row(head: nn.Module, t: int) -> torch.Tensor:
    """Row t of the head's weight in fp32 ([1, hidden])."""
    if isinstance(head, BlockLinear):
        return head.dequantize_rows(t, t + 1).float()
    return head.weight[t:t + 1].float()
