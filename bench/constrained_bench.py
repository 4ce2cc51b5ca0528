"""Constrained (JSON Schema) vs unconstrained decode speed.

    python bench/constrained_bench.py [--device cpu|cuda] [--new 256] [--runs 5]

CPU: the embedded model (SmolLM2-135M GGUF) at the default settings (the C++ step). CUDA: the
SmolLM2-135M shape with random weights (bench/shapes.py) in fp16, CUDA graph on, with the
embedded model's tokenizer. Both decode `--new` greedy tokens after the same prompt; the
constrained run follows a schema of 200 short strings (the grammar cannot end before `--new`
tokens, so both decode the same number of tokens). Prints the median decode tokens/s of each
and the ratio (constrained / unconstrained), and the host time the mask took a token (consume,
mask, apply: what the ratio costs where nothing overlaps it), which a loaded machine disturbs
less than the ratio.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from chat.constraints import Format  # noqa: E402
from engine.config import SamplingConfig  # noqa: E402

SCHEMA = ('{"type":"array","items":{"type":"string","maxLength":24},"minItems":200,"maxItems":200}')
PROMPT = "List two hundred animal names as a JSON array of strings."


def session_cpu():
    from chat.runtime import open_runtime
    from chat.settings import load_settings
    rt = open_runtime(load_settings(None, env={}, overrides={"device": "cpu"}))
    return rt.session, rt.loaded.tokenizer, rt.conversation().prompt_ids(PROMPT), rt.session.decode_path


def session_cuda():
    import models
    from engine.session import DecodeSession
    from shapes import random_model
    lm = models.load("smollm2", torch.device("cpu"), torch.float32)  # its tokenizer and template
    from chat.template import ChatTemplate
    from chat.conversation import Conversation
    ids = Conversation(ChatTemplate(lm.chat_template, lm.bos_token, lm.eos_token), lm.tokenizer).prompt_ids(PROMPT)
    dev = torch.device("cuda")
    model = random_model("smollm2-135m", dev, torch.float16)
    s = DecodeSession(model, max_context=1024, device=dev, dtype=torch.float16, eos_ids=lm.eos_ids, cuda_graph="on")
    return s, lm.tokenizer, ids, s.decode_path


def tps(session, ids, cfg, compiled, stops):
    c = None if compiled is None else compiled.constraint()
    out = list(session.generate(ids, cfg, stop_ids=stops, constraint=c))
    st = session.last_stats
    return st.decode_tps, len(out)


def main():
    from engine.device import configure_process
    configure_process()  # (the environment's diagnosis switches and folders, as chat takes them)
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--overlap", default="auto", choices=["auto", "on", "off"],
                    help="the mask on a worker thread during the forward (auto: on CUDA only)")
    args = ap.parse_args()
    from engine.constraint import ConstraintMask
    ConstraintMask.overlap = None if args.overlap == "auto" else args.overlap == "on"
    spent = []  # seconds in ConstraintMask.apply (inline: it consumes and computes the mask too)
    apply = ConstraintMask.apply

    def timed(self, logits):
        t0 = time.perf_counter()
        out = apply(self, logits)
        spent.append(time.perf_counter() - t0)
        return out
    ConstraintMask.apply = timed
    s, tok, ids, path = session_cpu() if args.device == "cpu" else session_cuda()
    t0 = time.perf_counter()
    compiled = Format("json_schema", SCHEMA).compile(tok, s.eos_ids, s.vocab_size, "bench schema")
    compile_s = time.perf_counter() - t0
    cfg = SamplingConfig(temperature=0, max_new_tokens=args.new)
    tps(s, ids, SamplingConfig(temperature=0, max_new_tokens=16), compiled, None)  # warm-up: both paths
    tps(s, ids, SamplingConfig(temperature=0, max_new_tokens=16), None, ())
    free, constrained = [], []
    for _ in range(args.runs):  # interleaved, so that drift in the machine's load hits both
        r, n_free = tps(s, ids, cfg, None, ())
        free.append(r)
        r, n_con = tps(s, ids, cfg, compiled, None)
        constrained.append(r)
    f, c = statistics.median(free), statistics.median(constrained)
    mask_ms = statistics.median(spent) * 1e3
    print(f"device {args.device} ({path}); overlap {args.overlap}; prompt {len(ids)} tokens; {args.new} new tokens (free {n_free}, "
          f"constrained {n_con}); schema compiled in {compile_s * 1e3:.0f} ms")
    print(f"mask per token (in apply, median): {mask_ms:.3f} ms; an unconstrained token: {1e3 / f:.2f} ms")
    print(f"decode tok/s, median of {args.runs}: unconstrained {f:.1f}, constrained {c:.1f}; ratio {c / f:.3f}")


if __name__ == "__main__":
    main()
