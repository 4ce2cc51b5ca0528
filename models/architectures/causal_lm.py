"""The shared top of every architecture: embeddings → decoder layers → final norm → LM head.

`CausalLM.forward(tokens, positions, state)` is the one model function (prefill, eager decode,
graph capture, the oracle and the tests all call it). Each layer is called as
`layer(x, i, positions, rope, cos, sin, state, mask)` and reads its own state through `state`;
it takes and returns the residual stream as a tensor or a `Residual` (the last branch not yet
added: the next norm adds it, in one kernel on CUDA).
"""
from __future__ import annotations

import torch
from torch import nn

from ..ops import attention as attention_ops, cpu as cpu_ops, serving
from .layers import Linear, Residual, Rope, add_norm, causal_mask, head_logits
from .state_spec import StateView


class Body(nn.Module):
    """`model.*` in HF checkpoint names."""

    def __init__(self, vocab_size: int, hidden: int, layers: list[nn.Module], norm: nn.Module):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, hidden)
        self.layers = nn.ModuleList(layers)
        self.norm = norm


class CausalLM(nn.Module):
    def __init__(self, cfg, body: Body, rope: Rope):
        super().__init__()
        self.config = cfg
        self.model = body
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope = rope
        if cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    # whether the last cpu_decode_step attached the C++ library's per-linear kernels (GGUF blocks)
    cpu_block_kernels = False
    # A session whose drafts come from the MTP layer (engine/speculative.py) sets this: called
    # with each forward's positions [T] and the final norm's rows [T, hidden] (fp32) of all its
    # rows, which the MTP layer reads. Only where such drafts run (the CPU): with it set, a
    # forward adds the last branch before the final norm rather than in a fused kernel.
    hidden_sink = None

    def sink_hidden(self, x: "torch.Tensor | Residual", positions: torch.Tensor) -> torch.Tensor:
        """x's rows, the last branch added, after handing their final norms to `hidden_sink`."""
        if isinstance(x, Residual):
            b = x.branch if isinstance(x.branch, torch.Tensor) else x.branch.materialize()
            x = x.x + b
        self.hidden_sink(positions, self.model.norm(x, torch.float32))
        return x

    def offers_cpu_step(self) -> bool:
        """Whether the whole-step C++ kernel knows this architecture (llama.py's dense models and
        LFM2 say so; the kernel then checks the weights it would read)."""
        return False

    def cpu_decode_step(self, dtype):
        """The C++ one-token step (models/kernels/cpu/) where it serves this model, else None:
        its GGUF blocks on the CPU then take the library's per-linear kernels, attached here
        (`cpu_block_kernels` says whether). Raises kernels.CpuStepUnavailable where either would
        serve but the library cannot be built or loaded here."""
        step = cpu_ops.decode_step(self, dtype) if self.offers_cpu_step() else None
        if step is not None:
            return step
        self.cpu_block_kernels = cpu_ops.block_kernels(self, dtype)
        return None

    def cpu_step_serves(self, dtype) -> bool:
        """Whether decode in `dtype` would run the C++ step or its per-linear kernels (built or not yet)."""
        return (self.offers_cpu_step() and cpu_ops.step_serves(self, dtype)) or cpu_ops.blocks_served(self, dtype)

    def cpu_kernels_off(self) -> None:
        """The per-linear kernels detached (a session with cpu_kernel off)."""
        cpu_ops.kernels_off(self)
        self.cpu_block_kernels = False

    def decode_attends_live(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether an eager one-token forward on `device` in `dtype` runs the Triton attention,
        which reads the live length from `positions` (so `state.kv_len` buckets change nothing)."""
        return serving.serves(device, dtype) and attention_ops.decode_fits(self.config.head_dim)

    def kernel_precompile(self, device: torch.device, dtype: torch.dtype):
        """A context inside which forwards on `device` in `dtype` compile their Triton kernels in
        parallel instead of running them, or None where no kernels serve them or this Triton
        cannot (then they compile one by one at their first launch)."""
        return serving.precompile_context(device, dtype)

    @property
    def max_position(self) -> int:
        return self.config.max_position

    def pads_prefill(self, device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype) -> bool:
        """Whether a prefill on `device` in `dtype` may run padded to a length bucket (forward's
        `last`; engine/graphs.py), its forward then reading no host length, so that a CUDA graph
        of it serves any start. Architectures that allow it say so."""
        return False

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, state: StateView,
                all_logits: bool = False, last: torch.Tensor | None = None) -> torch.Tensor:
        """tokens, positions: [T] int64. Returns fp32 logits [T, vocab] (or [1, vocab], the last row).

        `last` (an int64 [1] tensor on the device; where pads_prefill): the prompt is tokens up to
        and including row `last`, the rows after it padding at the next positions (their keys and
        values are written past the prompt, into slots the state does not count). Returns the
        logits of row `last`: the final norm over every row, then the head over that one.
        state.kv_len counts the pads' slots too. Where pads_prefill holds no mask is built (the
        layers attend by the kernel that reads the start from `positions`); elsewhere (the CPU:
        the tests' form) the causal mask over kv_len slots hides the pads from the prompt."""
        x = self.embed(tokens)
        cos, sin = self.rope.cos_sin(positions, x.dtype)
        # one token over exactly the live slots (the CPU), or the fused CUDA attention (it reads
        # the live length from `positions`): no mask
        live_only = tokens.shape[0] == 1 and (state.kv_len == state.length + 1
                                              or attention_ops.decode_serves(x, self.config.head_dim))
        # a prompt from position 0 attends with is_causal (attend_cached): no mask either
        from_zero = state.length == 0 and state.kv_len == tokens.shape[0]
        # a padded prefill where the model pads (the kernel that reads the start from `positions`)
        padded = last is not None and self.pads_prefill(x.device, x.dtype, x.dtype)
        mask = None if live_only or from_zero or padded else causal_mask(positions, state.kv_len, x.dtype)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, i, positions, self.rope, cos, sin, state, mask)  # a Residual: see add_norm
        if self.hidden_sink is not None and last is None:
            x = self.sink_hidden(x, positions)
        if last is not None:
            h = add_norm(x, self.model.norm, out_dtype=torch.float32)[1]
            return head_logits(self.lm_head, h.index_select(0, last))
        if not all_logits:
            x = x.last_row() if isinstance(x, Residual) else x[-1:]
        return self.logits(x)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The input embeddings of `tokens` (a family that scales them overrides this)."""
        return self.model.embed_tokens(tokens)

    def logits(self, x: "torch.Tensor | Residual") -> torch.Tensor:
        """The final norm and the LM head over the residual stream's rows: fp32 logits [T, vocab],
        the norm's output and the head's sums kept in fp32 whatever the model's dtype (a bf16
        rounding of logits near 25 is 0.125: near ties would flip)."""
        return self.normed_logits(add_norm(x, self.model.norm, defer=True, out_dtype=torch.float32)[1])

    def normed_logits(self, h) -> torch.Tensor:
        """The logits of rows the final norm gave (fp32 rows, or a deferred NormedRow on CUDA), as
        `logits` takes them on."""
        return self.scale_logits(head_logits(self.lm_head, h))

    def scale_logits(self, out: torch.Tensor) -> torch.Tensor:
        """The head's fp32 sums as the model's logits (a family that scales them overrides this;
        the C++ step's head rows take it too)."""
        return out
