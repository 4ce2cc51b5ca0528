"""The slow oracle: full recompute with no cache reuse, the ground truth for tests.

Every call builds a fresh StateManager sized to the sequence and runs one forward over all
tokens, so nothing cached, rewound or captured can influence the result.
"""
from __future__ import annotations

import torch

from .state import StateManager


@torch.inference_mode()
def full_logits(model, tokens: list[int], device="cpu", dtype=torch.float32) -> torch.Tensor:
    """Logits [T, vocab] for every position of `tokens`, computed from scratch."""
    state = StateManager(model.state_spec(), len(tokens), torch.device(device), dtype, checkpoint_budget=0)
    state.begin_forward(len(tokens))
    ids = torch.tensor(tokens, dtype=torch.long, device=device)
    return model(ids, torch.arange(len(tokens), device=device), state, all_logits=True)


def greedy(model, prompt: list[int], n_new: int, stop_ids=(), device="cpu", dtype=torch.float32) -> list[int]:
    """Greedy continuation by full recompute at every step."""
    seq, out = list(prompt), []
    for _ in range(n_new):
        token = int(full_logits(model, seq, device, dtype)[-1].argmax())
        out.append(token)
        if token in stop_ids:
            break
        seq.append(token)
    return out
