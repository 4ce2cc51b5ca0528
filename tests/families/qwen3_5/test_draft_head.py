"""The MTP drafts' LM head (models/architectures/mtp.py DraftHead): a draft's greedy token chosen
among the head's first rows and the ids added to it (the conversation's tokens, the stop ids).

Oracles: the whole head's logits. The chosen id is the argmax of the whole head's logits over
the prefix and the added ids (to the rounding of the kernel that computed them); the prefix's
rows are the whole head's bit for bit where they come from the same per-row kernel
(`BlockLinear.first_rows`: views, every kernel and rounding kept); a head too small to pay for it
is used whole. Replies with drafts over a reduced head: tests/families/qwen3_5/test_mtp.py."""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants

from models.architectures.layers import Linear, head_logits
from models.architectures.mtp import DraftHead
from models.quant import layers as quant
from models.quant import rows16
from tests.support.tiny_gguf import random_k_blocks

VOCAB, HIDDEN = 1024, 256


def block_head(qtype, kernels: bool, int8: bool = False, interleave: bool = False) -> quant.BlockLinear:
    if qtype == Q.Q8_0:
        w = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(2)).numpy()
        raw = quants.quantize(w, qtype)
    else:
        raw = random_k_blocks(qtype, VOCAB, HIDDEN, 0.05, seed=2)
    head = quant.BlockLinear(torch.from_numpy(raw), int(qtype))
    if kernels:
        from models.kernels.cpu import step
        step.load()
        head.fp32_kernel = torch.ops.chat_cpu.block_linear
        head.dequant_kernel = torch.ops.chat_cpu.block_dequant
        head.int8_inputs = int8
        if interleave:
            assert head.interleave()
    return head


def linear_head() -> Linear:
    head = Linear(HIDDEN, VOCAB, bias=False)
    torch.nn.init.normal_(head.weight, generator=torch.Generator().manual_seed(4))
    return head.requires_grad_(False)


def rows(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(seed))


HEADS = {
    "Q6_K-torch": lambda: block_head(Q.Q6_K, kernels=False),
    "Q6_K-kernel": lambda: block_head(Q.Q6_K, kernels=True),
    "Q6_K-int8": lambda: block_head(Q.Q6_K, kernels=True, int8=True),
    "Q8_0-rows16": lambda: block_head(Q.Q8_0, kernels=True, int8=True, interleave=True),
    "fp32": linear_head,
}


@pytest.mark.parametrize("name", HEADS)
def test_the_prefix_is_the_heads_first_rows(name):
    head = HEADS[name]()
    sub = DraftHead(head, 128).prefix
    assert sub is not None and sub.out_features == 128
    x = rows(3, 1)
    for t in range(3):  # (a draft's row at a time, as MtpDrafts asks)
        full, part = head_logits(head, x[t:t + 1]), head_logits(sub, x[t:t + 1])
        if name == "fp32":  # (torch's GEMM of fewer rows may sum in another order)
            torch.testing.assert_close(part, full[:, :128], rtol=0, atol=1e-4)
        else:
            assert torch.equal(part, full[:, :128])
    if isinstance(head, quant.BlockLinear):
        assert sub.blocks.data_ptr() == head.blocks.data_ptr()  # (a view: nothing copied)
        assert head.out_features == VOCAB and head.blocks.shape[0] == VOCAB


@pytest.mark.parametrize("name", HEADS)
def test_the_draft_is_the_argmax_over_the_prefix_and_the_added_ids(name):
    head = HEADS[name]()
    vocab = DraftHead(head, 128)
    added = [700, 5, 1000, 300, 700, 129]
    vocab.add(added)
    assert vocab.extra_ids == [700, 1000, 300, 129]  # (once each, the prefix's own ids not again)
    allowed = torch.tensor(list(range(128)) + vocab.extra_ids)
    outside = beyond = 0
    for t in range(40):
        x = rows(1, 10 + t)
        full = head_logits(head, x)[-1]
        got = vocab.greedy(x)
        assert got in allowed.tolist()
        best = int(allowed[torch.argmax(full[allowed])])
        assert full[got] >= full[best] - 1e-3 * float(full.abs().max())  # (the two kernels' rounding)
        outside += int(torch.argmax(full)) not in allowed.tolist()
        beyond += got >= 128
    assert beyond > 0  # (an added id past the prefix was chosen: its row is read)
    assert outside > 0  # (the whole head's argmax was not always allowed: the head is reduced)


def test_a_head_with_few_rows_is_used_whole():
    head = block_head(Q.Q6_K, kernels=True)
    vocab = DraftHead(head, VOCAB // 2)  # (fewer than 4x the draft rows: no reduction)
    assert vocab.prefix is None and vocab.rows == VOCAB
    vocab.add([3, 900])
    assert vocab.extra_ids == []
    for t in range(5):
        x = rows(1, 50 + t)
        assert vocab.greedy(x) == int(torch.argmax(head_logits(head, x)[-1]))
    assert DraftHead(head, None).prefix is None


def test_no_prefix_where_rows16_groups_would_split():
    head = block_head(Q.Q8_0, kernels=True, int8=True, interleave=True)
    assert head.first_rows(100) is None and head.first_rows(rows16.ROWS * 6) is not None
    assert DraftHead(head, 100).prefix is None
