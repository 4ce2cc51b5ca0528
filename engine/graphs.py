"""CUDA-graph capture and replay of the decode step and of padded prefills: recordings of the
eager forwards, nothing more.

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

Prefills (PaddedPrefill): where the model allows it (CausalLM.pads_prefill: attention KV only,
kernels that read the start from the positions), a prompt chunk of up to PREFILL_BUCKETS[-1]
tokens runs as the smallest bucket's length that holds it, pad tokens after it, and the logits
of its last real row come back; the pads' keys and values land in slots past the prompt, which
the state does not count as written. A 2k-token prefill of a 30B-A3B-like MoE queues hundreds
of launches, and the host takes about as long to queue them as the GPU to run them
(bench/decode_bench.py's prefill_queued_ms against prefill_ms), so each bucket's forward is
captured once, after its first eager run, and replayed after that: one launch. Eager or replayed, a
bucket runs the same kernels on the same shapes, so graphs on and off give the same bits. The
graphs share one memory pool (one runs at a time) and the logits are copied out of it, so no
graph's replay overwrites what another returned.
"""
from __future__ import annotations

import torch

from models.ops.serving import precompiling_now


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


# Prefill lengths a chunk is padded to: fine steps where padding would cost GPU time, powers of
# two below 256 where the host's launches dominate anyway. Longer chunks run unpadded, eager.
PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512, 768, 1024, 1280, 1536, 1792, 2048)


def prefill_bucket(n: int, room: int) -> int | None:
    """The padded length of an n-token prefill with `room` free KV slots: the smallest bucket
    that holds n and fits, or None (run it unpadded)."""
    return next((b for b in PREFILL_BUCKETS if n <= b <= room), None)


class PaddedPrefill:
    """A prefill chunk run padded to its bucket's length (the module docstring): eager, and with
    `graphs`, captured after a bucket's first eager run and replayed from then on. A capture
    that fails (an op that needs the host) ends the captures for the session (the same op would
    refuse the next bucket's): every bucket then runs eager, and `failed` says why. A Ctrl-C
    (KeyboardInterrupt) during a capture ends that capture and goes on up; the bucket captures
    after its next eager run. The graphs hold the model's and the state's tensors, which a session
    keeps for its life."""

    def __init__(self, model, state, device: torch.device, graphs: bool):
        self.model, self.state = model, state
        n = PREFILL_BUCKETS[-1]
        self.tokens = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.arange = torch.arange(n, dtype=torch.long, device=device)
        self.last = torch.zeros(1, dtype=torch.long, device=device)
        cuda = device.type == "cuda"  # (the CPU runs the padded forward eager: the tests' form)
        self.host = torch.zeros(n, dtype=torch.long, pin_memory=cuda)
        self.copied = torch.cuda.Event() if cuda else None
        self.use_graphs = graphs and cuda
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.failed: dict[int, str] = {}  # bucket -> why its capture failed
        self.replays = 0
        self._pool = None

    def __call__(self, ids: list[int], start: int, bucket: int) -> torch.Tensor:
        """The fp32 logits [1, vocab] after ids, fed at positions start.. (the caller began the
        forward of len(ids) tokens)."""
        n = len(ids)
        if self.copied is not None:
            self.copied.synchronize()  # the pinned rows' last copy has read them (not a wait for the GPU's work)
        host = self.host[:bucket]
        host[:n] = torch.tensor(ids, dtype=torch.long)
        host[n:] = 0
        self.tokens[:bucket].copy_(host, non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        torch.add(self.arange[:bucket], start, out=self.positions[:bucket])
        self.last.fill_(n - 1)
        entry = self.graphs.get(bucket)
        if entry is not None:
            entry[0].replay()
            self.replays += 1
            return entry[1].clone()
        logits = self._run(bucket)
        if self.use_graphs and not self.failed and not precompiling_now():
            self._capture(bucket)
        return logits

    def _run(self, bucket: int) -> torch.Tensor:
        return self.model(self.tokens[:bucket], self.positions[:bucket], self.state, last=self.last)

    def _capture(self, bucket: int) -> None:
        """Record the bucket's forward (nothing runs). Not torch.cuda.graph's context: where the
        capture fails, its exit would leave the capture's stream current."""
        graph, main = torch.cuda.CUDAGraph(), torch.cuda.current_stream()
        side = torch.cuda.Stream()
        side.wait_stream(main)
        error: BaseException | None = None
        with torch.cuda.stream(side):
            # thread_local: another thread's CUDA calls (a constraint's mask upload) stay legal
            graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
            try:
                logits = self._run(bucket)
            except BaseException as e:  # noqa: BLE001 (a refused op, or Ctrl-C: the capture must end either way)
                error = e
            finally:
                try:  # (a capture left open would refuse every later blocking CUDA call of this thread)
                    graph.capture_end()
                except Exception as e:  # noqa: BLE001 (invalidated by the error above)
                    error = error or e
        main.wait_stream(side)
        if error is not None and not isinstance(error, Exception):
            raise error  # Ctrl-C: not the bucket's fault
        if error is not None:
            why = str(error).strip()
            self.failed[bucket] = why.splitlines()[0][:200] if why else type(error).__name__
            return
        self._pool = graph.pool()
        self.graphs[bucket] = (graph, logits)
