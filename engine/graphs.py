"""CUDA-graph capture and replay of the decode step: a recording of the eager step, nothing more.

The captured call is exactly the eager decode call, `model(tokens, positions, state)` with
`state.kv_len = decode_kv_len(position)`. Where the model's attention is the Triton kernel (it
reads the live length from `positions`: CausalLM.decode_attends_live) there is one bucket,
max_context, and one graph for every position. Otherwise (CHAT_TRITON=0, head sizes the kernel
does not take, compile: on) the torch attention reads a fixed number of key slots (the ones past
the position masked), chosen from a few buckets (powers of two from 512 up to max_context, one
for a compiled step), so a short conversation in a large context does not read all of it: one
graph per bucket, captured together at start (sharing one memory pool). The eager CUDA step uses
the same buckets, so both run the same kernels. Inputs live in static buffers; state tensors are the
StateManager's own, never rebound, so `reset()` (in-place zeroing) needs no re-capture. Warm-up and
capture run at the next free position and the fixed state is restored afterwards: they leave no
trace in live state.
"""
from __future__ import annotations

import torch


SMALLEST_BUCKET = 512


def kv_buckets(max_context: int, single: bool = False) -> list[int]:
    """Key-slot counts a decode step may attend over: 512, 1024, … below max_context, then
    max_context. `single`: max_context only (a compiled step would recompile per count)."""
    out, b = [], SMALLEST_BUCKET
    while not single and b < max_context:
        out.append(b)
        b *= 2
    return out + [max_context]


def decode_kv_len(position: int, buckets: list[int]) -> int:
    """The smallest bucket that holds the slot at `position`."""
    return next(b for b in buckets if b > position)


class GraphedDecodeStep:
    def __init__(self, model, state, device: torch.device, buckets: list[int]):
        self.model, self.state, self.buckets = model, state, buckets
        self.tokens = torch.zeros(1, dtype=torch.long, device=device)
        self.positions = torch.zeros(1, dtype=torch.long, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture()

    @torch.inference_mode()
    def capture(self) -> None:
        """(Re)capture explicitly; only needed if the model's weights or state are reallocated."""
        state = self.state
        if state.length >= state.max_context:
            raise RuntimeError("cannot capture the decode step on a full context")
        saved = state.snapshot()
        self.positions.fill_(state.length)  # the next free slot: its KV write is inert until committed
        self.graphs, pool = {}, None
        for kv_len in self.buckets:
            state.begin_forward(1, kv_len)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # warm-up: lazy initialisation must not happen during capture
                    self.model(self.tokens, self.positions, state)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):  # one pool: only one bucket ever runs at a time
                logits = self.model(self.tokens, self.positions, state)
            pool = graph.pool()
            self.graphs[kv_len] = (graph, logits)
        state.restore(saved)  # undo the warm-up's writes into fixed state
        torch.cuda.synchronize()

    def __call__(self, token: "int | torch.Tensor", position: int) -> torch.Tensor:
        """Replay the graph of the bucket the session chose (state.kv_len, set by begin_forward).
        `token`: an id, or a 1-element int64 tensor on the device (copied in stream order: the
        host need not know it yet)."""
        graph, logits = self.graphs[self.state.kv_len]
        if isinstance(token, torch.Tensor):
            self.tokens.copy_(token.view(1))
        else:
            self.tokens.fill_(token)
        self.positions.fill_(position)
        graph.replay()
        return logits
