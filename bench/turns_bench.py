"""What a later turn, /retry, /undo and Ctrl-C cost, against a fresh turn with the same new tokens.

    python bench/turns_bench.py [NAME ...] [--context 2000 16000] [--new 200] [--reply 64]
                                [--budgets auto 256] [--profile]
For each shape, checkpoint budget (`checkpoint_mib`) and conversation length, one session holds a
conversation of random token ids: a first prompt that fills it to the length, then turns of `--new`
new tokens each (a message after the previous reply, as a chat template appends one), each
generating `--reply` tokens. At the end, each action's time to first token (median of 3):
- turn N: the next message (its new tokens: the previous reply's last token and the message), once
- /retry: the same prompt again (the REPL's /retry sends the last message anew)
- Ctrl-C, same message: a reply interrupted after 4 tokens, the session rolled back as the
  controller does, then the same prompt again; Ctrl-C, new message: another message instead
- /undo + message: the last exchange dropped, another message in its place (the same work as
  turn N from the checkpoint at its base)
and a fresh session's first turn over the same number of new tokens (`--new` + 1), the ratio's
denominator. `--profile`: the top kernels of turn N's prefill and of the fresh one (where the
growth with the context goes).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from engine.config import SamplingConfig  # noqa: E402
from engine.session import DecodeSession, common_prefix  # noqa: E402
from shapes import random_model  # noqa: E402

REPEAT = 5


def main() -> None:
    from engine.device import configure_process
    configure_process()  # (the environment's diagnosis switches and folders, as chat takes them)
    ap = argparse.ArgumentParser()
    ap.add_argument("names", nargs="*", default=["qwen3.5-0.8b"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--context", type=int, nargs="+", default=[2000, 16000])
    ap.add_argument("--new", type=int, default=200)
    ap.add_argument("--reply", type=int, default=64)
    ap.add_argument("--turns", type=int, default=3, help="regular turns before the measured actions")
    ap.add_argument("--budgets", nargs="+", default=["auto", "256"])
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    device = torch.device(a.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    for name in a.names:
        model = random_model(name, device, dtype)
        for budget in a.budgets:
            for context in a.context:
                bench(model, name, device, dtype, context, budget if budget == "auto" else int(budget), a)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()


def bench(model, name, device, dtype, context, budget, a) -> None:
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    rand = lambda n: torch.randint(0, vocab, (n,), generator=g).tolist()  # noqa: E731
    max_ctx = context + (a.turns + 8) * (a.new + a.reply) + 64
    cfg = SamplingConfig(temperature=0, max_new_tokens=a.reply)
    s = DecodeSession(model, max_context=max_ctx, device=device, dtype=dtype, checkpoint_mib=budget)
    list(s.generate(rand(64), SamplingConfig(temperature=0, max_new_tokens=4), stop_ids=()))  # warm-up
    s.reset()

    def turn(prompt: list[int]) -> tuple[list[int], float, int]:
        reply = list(s.generate(prompt, cfg, stop_ids=()))
        return reply, s.last_stats.prefill_seconds * 1e3, s.last_stats.prefilled_tokens

    convo = rand(context - a.turns * (a.new + a.reply))
    before = convo
    for _ in range(a.turns):  # the conversation, each turn appending its reply and a message
        reply, _, _ = turn(convo)
        before, convo = convo, convo + reply + rand(a.new)
    rows = {}
    # turn N: the next message; three times from the same base (the two repeats after an /undo)
    times, prefilled = [], []
    base_prompt = convo
    for k in range(REPEAT):
        prompt = base_prompt if k == 0 else base_prompt[:-a.new] + rand(a.new)
        if k:
            s.rollback_to(common_prefix(s.cached, base_prompt[:-a.new]))  # the controller's /undo path
        reply, ms, n = turn(prompt)
        times.append(ms)
        prefilled.append(n)
    rows["turn N"] = (times[0], prefilled[0])
    rows["/undo + message"] = (statistics.median(times[1:]), prefilled[-1])
    last_prompt = prompt
    # /retry: the same prompt again
    times = [turn(last_prompt)[1] for _ in range(REPEAT)]
    rows["/retry"] = (statistics.median(times), s.last_stats.prefilled_tokens)
    # Ctrl-C after 4 tokens of the next turn, then the same message again, or another
    nxt = last_prompt + turn(last_prompt)[0] + rand(a.new)
    for label, again in (("Ctrl-C, same message", lambda: nxt), ("Ctrl-C, new message", lambda: nxt[:-a.new] + rand(a.new))):
        times = []
        for _ in range(REPEAT):
            kept = s.cached
            gen = s.generate(nxt, cfg, stop_ids=())
            for _ in range(4):
                next(gen)
            gen.close()
            s.rollback_to(common_prefix(s.cached, kept))
            times.append(turn(again())[1])
        rows[label] = (statistics.median(times), s.last_stats.prefilled_tokens)
    profile_turn = None
    if a.profile and device.type == "cuda":
        profile_turn = True

        def turn_n():  # up to the first token
            s.rollback_to(common_prefix(s.cached, nxt[:-a.new]))  # back to the base: the same new tokens
            g2 = s.generate(nxt[:-a.new] + rand(a.new), cfg, stop_ids=())
            next(g2)
            g2.close()
        profiled(f"turn N at {len(nxt)} tokens", turn_n)
    held = s.state.describe()
    del s
    fresh = DecodeSession(model, max_context=max_ctx, device=device, dtype=dtype, checkpoint_mib=budget)
    n_new = rows["turn N"][1]
    times = []
    for _ in range(2 * REPEAT + 1):  # the baseline of every ratio: more runs
        fresh.reset()
        gen = fresh.generate(rand(n_new), cfg, stop_ids=())
        next(gen)
        gen.close()
        times.append(fresh.last_stats.prefill_seconds * 1e3)
    base = statistics.median(times[1:])
    if profile_turn is not None:
        def fresh_turn():
            fresh.reset()
            g2 = fresh.generate(rand(n_new), cfg, stop_ids=())
            next(g2)
            g2.close()
        profiled(f"fresh {n_new}-token turn", fresh_turn)
    del fresh
    print(f"\n{name} on {device}, {dtype}, checkpoint_mib {budget}, conversation of {len(last_prompt)} tokens; "
          f"checkpoints: {held}")
    print(f"fresh first turn of {n_new} new tokens: {base:.2f} ms")
    print(f"| action | new tokens prefilled | TTFT ms | / fresh |\n|---|---|---|---|")
    for label, (ms, n) in rows.items():
        print(f"| {label} | {n} | {ms:.2f} | {ms / base:.2f}x |")


def profiled(label: str, fn) -> None:
    from torch.profiler import ProfilerActivity, profile
    from profile_step import top_kernels
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    print(f"profile, {label}:")
    top_kernels(prof, 1, n=10)


if __name__ == "__main__":
    main()
