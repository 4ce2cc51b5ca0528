"""DecodeSession: one persistent decode state, reused across generations.

`generate(prompt_ids, sampling)` brings the state to the longest reusable prefix of the prompt
(through the StateManager: a KV rewind, or a reset where fixed recurrent state cannot rewind),
prefills the rest, then decodes, yielding token ids. Each forward commits its tokens only when
it completes, so interrupting a generation (Ctrl-C, closing the generator) leaves the state
consistent with `cached`. With `forced` ids (a teacher-forced replay) it feeds and yields those
instead of its choices, and lists in `last_stats.departures` each step where its sampler chose
otherwise. The engine knows token ids only, never text.

Pipelined greedy decode (CUDA graph, pure-KV models, argmax draws without penalties, no forced
ids, format mask or tensor-parallel link): each step is queued with the previous argmax still on
the device, before the host has read it, so the GPU does not idle while the host reads a token,
yields it and launches the next replay. Where the token read turns out to end the reply (a stop
id), the step queued ahead is unfed (`StateManager.unfeed`): the state, `cached` and the written
slots are then what the step-by-step loop leaves, and the tokens are the same ids (the same
argmax over the same logits). A step goes ahead only where no slot above the length is written
(after a whole-prompt reuse, an earlier reply's slots are, until this reply's first step). It is
a hook of the one generation loop (`_decode`'s `ahead`): the step queued ahead counts as rows fed
past the plain loop, as speculation's drafts do. `DecodeSession.PIPELINE_GREEDY = False` turns it
off.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from .config import ConfigError, SamplingConfig
from .constraint import ConstraintMask, TokenConstraint
from .graphs import PREFILL_BUCKETS, GraphedDecodeStep, PaddedPrefill, decode_kv_len, kv_buckets, prefill_bucket
from .link import Interrupted
from .sampling import SAMPLER_VERSION, make_sampler, resolve_seed
from . import steps
from .speculative import Depth, Drafts, MtpDrafts, PromptLookup
from .state import BASE, PROMPT, StateManager


# PAD_PREFILL False: prefills run at their own length, eager (as before PaddedPrefill);
# PREFILL_GRAPHS False: padded, but never captured (a benchmark or a test sets them to compare)
PAD_PREFILL = True
PREFILL_GRAPHS = True



def _cpu_isa_label() -> str:
    """What the C++ CPU library is built for, in words (models.cpu_isa_label; asked only by /show)."""
    from models import cpu_isa_label
    return cpu_isa_label()

class ContextOverflow(ValueError):
    """The prompt does not leave room for a single new token."""


class ReuseMismatch(RuntimeError):
    """verify_reuse: the logits after a cache reuse differ from a cold prefill's."""


@dataclass(frozen=True)
class Departure:
    """A teacher-forced step where the sampler chose `chosen` but `forced` was fed; `forced` None:
    the forced ids ended where the generation would have gone on. Log-probabilities are the
    sampler's (`log_probs`: after penalties and temperature, before truncation)."""
    index: int
    chosen: int
    forced: int | None
    logp_chosen: float
    logp_forced: float | None


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    reused_tokens: int = 0
    generated_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    finish_reason: str = ""  # stop | length | context | interrupted | forced (the forced ids ran out)
    seed: int = 0
    departures: list[Departure] = field(default_factory=list)
    drafted: int = 0  # speculative decoding: draft tokens verified,
    accepted: int = 0  # of which kept,
    verifies: int = 0  # in this many forwards

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def prefilled_tokens(self) -> int:
        return self.prompt_tokens - self.reused_tokens

    @property
    def decode_tps(self) -> float:
        steps = max(self.generated_tokens - 1, 0)
        return steps / self.decode_seconds if self.decode_seconds > 0 else 0.0

    @property
    def prefill_tps(self) -> float:
        return self.prefilled_tokens / self.prefill_seconds if self.prefill_seconds > 0 else 0.0


def on_cuda(device: torch.device) -> bool:
    """Whether the CUDA-only pieces of a session apply (bucketed decode, the kernel precompile, the
    graph): the one predicate, so that a CPU test can run the CUDA construction order with only
    the device-specific pieces stubbed (tests/engine/test_session_cuda_order.py)."""
    return device.type == "cuda"


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class _Ahead:
    """The pipelined decode's tokens in flight (DecodeSession._decode's `ahead`): each argmax stays
    on the device, where the step queued next reads it, while its copy to the host completes, in
    one of two pinned slots by turns (the token being read, and the one its step chose)."""

    def __init__(self, sampler, device: torch.device):
        cuda = device.type == "cuda"
        self.sampler = sampler
        self.host = torch.empty(2, dtype=torch.long, pin_memory=cuda)
        self.ready = (torch.cuda.Event(), torch.cuda.Event()) if cuda else None
        self.slot = 0
        self.chosen: torch.Tensor | None = None  # the draw in `slot`, on the device

    def _draw(self, row: torch.Tensor, slot: int) -> torch.Tensor:
        d = self.sampler.device_choice(row)
        self.host[slot].copy_(d, non_blocking=True)
        if self.ready is not None:
            self.ready[slot].record()
        return d

    def choose(self, row: torch.Tensor) -> None:
        """The first draw, from the prompt's last row."""
        self.chosen = self._draw(row, self.slot)

    def choose_next(self, row: torch.Tensor) -> None:
        """The draw from the row of the step that fed `chosen`, into the other slot."""
        self._next = self._draw(row, 1 - self.slot)

    def read(self) -> int:
        """`chosen` on the host (waits for its copy)."""
        if self.ready is not None:
            self.ready[self.slot].synchronize()
        return int(self.host[self.slot])

    def turn(self) -> None:
        """The next draw becomes the one read next."""
        self.chosen, self.slot = self._next, 1 - self.slot


class DecodeSession:
    # Prefill chunk: on the CPU it bounds the attention scores' memory; on CUDA one chunk keeps a
    # prompt from position 0 on the flash (is_causal) path, as HF runs it.
    PREFILL_CHUNK = {"cpu": 512, "cuda": 8192}
    PIPELINE_GREEDY = True  # (the module docstring; bench/ab_decode.py's nopipeline variant)

    def __init__(self, model, *, max_context: int, device: torch.device, dtype: torch.dtype,
                 eos_ids: tuple[int, ...] = (), cuda_graph: str = "auto", compile: str = "off",
                 cpu_kernel: str = "auto", checkpoint_mib: int | str = "auto", checkpoint_host_mib: int | str = "auto",
                 verify_reuse: bool = False, link=None, speculative: str = "off"):
        """link: this rank's side of a tensor-parallel group (engine/tensor_parallel.py), or None.
        speculative: auto | off | lookup | mtp (`set_speculative`)."""
        self.model = model
        self.link = link
        self.device, self.dtype = device, dtype
        self.max_context = min(max_context, model.max_position)
        self.verify_reuse = verify_reuse
        self.eos_ids = tuple(eos_ids)
        self._ids: list[int] = []  # the tokens in the written KV slots (state.written of them)
        # speculative decoding (set_speculative, at the end: before it, forwards run without drafts)
        self.speculative = "off"
        self.speculative_note = ""  # why speculation does not run, where it was asked for
        self._mtp: MtpDrafts | None = None  # the MTP layer's drafts, where they run
        self._generation = 0  # generate() calls so far
        self.last_stats = GenerationStats()
        self._device_masks: dict = {}  # output-format masks: CUDA buffers and graphs (engine/constraint.py)
        self.vocab_size = model.config.vocab_size
        # On CUDA the decode step attends over a fixed bucket of slots (masked past the position),
        # eager or graphed, so a graph is a recording of the very same eager step. On the CPU: over
        # the live slots only. One bucket where the Triton attention reads the live length itself,
        # and for a compiled step (each bucket would be a recompile).
        cuda = on_cuda(device)
        self._bucketed_decode = cuda
        live = getattr(model, "decode_attends_live", None)
        self._attends_live = live is not None and live(device, dtype)
        self._compiled = compile == "on"
        single = self._compiled or self._attends_live
        self._kv_buckets = kv_buckets(self.max_context, single=single)
        if cuda_graph == "on" and not cuda:
            raise ConfigError("cuda_graph: 'on' needs a CUDA device; use auto or off on the CPU")
        # The decode step, chosen once (engine/steps.py): the model, its compiled form or the C++ step
        step = steps.choose(model, device, dtype, compile=compile, cpu_kernel=cpu_kernel)
        self._step_fn, self.cpu_kernel_note = step.fn, step.note
        # the attention caches in the step's dtype where it keeps them narrower (the C++ step over
        # 4-bit weights: fp16, half the bytes a long context's step reads)
        mib = lambda v: v if v == "auto" else v << 20  # noqa: E731
        self.state = StateManager(model.state_spec(), self.max_context, device, dtype,
                                  vocab_size=model.config.vocab_size, checkpoint_budget=mib(checkpoint_mib),
                                  host_budget=mib(checkpoint_host_mib),
                                  kv_dtype=step.kv_dtype,
                                  masked_reads=self._bucketed_decode,
                                  agree=None if link is None else link.agree_min)
        # Prefill chunks padded to length buckets (engine/graphs.py), graphed where the decode step
        # is; graphs off pads the same (the same kernels: the same bits). Not for a tensor-parallel
        # rank (its collectives) or a compiled model. Set before any forward (the precompile's pads).
        self._padded = None
        pads = getattr(model, "pads_prefill", None)
        if (PAD_PREFILL and cuda and link is None and compile == "off" and pads is not None
                and pads(device, dtype, self.state.kv_dtype)):
            self._padded = PaddedPrefill(model, self.state, device,
                                         graphs=cuda_graph in ("on", "auto") and PREFILL_GRAPHS)
        if step.compiled and not cuda:
            self._compile_now()  # (CUDA's compiles at the graph's warm-up)
        # Before any forward: _forward reads it (the throwaway forwards below run eager steps).
        self.graph = None
        if cuda and compile == "off":
            self._precompile()
        if cuda_graph in ("on", "auto") and cuda:
            self.graph = GraphedDecodeStep(self._step_fn, self.state, device, self._kv_buckets)
        self._spec_checked: bool | None = None  # the verify's self-check: passed, failed, not yet run
        self._depth = Depth()  # the depth rule (engine/speculative.py)
        self._drafter = None  # a drafter factory (prompt, expected) in place of the setting's (tests, benches)
        self.set_speculative(speculative)

    def _throwaway_forwards(self, steps: int) -> None:
        """A 2-token prefill (any length > 1 runs the kernels every prompt runs: none specializes
        on it; torch.compile's specializations stop at 1) and `steps` decode steps, then a reset,
        which leaves the state as construction did: the compiles at start need them."""
        try:
            self.prefill([0, 0])
            for _ in range(steps):
                self.step(0)
        finally:
            self.reset()

    def _precompile(self) -> None:
        """Compile the kernels of a prefill and of a decode step side by side, before the graph's
        warm-up (or the first prompt) would compile them one after another: throwaway forwards
        inside the model's kernel_precompile context, where kernels compile rather than run. The
        torch ops among them ran on what the skipped kernels left in their outputs: the KV slots
        they may have written are zeroed (the reset zeroes the fixed state)."""
        ctx = getattr(self.model, "kernel_precompile", lambda *_: None)(self.device, self.dtype)
        if ctx is None or self.max_context < 3:  # (no room: they compile when first run)
            return
        with ctx:
            self._throwaway_forwards(1)
        # the slots they wrote: 3, or where the prefill ran padded its bucket's
        self.state.scrub_kv(max(3, prefill_bucket(2, self.max_context) or 0) if self._padded is not None else 3)

    # --- speculative decoding -------------------------------------------------------------------
    def speculation_unavailable(self) -> str:
        """Why this session cannot verify drafts exactly ("" where it can)."""
        if getattr(self._step_fn, "verify", None) is None:
            if on_cuda(self.device):
                return "no exact multi-token verify on CUDA yet (the C++ CPU step has one)"
            return ("no exact multi-token verify for this decode path (the C++ CPU step of the dense "
                    "GQA models, LFM2 and the DeltaNet and Mamba2 hybrids has one)")
        if self.state.has_fixed_state and getattr(self._step_fn, "fixed_after", None) is None:
            return "this model's recurrent state has no rollback of rejected drafts yet"
        if self.link is not None:
            return "a tensor-parallel rank decodes step by step"
        if self._spec_checked is False:
            return "the verify's rows differ from single steps on this machine (self-check)"
        return ""

    @property
    def has_mtp(self) -> bool:
        """Whether the model holds a multi-token-prediction layer (models/architectures/mtp.py)."""
        return getattr(self.model, "mtp", None) is not None

    def set_speculative(self, mode: str) -> None:
        """auto: prompt-lookup drafts where the verify is exact (else off, `speculative_note` says
        why); lookup: the same, required (ConfigError where unavailable); mtp: prompt lookup where
        the context repeats itself and the model's MTP layer elsewhere, required; off. auto leaves
        the MTP layer out: the only exact verify is the CPU's, where a draft's pass over the LM head
        costs more than its tokens save on the measured shapes (bench/spec_bench.py --mtp). The
        first time drafts could run, a self-check compares a verify's rows with single steps bit
        for bit (`_self_check`)."""
        if mode not in ("auto", "off", "lookup", "mtp"):
            raise ConfigError(f"speculative: {mode!r} is not valid; allowed: auto | off | lookup | mtp")
        why = "" if mode == "off" else self.speculation_unavailable()
        if not why and mode != "off" and self._spec_checked is None:
            self._spec_checked = self._self_check()
            why = self.speculation_unavailable() if self._spec_checked is not None else \
                "no room in the context for the verify's self-check"
        if why and mode in ("lookup", "mtp"):
            raise ConfigError(f"speculative: {mode} is unavailable here ({why}); use auto or off")
        if mode == "mtp" and not self.has_mtp:  # (where drafts could run: a dense hybrid on the CPU)
            raise ConfigError("speculative: mtp needs a model with a multi-token-prediction layer (this "
                              "checkpoint has no mtp.* / nextn weights); use auto, lookup or off")
        was = self._mtp_on
        self.speculative = mode
        self.speculative_note = why if mode == "auto" else ""
        if self.speculating and mode == "mtp" and self._mtp is None:
            self._mtp = MtpDrafts(self.model, self.max_context, self.device, self.state.kv_dtype, self.eos_ids)
        if self._mtp_on and not was:
            self._mtp.forget(self.state.length)  # (the rows fed while it was off are not known)

    @property
    def _mtp_on(self) -> bool:
        """Whether this session's drafts may come from the MTP layer now."""
        return self._mtp is not None and self.speculating and self.speculative == "mtp"

    def _drafts(self, prompt: list[int], expected: list[int] | None) -> Drafts:
        cached = lambda: self._ids[:self.state.length]  # noqa: E731
        if self._drafter is not None:
            return Drafts(self._drafter(prompt, expected), None, cached)
        return Drafts(PromptLookup(prompt, expected), self._mtp if self._mtp_on else None, cached)

    @property
    def speculating(self) -> bool:
        return self.speculative != "off" and not self.speculative_note

    @property
    def speculation_text(self) -> str:
        """The speculative setting and what it does here, in words (/show)."""
        if self.speculative == "off":
            return "off"
        if self.speculative_note:
            return f"{self.speculative}: off here ({self.speculative_note})"
        d = self._depth
        source = "prompt-lookup drafts"
        if self._mtp_on:
            vocab = self._mtp.vocab
            source += ", else the MTP layer's" + (
                f" (chosen among the head's first {vocab.rows:,} rows and the conversation's tokens)"
                if vocab.prefix is not None else "")
        return (f"{self.speculative}: {source}, up to {d.max_depth} a verify, depth from the "
                f"measured acceptance ({d.acceptance:.0%}) and verify cost")

    def _self_check(self, rows: int = 4) -> bool | None:
        """Whether a verify of `rows` tokens gives, bit for bit, the logits `rows` steps give after
        the cached tokens (the step's contract, checked on this machine's kernels), or None where
        the context has no room. Both are unfed after (fixed state: its copy from before put
        back), the state as it was; the slots above it no longer count as written."""
        n0 = self.state.length
        if n0 + rows > self.max_context:
            return None
        ids = [(7 * i + 3) % self.vocab_size for i in range(rows)]
        before = self.state.snapshot().fixed
        try:
            steps = torch.stack([self.step(t)[-1] for t in ids])
            fixed = [t.clone() for t in self.state.fixed_tensors()]
            self.state.unfeed(self.state.length - n0, before)
            verified = self._forward(ids, verify=True)
            return bool(torch.equal(steps, verified)) and all(
                torch.equal(a, b) for a, b in zip(fixed, self.state.fixed_tensors()))
        finally:
            self.state.unfeed(self.state.length - n0, before)
            del self._ids[n0:]

    @property
    def decode_path(self) -> str:
        """What runs a decode step, in words (the REPL's /show)."""
        if self.graph is not None:
            return "CUDA graph of the eager step" + (" (Triton kernels)" if self._attends_live else "")
        rounded = self._rounded_inputs()
        if self._step_fn is self.model:
            if not getattr(self.model, "cpu_block_kernels", False):
                blocks = ""
            else:
                blocks = f" with GGUF blocks through the C++ per-linear kernels (built for {_cpu_isa_label()})" \
                    + (f" {rounded}" if rounded else "")
            return "torch (eager)" + blocks + (f"; {self.cpu_kernel_note}" if self.cpu_kernel_note else "")
        if self._compiled:
            return "torch.compile"
        return "C++ step (cpu_kernel)" + (f", its GGUF blocks {rounded}" if rounded else "") \
            + f"; built for {_cpu_isa_label()}"

    def _rounded_inputs(self) -> str:
        """How the CPU kernels round a GGUF block product's inputs, in words; "" where they take
        fp32 (cpu_int8 off)."""
        if not getattr(self.model, "cpu_int8", False):
            return ""
        return "on 16-bit inputs (cpu_int8: wide)" if getattr(self.model, "cpu_wide", False) else "on int8 inputs (cpu_int8)"

    @property
    def prefill_path(self) -> str:
        """What runs a prefill chunk, in words (the REPL's /show)."""
        p = self._padded
        if p is None:
            return "eager, at the prompt's length"
        lo, hi = PREFILL_BUCKETS[0], PREFILL_BUCKETS[-1]
        if p.failed:
            bucket, why = next(iter(p.failed.items()))
            return (f"eager, padded to a length bucket ({lo}-{hi} tokens; longer chunks unpadded): not "
                    f"capturable as a CUDA graph (the {bucket}-token bucket's capture failed: {why})")
        if not p.use_graphs:
            return f"eager, padded to a length bucket ({lo}-{hi} tokens; longer chunks unpadded)"
        return (f"CUDA graph of the eager forward, padded to a length bucket ({lo}-{hi} tokens; longer "
                f"chunks eager); {len(p.graphs)} captured")

    @property
    def cached(self) -> list[int]:
        """The tokens whose state is live (a copy)."""
        return self._ids[:self.state.length]

    # --- forwards ---------------------------------------------------------------------------
    @torch.inference_mode()
    def _forward(self, ids: list[int], all_logits: bool = False, verify: bool = False) -> torch.Tensor:
        """Feed ids; verify: through the step's `verify` (logits of every row, each a step's)."""
        start = self.state.length
        one = len(ids) == 1 and not verify
        decode = one and self._bucketed_decode
        padded = self._padded is not None and not one and not all_logits and not verify
        bucket = prefill_bucket(len(ids), self.max_context - start) if padded else None
        # (a padded chunk's queries are the bucket's: its key slots run to start + bucket, as the
        # torch attention's form takes them; the CUDA kernels read the positions instead)
        kv_len = decode_kv_len(start, self._kv_buckets) if decode else None if bucket is None else start + bucket
        self.state.begin_forward(len(ids), kv_len)
        del self._ids[start:]
        if self._mtp_on:  # (this session's forwards only: the model may serve others)
            self.model.hidden_sink = self._mtp.sink
        try:
            if decode and self.graph is not None:
                logits = self.graph(ids[0], start)
            elif bucket is not None:
                logits = self._padded(ids, start, bucket)
            else:
                tokens = torch.tensor(ids, dtype=torch.long, device=self.device)
                positions = torch.arange(start, start + len(ids), dtype=torch.long, device=self.device)
                if verify:
                    logits = self._step_fn.verify(tokens, positions, self.state)
                else:
                    fn = self._step_fn if one else self.model
                    logits = fn(tokens, positions, self.state, all_logits=all_logits)
        except BaseException:
            self.state.invalidate()
            raise
        finally:
            self.model.hidden_sink = None
        self.state.advance(len(ids))
        self._ids.extend(ids)
        return logits

    def prefill(self, ids: list[int], all_logits: bool = False) -> torch.Tensor:
        """Append `ids` to the cached state; returns the last row of logits (or all rows)."""
        if not ids:
            raise ValueError("prefill needs at least one token")
        outs = []
        chunk = self.PREFILL_CHUNK.get(self.device.type, 512)
        for i in range(0, len(ids), chunk):
            outs.append(self._forward(ids[i:i + chunk], all_logits))
        return torch.cat(outs) if all_logits else outs[-1]

    def step(self, token: int) -> torch.Tensor:
        """One decode step: feed `token`, return logits [1, vocab]."""
        return self._forward([token])

    def _compile_now(self) -> None:
        """Compile the CPU step at start, not during the first reply: a scratch prefill and two
        steps (past the sizes 0 and 1, which torch.compile specializes), then a reset, which leaves
        the state as construction did. A failed compile (no C++ compiler, say) is a ConfigError."""
        try:
            self._throwaway_forwards(2)
        except Exception as e:  # Inductor's errors have no common base; the message names the cause
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(f"compile: on could not compile the decode step ({first[:200]}); "
                              "use compile: off") from None

    def finite_on(self, ids: list[int]) -> bool:
        """Whether a prefill of `ids` (cut to the context) gives finite logits: the check that a
        half dtype's range holds the model's activations. Leaves the state reset."""
        try:
            self.reset()
            return bool(torch.isfinite(self.prefill(ids[: self.max_context - 1] or [0])).all())
        finally:
            self.reset()

    # --- state --------------------------------------------------------------------------------
    def reset(self) -> None:
        self.state.reset()
        self._ids.clear()
        if self._mtp is not None:
            self._mtp.forget(0)

    def rewind(self, n: int) -> None:
        self.state.rewind(n)

    def export_state(self) -> tuple[list[int], dict[str, torch.Tensor]]:
        """(the cached token ids, the state at their length as host tensors): engine/state_file.py."""
        return list(self.cached), self.state.export()

    def load_state(self, ids: list[int], tensors: dict[str, torch.Tensor]) -> None:
        """The state `export_state` gave, with its ids as the cache (checked: ValueError, the
        session untouched; then it holds exactly those tokens)."""
        if not ids or any(not isinstance(i, int) or not 0 <= i < self.vocab_size for i in ids):
            raise ValueError(f"its token ids are not ids of this model's {self.vocab_size}")
        self.state.load(tensors, len(ids))
        self._ids = list(ids)
        if self._mtp is not None:
            self._mtp.forget(len(ids))  # (its rows were not computed here)

    def rollback_to(self, n: int) -> int:
        """Bring the state back to at most n cached tokens, exactly (a KV rewind, or the newest
        checkpoint at or before n on recurrent state, or a reset). Returns the length reached."""
        return self.state.restore_nearest(min(n, self.state.length))

    def reuse_prefix(self, prompt_ids: list[int]) -> tuple[int, torch.Tensor | None]:
        """Bring the state to the longest reusable prefix of `prompt_ids`.

        Returns (reused length, next-token logits or None). The prefix is matched against every
        written KV slot, not only the live ones: after a rewind (Ctrl-C, /retry, /undo) the slots
        above still hold their tokens until a forward overwrites them. The whole prompt counts as
        reused only when a checkpoint at exactly its length saved the logits (a /retry, or the same
        message again after Ctrl-C); otherwise at least one token is left to prefill. Where
        recurrent state cannot rewind, the longest checkpoint at or before the prefix is restored
        (or the state reset) and the caller prefills the gap.
        """
        lcp = common_prefix(self._ids[:self.state.written], prompt_ids)
        if lcp == len(prompt_ids):
            logits = self.state.checkpoint_logits(lcp)
            if logits is not None and self.state.best_at_most(lcp) == lcp:
                self.state.goto(lcp)
                return lcp, logits[None].clone()
        n = self.state.restore_nearest(min(lcp, len(prompt_ids) - 1))
        return n, None

    # --- generation ---------------------------------------------------------------------------
    def check_fits(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_ids) >= self.max_context:
            raise ContextOverflow(f"the prompt is {len(prompt_ids)} tokens; the context holds "
                                  f"{self.max_context} (shorten the conversation or raise max_context)")

    def generate(self, prompt_ids: list[int], sampling: SamplingConfig, seed: int | None = None,
                 stop_ids: tuple[int, ...] | None = None, *, turn: int = 0, sampler: int = SAMPLER_VERSION,
                 forced: list[int] | None = None, constraint: TokenConstraint | None = None,
                 expected: list[int] | None = None) -> Iterator[int]:
        """Validate now (raising before any state changes), then return the token iterator.

        `turn` and `sampler` (the version) key the draws (engine/sampling.py). `forced`: feed and
        yield these ids instead of the sampler's choices; the stop rules still apply to them.
        `constraint` (engine/constraint.py, fresh for this generation): each draw is masked to the
        tokens it allows; a forced token it rejects is a departure, after which it is dropped.
        `expected`: the reply a replay expects, drafted first where the session speculates (it
        changes no token: engine/speculative.py)."""
        self.check_fits(prompt_ids)
        self._generation += 1  # (an older generator, closed late, must not touch this one's state)
        seed = resolve_seed(sampling.seed if seed is None else seed)
        stops = self.eos_ids if stop_ids is None else tuple(stop_ids)
        draw = make_sampler(sampler, sampling, self.vocab_size, self.device, list(prompt_ids), seed, turn)
        mask = None if constraint is None else ConstraintMask(constraint, self.vocab_size, self.device,
                                                                 self._device_masks)
        return self._generate(list(prompt_ids), sampling, seed, stops, draw,
                              None if forced is None else list(forced), mask, self._generation, expected)

    def _generate(self, prompt: list[int], cfg: SamplingConfig, seed: int, stops, sampler,
                  forced: list[int] | None, mask: ConstraintMask | None, generation: int,
                  expected: list[int] | None = None) -> Iterator[int]:
        stats = self.last_stats = GenerationStats(prompt_tokens=len(prompt), seed=seed)
        stats.finish_reason = "interrupted"
        t0 = time.perf_counter()
        if mask is not None:
            mask.start()  # the first mask is computed while the prompt is prefilled
        stats.reused_tokens, logits = self.reuse_prefix(prompt)
        if logits is None:
            # where this turn's new tokens begin (the end of the previous turn): what /undo and a
            # new message come back to, taken before the prefill moves the state past it
            if stats.reused_tokens > 0:
                self.state.checkpoint(role=BASE)
            logits = self.prefill(prompt[stats.reused_tokens:])
        if self.verify_reuse and stats.reused_tokens > 0:
            self._verify(prompt, logits[-1], stats.reused_tokens)
        self.state.checkpoint(logits[-1], role=PROMPT)  # the end of the prompt: /retry, Ctrl-C
        ahead = self._pipelines(forced, mask, sampler)
        drafter = self._drafts(prompt, forced if forced is not None else expected) if self.speculating else None
        yield from self._decode(logits[-1], cfg, stats, stops, sampler, t0, generation, drafter, forced, mask, ahead)

    def _overlaps(self) -> bool:
        """Whether a step queued ahead overlaps the host's reading of a token here: CUDA with the
        graphed step (a CPU forward is done before the host reads anything)."""
        return self.graph is not None and self.device.type == "cuda"

    def _pipelines(self, forced: list[int] | None, mask: ConstraintMask | None, sampler) -> bool:
        """Whether this generation decodes pipelined (the module docstring): where it overlaps,
        and where a step queued ahead can be unfed and nothing reads a token before the next step
        (argmax draws without penalties; no forced ids, format mask, drafts or tensor-parallel link;
        no fixed recurrent state)."""
        return (self.PIPELINE_GREEDY and self._overlaps() and self.link is None and not self.speculating
                and forced is None and mask is None and not self.state.has_fixed_state
                and getattr(sampler, "argmax_only", False))

    def _decode(self, logits: torch.Tensor, cfg: SamplingConfig, stats: GenerationStats, stops, sampler,
                t0: float, generation: int, drafter=None, forced: list[int] | None = None,
                mask: ConstraintMask | None = None, ahead: bool = False) -> Iterator[int]:
        """The generation loop: each token drawn from the row of logits a plain step gives, yielded,
        judged by the stop rules (`_end_reason`), then fed. Its hooks:
        - `ahead` (the pipelined greedy decode, the module docstring; `_pipelines` says where): each
          argmax stays on the device, and the step feeding it is queued before the host reads it,
          where the loop would take that step unless the token is a stop id. That step is then
          `excess` as drafts are (below): unfed where the token ends the reply or the reader stops.
          (An error raised by a step queued ahead reaches the reader before the token it feeds,
          where the loop would have yielded that token first.)
        - `drafter` (speculation, engine/speculative.py): drafts after the token are fed with it in
          one verify forward, and each kept while it equals the draw from its row, in the plain
          loop's order. Rows fed past what the plain loop would have fed at a point (`excess`: the
          drafts after a token being yielded) are unfed before the next forward, at a stop, or
          where the reader stops reading (Ctrl-C), so the state and `cached` are the plain loop's
          at every yield's return.
        - the tensor-parallel link (engine/tensor_parallel.py): the leading rank chooses every
          token and tells the others once the reply's consumer took it (it may stop there:
          Ctrl-C); a following rank feeds what it is told. Ends by the stop rules happen on every
          rank alike; any other end on the leader tells the followers to stop.
        - `forced` ids fed and yielded in place of the draws (departures noted; None past their
          end: the reply ends "forced"), and the constraint's `mask`, advanced by each token
          before the next row is drawn."""
        link, depth = self.link, self._depth
        following = link is not None and link.follower
        leading = link is not None and not following
        pipe = _Ahead(sampler, self.device) if ahead else None
        agreed_end = False
        # excess, fed_to: rows fed past the plain loop (drafts, or the step queued ahead) and the
        # length that feeding brought the state to, set before that forward runs: a Ctrl-C anywhere
        # after finds them set; generation: generate()'s number for this call, taken when it was
        # called (another generate() may have come before this generator first ran)
        excess, fed_to, t1, k = 0, None, None, 0

        def unfeed_excess() -> None:
            nonlocal excess
            if excess and self.state.length == fed_to and self._generation == generation:
                # fixed state (conv windows): as the verify's step kept it after the last row kept
                fixed = self._step_fn.fixed_after(k + 1 - excess) if self.state.has_fixed_state else None
                self.state.unfeed(excess, fixed)
                del self._ids[self.state.length:]
            excess = 0

        def take(token: int) -> None:  # a yielded token that goes on: the draws' state moves past it
            sampler.accept(token)
            if mask is not None:
                mask.advance(token)  # the next mask (computed while the next forward runs)
            if drafter is not None:
                drafter.extend((token,))

        try:
            if pipe is not None:
                pipe.choose(logits)  # (read below, once the step feeding it is queued)
            else:
                token = link.receive() if following else self._choose(sampler, logits, forced, 0, stats, mask)
                t1 = time.perf_counter()
                stats.prefill_seconds = t1 - t0
            while True:
                if pipe is not None:
                    # Ahead only where the loop steps after this token unless it is a stop id, and no
                    # slot above the length is written: unfeeding the step then leaves what the plain
                    # loop leaves. (After a whole-prompt reuse the slots of an earlier reply stay
                    # written until this reply's first step; that step waits for its token.)
                    if (stats.generated_tokens + 1 < cfg.max_new_tokens and self.state.length < self.max_context
                            and self.state.written == self.state.length):
                        excess, fed_to, k = 1, self.state.length + 1, 0
                        pipe.choose_next(self._forward([pipe.chosen])[-1])
                    token = pipe.read()
                    if excess:
                        self._ids[-1] = token  # (the step ahead was fed the device's copy of it)
                    if t1 is None:
                        t1 = time.perf_counter()
                        stats.prefill_seconds = t1 - t0
                if token is None:  # the forced ids ran out where the generation would have gone on
                    stats.finish_reason = "forced"
                    if leading:
                        link.send(None)
                    break
                stats.generated_tokens += 1
                stats.decode_seconds = time.perf_counter() - t1
                yield token
                if leading:
                    link.send(token)
                end = self._end_reason(token, stats, cfg, stops, excess)
                if end:
                    stats.finish_reason = end
                    break
                if following:
                    self.step(token)
                    token = link.receive()
                    continue
                take(token)
                if pipe is not None:
                    if not excess:  # no step went ahead (a slot above the length written): it waits for its token
                        pipe.choose_next(self.step(token)[-1])
                    excess = 0  # the step ahead is now the loop's own
                    pipe.turn()
                    continue
                started = time.perf_counter()  # (the drafting is part of a verify's cost: the MTP layer's)
                drafts = [] if drafter is None else drafter.propose(depth.choose(
                    min(cfg.max_new_tokens - stats.generated_tokens - 1, self.max_context - self.state.length - 1)),
                    token)
                if not drafts:
                    row = self.step(token)[-1]
                    if drafter is not None:
                        depth.observe_cost(1, time.perf_counter() - started)
                    token = self._choose(sampler, row, forced, stats.generated_tokens, stats, mask)
                    continue
                rows = self._forward([token] + drafts, verify=True)
                depth.observe_cost(len(drafts) + 1, time.perf_counter() - started)
                fed_to, k = self.state.length, len(drafts)
                stats.verifies += 1
                stats.drafted += k
                j = kept = 0
                while True:  # row j: the logits after the token and drafts[:j]
                    token = self._choose(sampler, rows[j], forced, stats.generated_tokens, stats, mask)
                    if j == k or token != drafts[j]:
                        excess = k - j  # the drafts from j on were fed; the plain loop has not fed them
                        unfeed_excess()
                        break
                    excess = k - j  # drafts[j] is fed; the plain loop feeds it after yielding it
                    kept += 1
                    stats.accepted += 1
                    stats.generated_tokens += 1
                    stats.decode_seconds = time.perf_counter() - t1
                    yield token
                    end = self._end_reason(token, stats, cfg, stops, excess)
                    if end:
                        break
                    take(token)
                    j += 1
                depth.observe(kept, k)
                if excess:  # the inner loop ended the reply at an accepted draft
                    unfeed_excess()
                    stats.finish_reason = end
                    break
            agreed_end = True
        except Interrupted:  # a follower told to stop (the leader's reply was interrupted)
            agreed_end = True
        finally:
            if leading and not agreed_end:
                link.stop()
            unfeed_excess()
            if t1 is not None:
                stats.decode_seconds = time.perf_counter() - t1

    def _end_reason(self, token: int, stats: GenerationStats, cfg: SamplingConfig, stops, unfed: int = 0) -> str:
        """Why the reply ends after `token` (the stop rules), or "": a stop id, the token limit,
        the context full (`unfed`: rows fed beyond the reply's tokens, not counted)."""
        if token in stops:
            return "stop"
        if stats.generated_tokens >= cfg.max_new_tokens:
            return "length"
        if self.state.length - unfed >= self.max_context:
            return "context"
        return ""

    @staticmethod
    def _choose(sampler, logits: torch.Tensor, forced: list[int] | None, index: int,
                stats: GenerationStats, mask: ConstraintMask | None = None) -> int | None:
        """The sampler's choice, or where forced, the forced id (None past its end), noting a
        departure. The sampler draws at every step either way, so its counter or stream advances
        as it did when the forced ids were recorded. A constraint's mask applies before the draw
        (so before the penalties): a forced token outside it has log-probability -inf."""
        if mask is not None:
            logits = mask.apply(logits)
        chosen = int(sampler(logits))
        if forced is None:
            return chosen
        token = forced[index] if index < len(forced) else None
        if token != chosen:
            lp = sampler.log_probs(logits, [chosen] if token is None else [chosen, token])
            stats.departures.append(Departure(index, chosen, token, lp[0], lp[1] if token is not None else None))
        return token

    def _verify(self, prompt: list[int], logits: torch.Tensor, reused: int) -> None:
        from .reference import full_logits
        cold = full_logits(self.model, prompt, self.device, self.dtype)[-1]
        diff = float((cold.float() - logits.float()).abs().max())
        tol = 1e-3 if self.state.kv_dtype == torch.float32 else 0.25
        if diff > tol:
            raise ReuseMismatch(f"reusing {reused} cached tokens changed the next-token logits by {diff:.3g} "
                                f"(tolerance {tol:g}) versus a cold prefill of the {len(prompt)}-token prompt")


def open_session(model, eng, device: torch.device, dtype: torch.dtype, eos_ids, link=None) -> DecodeSession:
    """The session an EngineConfig describes (chat/runtime.py; every tensor-parallel rank). A rank
    of a tensor-parallel group decodes with the model's own step (the C++ CPU step knows no
    collectives)."""
    return DecodeSession(model, max_context=eng.max_context, device=device, dtype=dtype, eos_ids=eos_ids,
                         cuda_graph=eng.cuda_graph, compile=eng.compile,
                         cpu_kernel="off" if link is not None else eng.cpu_kernel,
                         checkpoint_mib=eng.checkpoint_mib, checkpoint_host_mib=eng.checkpoint_host_mib,
                         verify_reuse=eng.verify_reuse, link=link, speculative=eng.speculative)
