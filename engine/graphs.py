"""CUDA-graph capture and replay of the decode step: a recording of the eager step, nothing more.

The captured call is exactly the eager decode call, `model(tokens, positions, state)` with
`state.kv_len = max_context` (the eager CUDA step uses the same kv_len, so both run the same
kernels). Inputs live in static buffers; state tensors are the StateManager's own, never
rebound, so `reset()` (in-place zeroing) needs no re-capture. Warm-up and capture run at the
next free position and the fixed state is restored afterwards: they leave no trace in live state.
"""
from __future__ import annotations

import torch


class GraphedDecodeStep:
    def __init__(self, model, state, device: torch.device):
        self.model, self.state = model, state
        self.tokens = torch.zeros(1, dtype=torch.long, device=device)
        self.positions = torch.zeros(1, dtype=torch.long, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        self.capture()

    @torch.inference_mode()
    def capture(self) -> None:
        """(Re)capture explicitly; only needed if the model's weights or state are reallocated."""
        state = self.state
        if state.length >= state.max_context:
            raise RuntimeError("cannot capture the decode step on a full context")
        saved = state.snapshot()
        self.positions.fill_(state.length)  # the next free slot: its KV write is inert until committed
        state.begin_forward(1, state.max_context)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up: lazy initialisation must not happen during capture
                self.model(self.tokens, self.positions, state)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.logits = self.model(self.tokens, self.positions, state)
        self.graph = graph
        state.restore(saved)  # undo the warm-up's writes into fixed state
        torch.cuda.synchronize()

    def __call__(self, token: int, position: int) -> torch.Tensor:
        self.tokens.fill_(token)
        self.positions.fill_(position)
        self.graph.replay()
        return self.logits
