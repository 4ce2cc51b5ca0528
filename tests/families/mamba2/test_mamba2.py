"""The Mamba2 scan's three forms agree: chunked (prefill) and step (decode) against the naive oracle."""
import pytest
import torch

from models.architectures import mamba2


@pytest.mark.parametrize("T", [1, 2, 31, 63, 64, 65, 129])
@pytest.mark.parametrize("groups", [1, 2])
def test_chunked_equals_naive_from_nonzero_state(T, groups):
    x, dt, A, B, C, D, s0 = mamba2.example_inputs(T, 4, 8, 16, groups, seed=T)
    s_naive, s_chunk = s0.clone(), s0.clone()
    y_naive = mamba2.naive(x, dt, A, B, C, D, s_naive)
    y_chunk = mamba2.chunked(x, dt, A, B, C, D, s_chunk, chunk=16)
    assert (y_naive - y_chunk).abs().max() <= 1e-4 and (s_naive - s_chunk).abs().max() <= 1e-5
    assert s_naive.abs().max() > 0.5  # the state is live: inputs moved it far from its 0.1 scale


@pytest.mark.parametrize("groups", [1, 2])
def test_steps_equal_naive_from_nonzero_state(groups):
    x, dt, A, B, C, D, s0 = mamba2.example_inputs(7, 4, 8, 16, groups, seed=3)
    s_naive, s_step = s0.clone(), s0.clone()
    y_naive = mamba2.naive(x, dt, A, B, C, D, s_naive)
    y_step = torch.cat([mamba2.step(x[t:t + 1], dt[t:t + 1], A, B[t:t + 1], C[t:t + 1], D, s_step)
                        for t in range(7)])
    assert (y_naive - y_step).abs().max() <= 1e-5 and (s_naive - s_step).abs().max() <= 1e-5


def test_chunked_then_steps_continue_one_stream():
    """A prefill split at odd points, then decode steps, equals one naive pass over it all."""
    x, dt, A, B, C, D, s0 = mamba2.example_inputs(90, 4, 8, 16, 2, seed=9)
    s_ref, s = s0.clone(), s0.clone()
    ref = mamba2.naive(x, dt, A, B, C, D, s_ref)
    parts = []
    for a, b in [(0, 13), (13, 14), (14, 79), (79, 87)]:
        parts.append(mamba2.chunked(x[a:b], dt[a:b], A, B[a:b], C[a:b], D, s, chunk=16))
    for t in range(87, 90):
        parts.append(mamba2.step(x[t:t + 1], dt[t:t + 1], A, B[t:t + 1], C[t:t + 1], D, s))
    assert (torch.cat(parts) - ref).abs().max() <= 1e-4 and (s - s_ref).abs().max() <= 1e-5
