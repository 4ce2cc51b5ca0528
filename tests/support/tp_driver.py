"""A scripted chat session under tensor parallelism, for tests/engine/test_tensor_parallel.py.

    python tests/support/tp_driver.py MODEL_DIR TENSOR_PARALLEL SCRIPT.json [--no-rezero] [--checkpoint-mib N]
        [--kill-worker-after K] [--stop-worker-after K] [--uneven-budget]
        [--pid-file PATH] [--device cpu|cuda] [--cuda-graph on|off]

Opens the runtime as `chat` does (chat/runtime.py: the workers start, every rank loads its slices)
on the CPU (or CUDA: one GPU a rank), runs the script's session calls and prints one JSON list: per call, the tokens a
generation gave (with the next-token logits its prompt left in its checkpoint, where one holds
them), or the length a rollback reached. Script calls: {"op": "generate", "prompt": [...],
"temperature": T, "seed": S, "max_new": N, "take": K (stop after K tokens, as Ctrl-C does; 0:
Ctrl-C while the prompt is prefilled)},
{"op": "rollback_to", "n": N}, {"op": "reset"}.

Spawned workers run this file's top level too (multiprocessing's spawn imports the parent's main
module), with the parent's argv: `--no-rezero` therefore reaches every rank. It switches off the
re-zero of fixed state (engine/state.py's test-only switch: the original bug) for the
regression test's non-vacuity check. `--uneven-budget` gives the workers an "auto" checkpoint
budget of one slot (rank 0 keeps its own): the ranks must agree on one ring. `--kill-worker-after K` kills rank 1 after K calls;
`--stop-worker-after K` stops it (SIGSTOP: a hang).
"""
import json
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from engine import state as state_mod  # noqa: E402

if "--no-rezero" in sys.argv:
    state_mod._REZERO_FIXED_STATE = False

if "--uneven-budget" in sys.argv:  # the workers see room for one checkpoint; rank 0 for many
    import multiprocessing
    if multiprocessing.current_process().name != "MainProcess":
        state_mod.auto_budgets = lambda device: (1, 0)


def option(name, default=None):
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


def main():
    from chat.runtime import open_runtime
    from chat.settings import load_settings
    from engine.config import SamplingConfig

    path, world, script = sys.argv[1], int(sys.argv[2]), json.load(open(sys.argv[3]))
    overrides = {"model": path, "device": option("--device", "cpu"), "tensor_parallel": world, "threads": 2}
    if option("--cuda-graph"):
        overrides["cuda_graph"] = option("--cuda-graph")
    if option("--checkpoint-mib") is not None:
        overrides["checkpoint_mib"] = int(option("--checkpoint-mib"))
    rt = open_runtime(load_settings(None, env={}, overrides=overrides))
    s = rt.session
    if option("--pid-file"):  # the workers' process ids, for the test that none outlives the chat
        with open(option("--pid-file"), "w") as f:
            f.write(" ".join(str(p.pid) for p in s._group.procs))
    kill_after = int(option("--kill-worker-after", -1))
    stop_after = int(option("--stop-worker-after", -1))
    out = []
    for i, call in enumerate(script):
        if i == kill_after:
            os.kill(s._group.procs[0].pid, signal.SIGKILL)
        if i == stop_after:  # a hung worker: alive, but it neither computes nor ticks
            os.kill(s._group.procs[0].pid, signal.SIGSTOP)
        if call["op"] == "generate":
            cfg = SamplingConfig(temperature=call.get("temperature", 0.0), seed=call.get("seed", 0), top_k=0,
                                 top_p=1.0, min_p=0.0, max_new_tokens=call.get("max_new", 12))
            gen = s.generate(call["prompt"], cfg)
            tokens = []
            if call.get("take") == 0:
                interrupt_before_the_first_token(s, gen)
            for t in gen:
                tokens.append(t)
                if len(tokens) == call.get("take", -1):
                    gen.close()
                    break
            logits = s.state.checkpoint_logits(len(call["prompt"]))
            out.append({"tokens": tokens, "logits": None if logits is None else logits.tolist()})
        elif call["op"] == "rollback_to":
            out.append({"length": s.rollback_to(call["n"])})
        elif call["op"] == "reset":
            s.reset()
            out.append({})
    print(json.dumps(out))


def interrupt_before_the_first_token(s, gen) -> None:
    """Ctrl-C while the prompt is prefilled: rank 0 takes the SIGINT inside its held region (a
    real signal, to its real handler) and closes the reply before its first token, so the workers
    are told to stop while they wait for that token. One rank: the same state, by prefilling,
    choosing the first token and closing there."""
    import contextlib

    from engine import tensor_parallel
    if not isinstance(s, tensor_parallel.ParallelSession):
        next(gen)
        gen.close()
        return
    real = tensor_parallel._held_sigint

    @contextlib.contextmanager
    def interrupted():
        with real() as pending:
            os.kill(os.getpid(), signal.SIGINT)
            yield pending

    tensor_parallel._held_sigint = interrupted
    try:
        next(gen)
        raise AssertionError("the reply went on after Ctrl-C")
    except KeyboardInterrupt:
        pass
    finally:
        tensor_parallel._held_sigint = real
        gen.close()


if __name__ == "__main__":
    main()
