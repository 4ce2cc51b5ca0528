"""`chat --resume` with the saved session state against re-prefilling the conversation: the time
until the next reply's first token, on the CPU, with the embedded model by default.

    python bench/resume_bench.py [--model smollm2] [--tokens 4000] [--rounds 3]

A conversation of about `--tokens` tokens is built by turns (long messages, short greedy replies)
and autosaved as the REPL saves it (the recording and its state, chat/state_cache.py). Then, in
alternating rounds on one loaded model: "state": the recording loaded into a fresh controller
and its state read from disk (engine/state_file.py: checksum included), then the next message
until its first token; "prefill": the same without the state file, the next message prefilling
the conversation. The two replies are checked equal. Prints each round, the medians, the ratio.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PARAGRAPH = ("The history of bread begins with flat cakes of ground grain baked on hot stones; leavened loaves came "
             "later, when wild yeasts were kept alive from one batch to the next. ")



def main() -> None:
    from engine.device import configure_process
    configure_process()  # (the environment's diagnosis switches and folders, as chat takes them)
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    from chat import state_cache
    from chat.controller import ChatController
    from chat.runtime import open_runtime
    from chat.settings import load_settings
    from chat.transcript import load_into_controller, save_controller
    from chat.turn import TurnResult

    settings = load_settings(env={}, overrides={"model": args.model, "device": "cpu", "temperature": "0",
                                                "max_new_tokens": "16", "max_context": str(args.tokens + 512)})
    rt = open_runtime(settings)
    c = ChatController(rt, rt.settings)
    while c.session.state.length < args.tokens - 300:
        list(c.send(PARAGRAPH * 6 + "Summarise that in one line.", TurnResult([])))
    folder = tempfile.mkdtemp()
    rec = os.path.join(folder, "conv.yaml")
    save_controller(c, rec)
    saver = state_cache.StateSaver(4096)
    saver.save(c, rec)
    saver.wait()
    size = os.path.getsize(state_cache.state_path(rec))
    print(f"{args.model}: a conversation of {c.session.state.length} tokens in {len(c.turns)} turns; "
          f"its state {size / 1e6:.1f} MB")

    def next_reply(with_state: bool) -> tuple[float, list[int], int]:
        fresh = ChatController(rt, rt.settings)
        fresh.session.reset()
        t0 = time.perf_counter()
        load_into_controller(fresh, rec)
        if with_state:
            note = state_cache.resume(fresh, rec)
            assert note and note.startswith("resumed from saved state"), note
        result = TurnResult([])
        stream = fresh.send("And what about cheese?", result)
        next(stream)  # the first chunk: the prefill and the first token are done
        first = time.perf_counter() - t0
        for _ in stream:
            pass
        return first, result.ids, result.stats.reused_tokens

    times = {"state": [], "prefill": []}
    for r in range(args.rounds):
        a, ids_a, reused_a = next_reply(True)
        b, ids_b, reused_b = next_reply(False)
        assert ids_a == ids_b, "the replies differ"
        times["state"].append(a)
        times["prefill"].append(b)
        print(f"round {r + 1}: state {a * 1e3:.0f} ms (reused {reused_a} tokens), prefill {b * 1e3:.0f} ms "
              f"(reused {reused_b}): {b / a:.1f}x")
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"medians: ready to answer from the saved state {med['state'] * 1e3:.0f} ms, re-prefilling "
          f"{med['prefill'] * 1e3:.0f} ms: {med['prefill'] / med['state']:.1f}x sooner; replies identical")


if __name__ == "__main__":
    main()
