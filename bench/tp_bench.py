"""Tensor-parallel decode over the GPUs of one host: one shape at several tensor_parallel sizes,
in one command.

    python3 bench/tp_bench.py SHAPE [--tp 1 2] [--prompt 128] [--new 256] [--runs 3] [--device cuda|cpu]
        [--timeout SECONDS]

Each size runs in its own processes (rank 0 here in a child, N-1 more; NCCL on CUDA, gloo on the
CPU), every rank holding random weights of its slices of the shape (bench/shapes.py) in bf16
(fp32 on the CPU), CUDA graph on, as the chat runs them (engine/tensor_parallel.py: rank 0
chooses, the others follow). Size 1 is the one-device session itself, no collectives. Prints per
size the decode tokens/s (median of `--runs` greedy replies after a random prompt), whether
the runs' tokens were identical, GPU memory per rank, and the ratio to the first size. Each rank
prints its stages to stderr with the seconds since its rank function began, after the spawn and
the imports (process group up, weights built, session ready, each run), so that a size that never finishes shows where it stopped; `--timeout`
ends such a size (its ranks killed) and goes on to the next.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402



def rank_main(rank, world, init, args, out):
    from engine.config import SamplingConfig
    from engine.session import DecodeSession
    from engine.tensor_parallel import Link, ParallelSession, serve
    from models.sharding import Shard
    from shapes import SHAPES, random_model

    t0 = time.perf_counter()

    def stage(what):
        print(f"[tp_bench] tensor_parallel {world} rank {rank}: {what} at {time.perf_counter() - t0:.1f} s",
              file=sys.stderr, flush=True)

    cuda = args.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    link = None
    if world > 1:
        dist.init_process_group("nccl" if cuda else "gloo", init_method=init, rank=rank, world_size=world,
                                **({"device_id": device} if cuda else {}))
        link = Link(dist.new_group(backend="gloo"), follower=rank != 0)
        stage("process group up")
    model = random_model(args.shape, device, dtype, shard=Shard(rank, world) if world > 1 else None)
    if cuda:
        torch.cuda.synchronize(device)
        stage(f"weights built ({torch.cuda.memory_allocated(device) / 2**30:.1f} GiB)")
    else:
        stage("weights built")
    session = DecodeSession(model, max_context=args.prompt + args.new + 8, device=device, dtype=dtype,
                            cuda_graph="on" if cuda else "off", cpu_kernel="off", link=link)
    stage("session ready (kernels compiled, graph captured)" if cuda else "session ready")
    if link is not None:
        dist.barrier(group=link.group)
        stage("all ranks ready")
    if rank != 0:
        serve(session, link)
        dist.destroy_process_group()
        return
    chat = session if link is None else ParallelSession(session, link)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, SHAPES[args.shape]["vocab_size"], (args.prompt,), generator=g).tolist()
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=args.new)
    speeds, replies = [], []
    for _ in range(args.runs):
        session.reset() if link is None else chat.reset()
        replies.append(list(chat.generate(prompt, cfg)))
        speeds.append(session.last_stats.decode_tps)
        stage(f"run {len(speeds)}: {speeds[-1]:.1f} tok/s")
    gib = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else 0.0
    out.put((statistics.median(speeds), all(r == replies[0] for r in replies), len(replies[0]), gib))
    if link is not None:
        link.command("exit")
        dist.destroy_process_group()


def run_size(args, world):
    """(tok/s, runs identical, tokens, GiB a rank), or None where the size ran past --timeout."""
    ctx = torch.multiprocessing.get_context("spawn")
    out = ctx.SimpleQueue()
    init = "file://" + os.path.join(tempfile.mkdtemp(prefix="tp-bench-"), "rendezvous")
    procs = [ctx.Process(target=rank_main, args=(r, world, init, args, out)) for r in range(world)]
    for p in procs:
        p.start()
    import multiprocessing.connection
    waiting = {p.sentinel: p for p in procs}
    deadline = time.monotonic() + args.timeout if args.timeout else None
    while waiting:  # a rank that fails leaves the others inside a collective: stop them
        if procs[0].sentinel not in waiting and not procs[0].exitcode:  # rank 0 done: the others get 10 s
            # to leave, as the chat's close() gives its workers (a process group's teardown on two H200s
            # outlasted 200 s on 2026-12-01, after the result came)
            deadline = min(deadline or float("inf"), time.monotonic() + 10)
        left = None if deadline is None else deadline - time.monotonic()
        ready = multiprocessing.connection.wait(list(waiting), timeout=left) if left is None or left > 0 else []
        if not ready:
            for q in procs:
                q.kill()
            for q in procs:
                q.join()
            if not out.empty():  # rank 0 finished; a rank hung on its way out (a process group's teardown)
                print(f"[tp_bench] tensor_parallel {world}: the result came, then a rank did not exit in time "
                      f"(killed)", file=sys.stderr, flush=True)
                return out.get()
            return None
        for s in ready:
            p = waiting.pop(s)
            p.join()
            if p.exitcode:
                for q in procs:
                    q.kill()
                raise SystemExit(f"tensor_parallel {world}: rank {procs.index(p)} failed (exit code {p.exitcode})")
    return out.get()


def main():
    from engine.device import configure_process
    configure_process()  # (the environment's diagnosis switches and folders, as chat takes them)
    ap = argparse.ArgumentParser()
    ap.add_argument("shape")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--timeout", type=float, default=0, help="seconds a size may take (0: no limit)")
    args = ap.parse_args()
    first = first_world = None
    for world in args.tp:
        result = run_size(args, world)
        if result is None:
            print(f"{args.shape} tensor_parallel {world}: no result within {args.timeout:.0f} s (its ranks' last "
                  f"stages are above, on stderr)", flush=True)
            continue
        tps, same, n, gib = result
        if first is None:
            first, first_world = tps, world
        print(f"{args.shape} tensor_parallel {world}: decode {tps:.1f} tok/s ({n} tokens, median of {args.runs}; "
              f"runs identical: {same}; GPU memory {gib:.1f} GiB a rank) = {tps / first:.2f}x tensor_parallel "
              f"{first_world}", flush=True)


if __name__ == "__main__":
    main()
