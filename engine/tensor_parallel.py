"""Tensor parallelism over the devices of one host: N processes, one decode session each.

`tensor_parallel: N` (N > 1): `start()` spawns N-1 worker processes (torch.multiprocessing,
spawn) and joins them in a torch.distributed group (NCCL on CUDA, gloo on the CPU). Rank 0 is
the calling process: it runs the REPL, `run` and `replay`. Every rank loads only its slices of
the model (models/sharding.py) onto its own device (cuda:RANK) and opens the same DecodeSession:
its own StateManager (its KV heads and conv/recurrent heads: zeroed, checkpointed and restored by
the same rules), its own CUDA graph with the collectives captured inside.

Control (engine/link.py), over a separate gloo group so it never mixes with the collectives: rank 0
broadcasts each session call that changes state (generate, reset, rollback_to, finite_on) as one
JSON message, and every rank runs it, so all ranks run the same forwards in the same order.
During a generation the head's all-gather gives every rank the full logits, but only rank 0
chooses (its sampler, output format, forced ids): after the reply's consumer took a token, rank 0
sends it (GO), or END where forced ids ran out, or STOP where the reply ended otherwise (Ctrl-C,
an output format's dead end); ends by the stop rules (a stop id, max_new_tokens, a full context)
happen on every rank alike. A Ctrl-C on rank 0 is held until the token being computed is out
(`ParallelSession`), so no rank is ever left inside a collective.

Failure: a watchdog thread on rank 0 watches the workers' processes and their heartbeats (a
thread in each worker ticks every 0.5 s). A worker that exits, or stops ticking for
`HANG_SECONDS`, ends the chat within seconds with one line naming the rank and why (exit 3).
Workers die with rank 0 (PR_SET_PDEATHSIG) and are stopped and joined when it closes the group.
"""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import multiprocessing.connection
import os
import signal
import sys
import tempfile
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from .link import Link, OutOfStep

HANG_SECONDS = 10.0
BEAT_SECONDS = 0.5
EXIT_WORKER_FAILED = 3
FOREVER = timedelta(days=3650)  # waits are bounded by the watchdog, not by the collectives

def _backend(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


def rank_device(device_type: str, rank: int) -> torch.device:
    return torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")


def _die_with_parent() -> None:
    """Linux: this process gets SIGKILL when the process that started it ends, however it ends."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


class Group:
    """Rank 0's handle on the group: the workers, the control link, the watchdog."""

    def __init__(self, world: int, device_type: str, engine: dict, dtype: torch.dtype):
        if device_type == "cuda" and torch.cuda.device_count() < world:
            raise ValueError(f"tensor_parallel {world} needs {world} GPUs; this machine has "
                             f"{torch.cuda.device_count()} (lower tensor_parallel)")
        self.world, self.device_type = world, device_type
        ctx = torch.multiprocessing.get_context("spawn")
        self._dir = tempfile.mkdtemp(prefix="chat-tp-")
        init = "file://" + os.path.join(self._dir, "rendezvous")
        self.beats = ctx.Array("d", world, lock=False)
        self.procs, self._last_words = [], {}  # a pipe from each worker: its one line if it fails
        for rank in range(1, world):
            reader, writer = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_worker, args=(rank, world, init, engine, device_type, str(dtype).split(".")[-1],
                                                  self.beats, writer), daemon=True, name=f"chat-tp-{rank}")
            p.start()
            writer.close()
            self.procs.append(p)
            self._last_words[p.name] = reader
        self._closing = False
        self._end_lock = threading.RLock()
        self._ready = threading.Event()
        threading.Thread(target=self._watch, daemon=True, name="tp-watchdog").start()
        atexit.register(self.close)
        if device_type == "cuda":
            torch.cuda.set_device(0)
        dist.init_process_group(_backend(device_type), init_method=init, rank=0, world_size=world, timeout=FOREVER,
                                **({"device_id": torch.device("cuda", 0)} if device_type == "cuda" else {}))
        control = dist.new_group(backend="gloo", timeout=FOREVER)
        self.link = Link(control, follower=False)

    def ready(self) -> None:
        """Every rank has loaded its model and opened its session: heartbeats count from now."""
        dist.barrier(group=self.link.group)
        self._ready.set()

    def _watch(self) -> None:
        sentinels = {p.sentinel: p for p in self.procs}
        while not self._closing:
            done = multiprocessing.connection.wait(list(sentinels), timeout=BEAT_SECONDS)
            if self._closing:
                return
            if done:
                self._ended(sentinels[done[0]])
            if self._ready.is_set():
                now = time.monotonic()
                for rank in range(1, self.world):
                    if now - self.beats[rank] > HANG_SECONDS:
                        self._fail(f"tensor-parallel worker {rank} stopped responding for {HANG_SECONDS:.0f} s")

    def _ended(self, p) -> None:
        # the watchdog and rank 0's main thread (a failed collective) may both get here: the first
        # reaps the worker and ends the chat; the other waits on the lock until then
        self._end_lock.acquire()
        p.join(1.0)
        code = p.exitcode
        why = (f"killed by {signal.Signals(-code).name}" if code is not None and code < 0
               else f"exit code {code}" if code is not None else "exit status unknown")
        reader = self._last_words[p.name]
        if reader.poll(0.2):  # its last words, where it had time to say them
            with contextlib.suppress(EOFError, OSError):
                why = reader.recv()
        self._fail(f"tensor-parallel worker {p.name.rsplit('-', 1)[1]} ended ({why})")

    def fail_if_a_worker_ended(self, wait: float = 2.0) -> None:
        """After a collective failed on rank 0: where a worker has ended (or ends within `wait`
        seconds), the chat ends with the watchdog's one line rather than the collective's error."""
        done = multiprocessing.connection.wait([p.sentinel for p in self.procs], timeout=wait)
        if done:
            self._ended(next(p for p in self.procs if p.sentinel == done[0]))

    def _fail(self, message: str) -> None:
        """From the watchdog: the chat cannot go on (rank 0 may be inside a collective that will
        never complete), so it ends here, workers first. Never returns."""
        self._end_lock.acquire()  # (held until the exit: one line, from one thread)
        self._closing = True
        for p in self.procs:
            if p.is_alive():
                p.kill()
        sys.stderr.write(f"chat: error: {message}; the chat ends\n")
        sys.stderr.flush()
        os._exit(EXIT_WORKER_FAILED)

    def close(self) -> None:
        """Tell the workers to exit, wait for them (a few seconds at most), then stop any left."""
        if self._closing:
            return
        self._closing = True
        with contextlib.suppress(Exception):
            if self._ready.is_set():
                self.link.command("exit")
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
        with contextlib.suppress(OSError):
            for f in os.listdir(self._dir):
                os.unlink(os.path.join(self._dir, f))
            os.rmdir(self._dir)


class ParallelSession:
    """Rank 0's DecodeSession for the chat: every call that changes state is sent to the workers
    first; everything else is the local session's."""

    def __init__(self, session, link: Link, group: Group | None = None):
        """group: the workers this process started (None where another launcher did: a benchmark)."""
        self._session, self._link, self._group = session, link, group
        self.tensor_parallel = dist.get_world_size()

    def __getattr__(self, name):
        return getattr(self._session, name)

    def generate(self, prompt_ids, sampling, seed=None, stop_ids=None, *, turn=0, sampler=None,
                 forced=None, constraint=None):
        import dataclasses
        from .sampling import SAMPLER_VERSION, resolve_seed
        sampler = SAMPLER_VERSION if sampler is None else sampler
        seed = resolve_seed(sampling.seed if seed is None else seed)
        inner = self._session.generate(prompt_ids, sampling, seed, stop_ids, turn=turn, sampler=sampler,
                                       forced=forced, constraint=constraint)  # validates first
        command = dict(prompt=list(prompt_ids), sampling=dataclasses.asdict(sampling), seed=seed,
                       stop_ids=None if stop_ids is None else list(stop_ids), turn=turn, sampler=sampler)
        return self._run(inner, command)

    def _run(self, inner, command):
        with self._collectives():
            self._link.command("generate", **command)
        try:
            while True:
                with _held_sigint() as pending, self._collectives():
                    try:
                        token = next(inner)
                    except StopIteration:
                        return
                if pending:
                    raise KeyboardInterrupt
                yield token
        finally:
            with self._collectives():
                inner.close()  # at its yield: it tells the workers to stop

    @contextlib.contextmanager
    def _collectives(self):
        """A failed collective is a worker's end: the chat ends with the watchdog's one line."""
        try:
            yield
        except RuntimeError:
            if self._group is not None:
                self._group.fail_if_a_worker_ended()
            raise

    def reset(self) -> None:
        with self._collectives():
            self._link.command("reset")
            self._session.reset()

    def rollback_to(self, n: int) -> int:
        with self._collectives():
            self._link.command("rollback_to", n=n)
            return self._session.rollback_to(n)

    def finite_on(self, ids: list[int]) -> bool:
        with self._collectives():
            self._link.command("finite_on", ids=list(ids))
            return self._session.finite_on(ids)

    def close(self) -> None:
        if self._group is not None:
            self._group.close()


@contextlib.contextmanager
def _held_sigint():
    """Inside (on the main thread): SIGINT is noted, not raised; the caller raises it after."""
    pending: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield pending
        return
    previous = signal.signal(signal.SIGINT, lambda signum, frame: pending.append(signum))
    try:
        yield pending
    finally:
        signal.signal(signal.SIGINT, previous)


def start(engine, device_type: str, dtype: torch.dtype) -> Group:
    """Rank 0: spawn the workers and join the group. `engine`: the EngineConfig every rank opens."""
    import dataclasses
    if device_type == "cpu":  # the cores are shared by the ranks
        torch.set_num_threads(max(1, torch.get_num_threads() // engine.tensor_parallel))
    return Group(engine.tensor_parallel, device_type, dataclasses.asdict(engine), dtype)


def serve(session, link: Link) -> None:
    """A following rank: run rank 0's commands on `session` until told to exit."""
    from .config import SamplingConfig
    from .session import ReuseMismatch
    while True:
        cmd = link.next_command()
        op = cmd.pop("op")
        if op == "exit":
            return
        if op == "generate":
            sampling = SamplingConfig(**cmd.pop("sampling"))
            try:
                for _ in session.generate(cmd["prompt"], sampling, cmd["seed"], cmd["stop_ids"],
                                          turn=cmd["turn"], sampler=cmd["sampler"]):
                    pass
            except ReuseMismatch:
                pass  # rank 0 found it too, at the same point, and resets
        elif op == "reset":
            session.reset()
        elif op == "rollback_to":
            session.rollback_to(cmd["n"])
        elif op == "finite_on":
            session.finite_on(cmd["ids"])
        else:
            raise OutOfStep(f"unknown command {op!r}")


def _beat(beats, rank: int) -> None:
    while True:
        beats[rank] = time.monotonic()
        time.sleep(BEAT_SECONDS)


def _worker(rank: int, world: int, init: str, engine: dict, device_type: str, dtype_name: str, beats,
            last_words) -> None:
    """A worker process: join the group, load this rank's slices, open the session, then run
    rank 0's commands until told to exit."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle
    beats[rank] = time.monotonic()
    threading.Thread(target=_beat, args=(beats, rank), daemon=True).start()
    try:
        import models
        from models.sharding import Shard

        from .config import EngineConfig
        from .device import configure_process, physical_cores
        from .session import open_session

        eng = EngineConfig(**engine)
        configure_process()  # (this process's own, as rank 0 set its)
        device = rank_device(device_type, rank)
        if device_type == "cuda":
            torch.cuda.set_device(device)
        else:
            torch.set_num_threads(max(1, (eng.threads or physical_cores()) // world))  # rank 0's rule
        dist.init_process_group(_backend(device_type), init_method=init, rank=rank, world_size=world, timeout=FOREVER,
                                **({"device_id": device} if device_type == "cuda" else {}))
        link = Link(dist.new_group(backend="gloo", timeout=FOREVER), follower=True)
        dtype = getattr(torch, dtype_name)
        loaded = models.load(eng.model, device, dtype, quantized=False, shard=Shard(rank, world))
        session = open_session(loaded.model, eng, device, dtype, loaded.eos_ids, link=link)
        dist.barrier(group=link.group)  # Group.ready()
        serve(session, link)
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - every failure is reported to rank 0 in one line
        with contextlib.suppress(OSError):
            last_words.send(_one_line(e))
        sys.stderr.flush()
        os._exit(1)
