"""The bf16 one-token GEMV's configs (models/kernels/cuda/linear.pick_config): which matrices are read
in one prefetched K step, and the K steps of long rows. Pure Python: no GPU or Triton needed (the
kernel's results under each config: tests/engine/test_gpu.py)."""
from __future__ import annotations

import pytest

from models.kernels.cuda import linear


@pytest.mark.parametrize("K,N", [(2048, 8192), (1024, 3584), (896, 4864), (2048, 16384), (4096, 2048),
                                 (3072, 3072)])
def test_one_k_step_only_for_weights_up_to_the_bound_counting_a_pairs_up_rows(K, N):
    """A SwiGLU pair's launch reads its N gate rows and N up rows: its bytes count both (LFM2-1.2B's
    [2 x 8192, 2048] pair, 64 MiB, read in one step by its gate rows' 32 MiB, ran at 2.8 TB/s
    against 3.8 streamed: bench/RESULTS.md set AI)."""
    for pair in (False, True):
        bn, bk, warps = linear.pick_config(K, N, pair)
        whole = bk >= K
        assert whole == (N * K * 2 * (2 if pair else 1) <= linear.WHOLE_K_MAX_BYTES)


@pytest.mark.parametrize("K,N", [(8192, 2048), (4864, 896), (5120, 640), (6000, 2050), (17408, 1024)])
def test_rows_too_long_to_read_whole_take_long_k_steps(K, N):
    """Few rows of over 4,096 weights (a down projection): steps that give each thread at least
    8 weights (16 bytes) a step, not the 2 of steps of 128 (LFM2-1.2B's down 8.6 against 12.6 us,
    Qwen2.5-0.5B's 3.3 against 5.4: set AI)."""
    bn, bk, warps = linear.pick_config(K, N)
    assert bk < K and bn * bk // (32 * warps) >= 8
