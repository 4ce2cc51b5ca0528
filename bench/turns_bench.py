"""Time to first token of a later turn vs a first turn with the same number of new tokens.

    python bench/turns_bench.py [NAME] [--turns 4] [--first 1500] [--new 200] [--reply 64]
A conversation of random token ids on one session: turn 1 prefills `--first` tokens, every turn
generates `--reply` tokens, and each later turn appends `--new` tokens (the previous reply plus a
new message, as a chat template would). Turn N's prefill must cost its new tokens only (prefix
reuse, and checkpoints on hybrid models). Compared with a fresh session prefilling `--new` tokens.
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
from engine.session import DecodeSession  # noqa: E402
from shapes import random_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("name", nargs="?", default="qwen3.5-0.8b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--first", type=int, default=1500)
    ap.add_argument("--new", type=int, default=200)
    ap.add_argument("--reply", type=int, default=64)
    a = ap.parse_args()
    device = torch.device(a.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = random_model(a.name, device, dtype)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    rand = lambda n: torch.randint(0, vocab, (n,), generator=g).tolist()  # noqa: E731
    ctx = a.first + a.turns * (a.new + a.reply) + 16
    cfg = SamplingConfig(temperature=0, max_new_tokens=a.reply)

    def first_turn_ttft(n: int) -> float:
        times = []
        for _ in range(3):
            s = DecodeSession(model, max_context=ctx, device=device, dtype=dtype)
            gen = s.generate(rand(n), cfg, stop_ids=())
            next(gen)
            times.append(s.last_stats.prefill_seconds)
            gen.close()
        return statistics.median(times[1:])

    s = DecodeSession(model, max_context=ctx, device=device, dtype=dtype)
    list(s.generate(rand(64), SamplingConfig(temperature=0, max_new_tokens=4), stop_ids=()))  # warm-up
    s.reset()
    convo = rand(a.first)
    rows = []
    for turn in range(1, a.turns + 1):
        last = convo
        reply = list(s.generate(convo, cfg, stop_ids=()))
        st = s.last_stats
        rows.append((turn, st.prompt_tokens, st.reused_tokens, st.prefilled_tokens, st.prefill_seconds * 1e3))
        convo = convo + reply + rand(a.new - len(reply)) if a.new > len(reply) else convo + reply
    # the last turn again, its first new token changed so that everything after the previous reply
    # is prefilled anew (from the checkpoint there): the same work on shapes already seen, which
    # separates first-use costs (kernel selection for new shapes) from the steady state
    p = rows[-1][2]
    repeat = []
    for k in range(3):
        list(s.generate(last[:p] + [(last[p] + 1 + k) % vocab] + last[p + 1:], cfg, stop_ids=()))
        repeat.append(s.last_stats.prefill_seconds * 1e3)
    base = first_turn_ttft(rows[-1][3]) * 1e3
    print(f"{a.name} on {a.device}: hybrid={s.state.has_fixed_state}")
    print(f"{'turn':>4}{'prompt':>8}{'reused':>8}{'new':>6}{'TTFT ms':>9}")
    for r in rows:
        print(f"{r[0]:>4}{r[1]:>8}{r[2]:>8}{r[3]:>6}{r[4]:>9.2f}")
    print(f"turn {a.turns} repeated (same shapes): " + ", ".join(f"{t:.2f} ms" for t in repeat)
          + f" (reused {s.last_stats.reused_tokens}, new {s.last_stats.prefilled_tokens})")
    print(f"first turn with {rows[-1][3]} new tokens on a fresh session: {base:.2f} ms; "
          f"turn {a.turns} / that = {rows[-1][4] / base:.2f}x; repeated turn / that = {min(repeat) / base:.2f}x")


if __name__ == "__main__":
    main()
