"""Speculative decoding with prompt-lookup drafts against plain decoding, on one loaded model and
one session: a copy-with-edit conversation (the user gives a paragraph and asks it back with one
word changed), greedy, the embedded model by default, on the CPU by default.

    python bench/spec_bench.py [--model smollm2] [--device cpu] [--rounds 3] [--temperature 0]
                               [--acceptance 0,0.5,0.75,1 [--mtp]] [--replay] [--cpu-int8 auto]
                               [--threads N] [--clock wall|cpu]

Each round runs the turn with `speculative: off` and then `lookup` (`/set speculative`, the live
session's switch), from the same cached prefix (the turn is undone between them), and checks the
two replies equal token for token. Prints each round's decode tok/s, the drafts kept, the medians
and their ratio. With --temperature above 0, a fixed seed: the sampled replies must match too.

--replay: `chat replay`'s work instead: a recording of a few turns (free answers, the copy, a
summary) replayed, checked token for token, with speculative off and auto, alternating; the
replay drafts the recorded reply. Prints each replay's seconds, the medians and their ratio.

--acceptance: forced drafts instead of prompt lookup, for each rate A: the plain reply's own
tokens, each replaced by a wrong one with probability 1 - A (seeded), so that the depth rule and
the verify's cost are measured at a known acceptance (0: every draft wrong, where speculation
must cost next to nothing). With --mtp (a model with an MTP layer): `speculative: mtp`, the layer
drafting as it does (its cost paid in full: the layer and the LM head a draft) and its tokens then
replaced by the forced ones.

--clock cpu: each reply's decode timed by the process's CPU time (from its first streamed piece
to its end) instead of the generation's wall-clock stats; with --threads 1, a measure of one
core's work that other processes on a shared machine barely move (as bench/cpu_bench.py --clock;
--replay times the wall clock only).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PARAGRAPH = ("The old lighthouse stood at the edge of the cliff, its white paint peeling in long strips. Every night "
             "for ninety years its lamp had turned, warning ships away from the rocks below. The keeper, a quiet man "
             "named Tobias, climbed the spiral stairs each evening at dusk, carrying a tin of oil and a cloth for the "
             "great glass lens. In winter the wind screamed around the tower and the sea threw spray as high as the "
             "gallery, but the light never failed.")
ASK = "Repeat the following paragraph exactly, word for word, but replace the word 'quiet' with 'gentle':\n\n"



def main() -> None:
    from engine.device import configure_process
    configure_process()  # (the environment's diagnosis switches and folders, as chat takes them)
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--temperature", default="0")
    ap.add_argument("--max-new", default="200")
    ap.add_argument("--acceptance", default="", help="forced drafts at these rates, comma-separated")
    ap.add_argument("--mtp", action="store_true", help="with --acceptance: the MTP layer drafts, its tokens forced")
    ap.add_argument("--replay", action="store_true", help="time chat replay of a recording, off and auto")
    ap.add_argument("--cpu-int8", choices=("auto", "off", "on", "wide"), default="auto",
                    help="the cpu_int8 setting (auto: the chat's default)")
    ap.add_argument("--threads", type=int, default=0, help="the threads setting (0: the chat's default)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    args = ap.parse_args()
    from chat.controller import ChatController
    from chat.runtime import open_runtime
    from chat.settings import load_settings
    from chat.turn import TurnResult

    settings = load_settings(env={}, overrides={"model": args.model, "device": args.device, "seed": "1234",
                                                "temperature": args.temperature, "max_new_tokens": args.max_new,
                                                "speculative": "off", "cpu_int8": args.cpu_int8,
                                                **({"threads": str(args.threads)} if args.threads else {})})
    rt = open_runtime(settings)
    c = ChatController(rt, rt.settings)
    print(f"{args.model} on {rt.device}: decode step {c.session.decode_path}")

    def turn(mode: str):
        c.set("speculative", mode)
        result = TurnResult([])
        first = None
        for _ in c.send(ASK + PARAGRAPH, result):
            if first is None:
                first = time.process_time()
        if args.clock == "cpu" and first is not None:  # (the stats' decode time, on the CPU clock)
            result.stats.decode_seconds = time.process_time() - first
        c.undo()
        return result

    if args.replay:
        replays(c, args.rounds)
        return
    if args.acceptance:
        forced_drafts(c, turn, [float(a) for a in args.acceptance.split(",")], args.rounds, args.mtp)
        return
    rates = {"off": [], "lookup": []}
    for r in range(args.rounds):
        plain, spec = turn("off"), turn("lookup")
        assert plain.ids == spec.ids, f"round {r + 1}: the replies differ"
        s = spec.stats
        rates["off"].append(plain.stats.decode_tps)
        rates["lookup"].append(s.decode_tps)
        print(f"round {r + 1}: off {plain.stats.decode_tps:.1f} tok/s, lookup {s.decode_tps:.1f} tok/s "
              f"({s.generated_tokens} tokens; drafts {s.accepted}/{s.drafted} kept in {s.verifies} verifies); "
              "replies identical")
    off, on = statistics.median(rates["off"]), statistics.median(rates["lookup"])
    print(f"median decode: off {off:.1f} tok/s, lookup {on:.1f} tok/s: {on / off:.2f}x")


def replays(c, rounds: int) -> None:
    """chat replay of a recorded conversation with speculative off and auto, alternating."""
    import time

    from chat.replay import replay
    from chat.transcript import recording_from
    from chat.turn import TurnResult
    c.set("speculative", "off")
    for text in ("Tell me about lighthouses and why ships need them.", ASK + PARAGRAPH,
                 "Summarise the story of Tobias in two sentences."):
        for _ in c.send(text, TurnResult([])):
            pass
    rec = recording_from(c)
    tokens = sum(len(t.result.ids) for t in c.turns)
    times = {"off": [], "auto": []}
    for r in range(rounds):
        line = []
        for mode in ("off", "auto"):
            c.set("speculative", mode)
            t0 = time.perf_counter()
            result = replay(c, rec, runs=0)  # (raises on a divergence)
            times[mode].append(time.perf_counter() - t0)
            line.append(f"{mode} {times[mode][-1]:.2f} s")
        print(f"round {r + 1}: replay of {result.turns} turns ({tokens} reply tokens): {', '.join(line)}; identical")
    off, auto = statistics.median(times["off"]), statistics.median(times["auto"])
    print(f"median replay: off {off:.2f} s, auto {auto:.2f} s: {off / auto:.2f}x faster")


def forced_drafts(c, turn, rates: list[float], rounds: int, mtp: bool = False) -> None:
    """Per acceptance rate: drafts from the plain reply, each wrong with probability 1 - rate
    (mtp: the MTP layer runs for each and its tokens are replaced)."""
    import random

    from engine.speculative import Depth, PromptLookup
    session = c.session
    reply = turn("off").ids
    vocab = session.vocab_size

    class Forced(PromptLookup):
        def __init__(self, context, expected=None, rate=1.0, rng=None):
            super().__init__(context)
            self.start, self.rate, self.rng = len(context), rate, rng

        def propose(self, k):
            at = len(self.tokens) - self.start
            return [t if self.rng.random() < self.rate else (t + 1 + self.rng.randrange(vocab - 1)) % vocab
                    for t in reply[at:at + k]]

    if mtp:
        c.set("speculative", "mtp")  # (the session's MtpDrafts, made once)
        layer = session._mtp.propose

    for rate in rates:
        off, on, kept = [], [], []
        for r in range(rounds):
            rng = random.Random(r)
            session._depth = Depth()  # (each rate from the same start: no acceptance carried over)
            if mtp:
                def propose(context, token, k, rate=rate, rng=rng, start=[]):
                    if not start or len(context) < start[0]:
                        start[:] = [len(context)]  # (the turn's first draft: the reply starts here)
                    drafted = layer(context, token, k)
                    at = len(context) + 1 - start[0]
                    return [t if rng.random() < rate else (t + 1 + rng.randrange(vocab - 1)) % vocab
                            for t in reply[at:at + len(drafted)]]
                session._mtp.propose = propose
            else:
                session._drafter = lambda ctx, exp=None: Forced(ctx, rate=rate, rng=rng)
            plain, spec = turn("off"), turn("mtp" if mtp else "lookup")
            assert plain.ids == spec.ids == reply, f"acceptance {rate}: the replies differ"
            off.append(plain.stats.decode_tps)
            on.append(spec.stats.decode_tps)
            kept.append(f"{spec.stats.accepted}/{spec.stats.drafted}")
        session._drafter = None
        a, b = statistics.median(off), statistics.median(on)
        print(f"acceptance {rate:.2f}: off {a:.1f} tok/s, forced drafts {b:.1f} tok/s: {b / a:.2f}x "
              f"(kept {', '.join(kept)}; replies identical)")


if __name__ == "__main__":
    main()
