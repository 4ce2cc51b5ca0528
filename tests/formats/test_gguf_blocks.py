"""models/formats/gguf_blocks.py: each type's torch dequantization equals gguf-py's bit for bit
(fp32 bit patterns compared, so -0.0 and +0.0 count as different) on random blocks whose fp16
scales include the extremes: zeros of both signs, the smallest and largest subnormals, the
smallest normal, the largest finite value, negatives."""
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize as gguf_dequantize

from models.formats import gguf_blocks
from tests.support.blocks import QUANTIZED, bits, random_blocks
from tests.support.blocks import FP16_AT


@pytest.mark.parametrize("qtype", QUANTIZED + [Q.F16, Q.BF16], ids=lambda t: t.name)
def test_layouts_agree_with_gguf(qtype):
    layout = gguf_blocks.LAYOUTS[int(qtype)]
    assert (layout.block, layout.bytes) == GGML_QUANT_SIZES[qtype] and layout.name == qtype.name


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda t: t.name)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dequantize_equals_gguf_bit_for_bit(qtype, seed):
    per_row = 12 if GGML_QUANT_SIZES[qtype][0] == 32 else 3
    raw = random_blocks(qtype, rows=7, blocks_per_row=per_row, seed=seed)
    want = np.asarray(gguf_dequantize(raw, qtype), dtype=np.float32)
    got = gguf_blocks.dequantize(torch.from_numpy(raw), int(qtype))
    assert got.dtype == torch.float32 and tuple(got.shape) == want.shape
    assert torch.equal(bits(got), bits(torch.from_numpy(want)))
    assert torch.isfinite(got).all()


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda t: t.name)
def test_extreme_scales_reach_the_weights(qtype):
    """The largest fp16 scale in every field (and every sub-scale byte 0xFF): weights near 4e6 and
    the K-quants' scale products, still exact; then the smallest subnormal everywhere."""
    raw = random_blocks(qtype, rows=4, blocks_per_row=2, seed=9)
    blocks = raw.reshape(4, 2, -1)
    scales = slice(4, 16) if qtype != Q.Q6_K else slice(192, 208)
    blocks[:, :, scales] = 0xFF if qtype != Q.Q6_K else 0x81  # Q6_K: int8 -127
    for value, check in ((0x7BFF, lambda w: float(w.abs().max()) > 1e6),
                         (0x0001, lambda w: float(w.abs().max()) < 1e-3)):
        for at in FP16_AT[qtype]:
            blocks[:, :, at:at + 2] = np.array([value], dtype=np.uint16).view(np.uint8)
        want = np.asarray(gguf_dequantize(raw, qtype), dtype=np.float32)
        got = gguf_blocks.dequantize(torch.from_numpy(raw), int(qtype))
        assert torch.equal(bits(got), bits(torch.from_numpy(want))) and check(got)


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16], ids=lambda t: t.name)
def test_float_types_equal_gguf(qtype):
    rng = np.random.default_rng(4)
    if qtype == Q.F32:
        raw = rng.standard_normal((3, 40)).astype(np.float32).view(np.uint8)
    else:
        raw = rng.integers(0, 256, (3, 80), dtype=np.uint8)
        h = raw.view(np.uint16)
        raw = np.where((h & 0x7C00 if qtype == Q.F16 else h & 0x7F80) == (0x7C00 if qtype == Q.F16 else 0x7F80),
                       h & 0xBFFF, h).astype(np.uint16).view(np.uint8)
    want = np.asarray(gguf_dequantize(raw.view(np.float32) if qtype == Q.F32 else
                                      (raw.view(np.float16) if qtype == Q.F16 else raw), qtype), dtype=np.float32)
    got = gguf_blocks.dequantize(torch.from_numpy(raw), int(qtype))
    assert torch.equal(bits(got), bits(torch.from_numpy(want.reshape(got.shape))))


def test_leading_dimensions_and_views():
    """[..., row bytes] in any leading shape, and a row-sliced (offset) view, dequantize the same."""
    raw = torch.from_numpy(random_blocks(Q.Q5_K, rows=6, blocks_per_row=2, seed=3))
    flat = gguf_blocks.dequantize(raw, int(Q.Q5_K))
    assert torch.equal(gguf_blocks.dequantize(raw.reshape(2, 3, -1), int(Q.Q5_K)), flat.reshape(2, 3, -1))
    assert torch.equal(gguf_blocks.dequantize(raw[3:], int(Q.Q5_K)), flat[3:])


def test_unsupported_and_malformed_inputs_are_one_line_errors():
    with pytest.raises(ValueError, match="IQ2_XXS"):
        gguf_blocks.dequantize(torch.zeros(1, 66, dtype=torch.uint8), int(Q.IQ2_XXS))
    with pytest.raises(ValueError, match="not whole 18-byte blocks"):
        gguf_blocks.dequantize(torch.zeros(1, 20, dtype=torch.uint8), int(Q.Q4_0))
