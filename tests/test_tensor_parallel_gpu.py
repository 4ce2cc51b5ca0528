"""Tensor parallelism on 2 GPUs of one host (NCCL, the collectives inside each rank's CUDA graph):
the CPU tests' script (tests/test_tensor_parallel.py) under 2 ranks gives 1 rank's tokens, with
the graph and without, on a dense, a hybrid and an MoE hybrid checkpoint (fp32: logits within
1e-4; the ranks add partial sums in another order). Skipped where fewer than 2 GPUs exist."""
import pytest
import torch

from test_tensor_parallel import SCRIPT, dirs, drive, same_replies  # noqa: F401 - the fixture

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]


@pytest.mark.parametrize("kind", ["qwen2", "qwen3_5", "qwen3_next"])
def test_two_gpus_give_one_gpus_replies(dirs, kind, tmp_path):  # noqa: F811
    one = drive(tmp_path, dirs[kind], 1, SCRIPT, "--device", "cuda")
    for graph in ("on", "off"):
        two = drive(tmp_path, dirs[kind], 2, SCRIPT, "--device", "cuda", "--cuda-graph", graph)
        assert same_replies(one, two, 1e-4) >= 4, graph
