"""Prefill's dequantized weights, each made on a side stream while the GEMM before it runs.

A quantized linear's many-row CUDA form dequantizes its matrix to the compute dtype, then runs
torch's GEMM on it (formats/quant.py, QuantLinear.cuda_forward). The GEMM is bound by the tensor
cores and the dequantization by memory, so the two can run at once: each linear notes which
linear took this path after it, and in which dtype (its successor: a model's forward meets its
linears in the same order every time), and before its own GEMM starts its successor's dequantization on a side
stream, into a buffer of its own. The successor takes that buffer where it is its own (the same
module and dtype), after the side stream's event; any other linear waits for that event too (so
no buffer is freed while the side stream writes it), drops the buffer and dequantizes its own on
the compute stream, as before.

Contract: `weight(linear, qw, dtype, dequantize)` returns `dequantize(qw, 0, qw.n, dtype)`, the
same bits (the same kernel writes them; only the stream differs), ready for the compute stream's
next launch. At most one buffer is made ahead (the next linear's matrix); it outlives a forward
that ends before its successor runs (the model's first linear, made by the last: held until the
next prefill, or `release()`). Nothing is made ahead, nor taken, while the stream captures a
CUDA graph (an event recorded outside it cannot be waited on inside). `AHEAD = False` turns the
side stream off (bench/ab_prefill.py's A/B).
"""
from __future__ import annotations

import weakref

import torch

# Dequantize the next linear's matrix on a side stream during this one's GEMM (bench/RESULTS.md set Q)
AHEAD = True

# linear -> (the linear whose whole-matrix GEMM came next, the dtype it took)
_successor: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()
_last: weakref.ref | None = None
# (the linear it is for, dtype, buffer, event recorded on the side stream after the dequantization)
_ahead: tuple[weakref.ref, torch.dtype, torch.Tensor, torch.cuda.Event] | None = None
_streams: dict[torch.device, torch.cuda.Stream] = {}
# buffers made ahead, and those taken by the linear they were made for (the tests read them)
counts = {"made": 0, "taken": 0}


def weight(linear: torch.nn.Module, qw, dtype: torch.dtype, dequantize) -> torch.Tensor:
    """`linear`'s whole matrix (QWeight `qw`) in `dtype` for its GEMM on the current stream:
    the buffer made ahead for it, or `dequantize(qw, 0, qw.n, dtype)` now; then its successor's
    (in the dtype it last took) started on the side stream, where AHEAD and the successor is known."""
    global _last, _ahead
    if torch.cuda.is_current_stream_capturing():
        return dequantize(qw, 0, qw.n, dtype)
    w = _take(linear, dtype)
    prev = _last() if _last is not None else None
    if prev is not None and prev is not linear:
        _successor[prev] = (weakref.ref(linear), dtype)
    _last = weakref.ref(linear)
    if w is None:
        w = dequantize(qw, 0, qw.n, dtype)
    ref, want = _successor.get(linear, (None, None))
    nxt = ref() if ref is not None else None
    if AHEAD and nxt is not None and nxt is not linear and nxt.whole_prefill():
        nq = nxt.qweight()
        if nq.data.device == qw.data.device:
            buf = torch.empty(nq.n, nq.k, dtype=want, device=qw.data.device)
            side = _side(qw.data.device)
            side.wait_stream(torch.cuda.current_stream(qw.data.device))  # (buf's memory: free once that work is done)
            with torch.cuda.stream(side):
                dequantize(nq, 0, nq.n, want, buf)
                ev = torch.cuda.Event()
                ev.record(side)
            _ahead = (weakref.ref(nxt), want, buf, ev)
            counts["made"] += 1
    return w


def release() -> None:
    """Drop the buffer made ahead (after its side stream's work), and the order learned."""
    global _ahead, _last
    if _ahead is not None:
        torch.cuda.current_stream(_ahead[2].device).wait_event(_ahead[3])
    _ahead, _last = None, None
    _successor.clear()


def _take(linear, dtype) -> torch.Tensor | None:
    global _ahead
    if _ahead is None:
        return None
    ref, want, buf, ev = _ahead
    _ahead = None
    torch.cuda.current_stream(buf.device).wait_event(ev)
    if ref() is not linear or want != dtype:
        return None
    counts["taken"] += 1
    return buf


def _side(device: torch.device) -> torch.cuda.Stream:
    if device not in _streams:
        _streams[device] = torch.cuda.Stream(device=device)
    return _streams[device]
