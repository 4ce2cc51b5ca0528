"""Speculative decoding with prompt-lookup drafts against plain decoding, on one loaded model and
one session: a copy-with-edit conversation (the user gives a paragraph and asks it back with one
word changed), greedy, the embedded model by default, on the CPU by default.

    python bench/spec_bench.py [--model smollm2] [--device cpu] [--rounds 3] [--temperature 0]

Each round runs the turn with `speculative: off` and then `lookup` (`/set speculative`, the live
session's switch), from the same cached prefix (the turn is undone between them), and checks the
two replies equal token for token. Prints each round's decode tok/s, the drafts kept, the medians
and their ratio. With --temperature above 0, a fixed seed: the sampled replies must match too.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PARAGRAPH = ("The old lighthouse stood at the edge of the cliff, its white paint peeling in long strips. Every night "
             "for ninety years its lamp had turned, warning ships away from the rocks below. The keeper, a quiet man "
             "named Tobias, climbed the spiral stairs each evening at dusk, carrying a tin of oil and a cloth for the "
             "great glass lens. In winter the wind screamed around the tower and the sea threw spray as high as the "
             "gallery, but the light never failed.")
ASK = "Repeat the following paragraph exactly, word for word, but replace the word 'quiet' with 'gentle':\n\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--temperature", default="0")
    ap.add_argument("--max-new", default="200")
    args = ap.parse_args()
    from chat.controller import ChatController
    from chat.runtime import open_runtime
    from chat.settings import load_settings
    from chat.turn import TurnResult

    settings = load_settings(env={}, overrides={"model": args.model, "device": args.device, "seed": "1234",
                                                "temperature": args.temperature, "max_new_tokens": args.max_new,
                                                "speculative": "off"})
    rt = open_runtime(settings)
    c = ChatController(rt, rt.settings)
    print(f"{args.model} on {rt.device}: decode step {c.session.decode_path}")

    def turn(mode: str):
        c.set("speculative", mode)
        result = TurnResult([])
        for _ in c.send(ASK + PARAGRAPH, result):
            pass
        c.undo()
        return result

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


if __name__ == "__main__":
    main()
