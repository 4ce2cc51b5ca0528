"""Numerics on real weights: how close each compute dtype keeps greedy replies to the fp32 reference.

    python bench/numerics.py --model FILE.gguf [--device cuda] [--prompts 32] [--tokens 64]
        [--variants ours-auto,ours-bf16,ours-fp16,ours-fp32,hf-bf16,hf-fp32] [--json OUT.json]
        [--reference hf-fp32] [--llama-python PYTHON] [--show N]

Every variant decodes the same prompt ids (our chat template and tokenizer, one user message
each) greedily for exactly --tokens tokens (end-of-turn tokens do not stop it, so every reply has
the same length). The reference is transformers in fp32 on the same file (its own GGUF loader;
TF32 off). For each variant: the mean number of tokens before the first divergence from the
reference (--tokens where none), the share of replies identical to it, and the first-token
agreement. Ours run through `chat.runtime.open_runtime` with the settings a user gets
(`ours-auto` = the defaults; `ours-dequantized` = fp32 with `quantized: off`, the file's weights
dequantized at load; `ours-int8` = the defaults with `cpu_int8: on`, `ours-int8off` with it off, `ours-wide` with `wide`;
the others keep `cpu_int8` at its default, auto). `llama-cpp` is llama.cpp on the same file and the same prompt ids, greedy,
in a child process of `--llama-python` (a Python that can import llama_cpp; never a
dependency); `--reference` takes any variant as the reference (`llama-cpp` for a quantized file
beside llama.cpp). `--show N` prints the first N prompts' replies of every variant as text.
Speed is not measured here.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis to a ten-year-old.",
    "What is 17 times 23?",
    "Give me three tips for better sleep.",
    "Translate 'good morning' into Spanish, French and German.",
    "Write a Python function that reverses a string.",
    "Who wrote Pride and Prejudice?",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "What causes the seasons on Earth?",
    "List the planets of the solar system in order.",
    "How do I make a cup of tea?",
    "What is the difference between a list and a tuple in Python?",
    "Tell me a short joke about computers.",
    "Why is the sky blue?",
    "What is the boiling point of water in Fahrenheit?",
    "Write a limerick about a cat.",
    "Describe the water cycle.",
    "What are prime numbers? Give five examples.",
    "How does a bicycle stay upright?",
    "Suggest a name for a coffee shop.",
    "What is machine learning, in one paragraph?",
    "Convert 100 kilometres to miles.",
    "Who painted the Mona Lisa?",
    "Write an email asking a colleague for a meeting next week.",
    "What are the main ingredients of a pizza margherita?",
    "Explain what a black hole is.",
    "Give me a recipe for pancakes.",
    "What is the largest ocean on Earth?",
    "Write a SQL query that counts the rows of a table named users.",
    "How many days are there in a leap year?",
    "What should I pack for a weekend hiking trip?",
    "Explain recursion with an example.",
    "What is the speed of light?",
    "Name three famous composers of classical music.",
    "Why do leaves change colour in autumn?",
]

ALL = ["ours-auto", "ours-bf16", "ours-fp16", "ours-fp32", "hf-bf16", "hf-fp32"]
OURS_DTYPES = {"auto": "auto", "bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "dequantized": "float32"}



def prompt_ids(model_path: str, n: int) -> tuple[list[list[int]], list[int]]:
    """The prompts as token ids through our template and tokenizer (the same ids for every variant)."""
    import models
    from chat.template import ChatTemplate
    ckpt = models.read_checkpoint(models.resolve(model_path))
    template = ChatTemplate(ckpt.chat_template, ckpt.bos_token, ckpt.eos_token)
    out = []
    for text in (PROMPTS * (n // len(PROMPTS) + 1))[:n]:
        rendered = template.render([{"role": "user", "content": text}], add_generation_prompt=True)
        out.append(ckpt.tokenizer.encode(rendered, add_special_tokens=False).ids)
    return out, list(ckpt.eos_ids)


def ours(model_path: str, device: str, dtype: str, prompts: list[list[int]], tokens: int,
         quantized: str = "auto", cpu_int8: str = "auto") -> tuple[list[list[int]], str]:
    from chat.runtime import open_runtime
    from chat.settings import load_settings
    from engine.config import SamplingConfig
    settings = load_settings(None, env={}, overrides={"model": model_path, "device": device, "dtype": dtype,
                                                      "quantized": quantized, "cpu_int8": cpu_int8})
    rt = open_runtime(settings)
    cfg = SamplingConfig(temperature=0, max_new_tokens=tokens)
    replies = []
    for ids in prompts:
        rt.session.reset()
        replies.append(list(rt.session.generate(ids, cfg, stop_ids=())))
    why = f"{str(rt.dtype).replace('torch.', '')} ({rt.dtype_reason}; quantized: {quantized}; cpu_int8: {cpu_int8})"
    del rt
    torch.cuda.empty_cache() if device == "cuda" else None
    return replies, why


def hf(model_path: str, device: str, dtype: str, prompts: list[list[int]], tokens: int) -> tuple[list[list[int]], str]:
    from transformers import AutoModelForCausalLM
    import models
    path = models.resolve(model_path)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    extra = {}
    try:  # newer transformers keep GGUF blocks packed and compute in fp32: ask for a true `dt` model
        from transformers import GgufConfig
        extra["quantization_config"] = GgufConfig(gguf_file=os.path.basename(path), dequantize=True)
    except ImportError:
        pass  # older ones dequantize into `dt` anyway
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=dt, **extra).to(device).eval()
    assert next(model.parameters()).dtype == dt, next(model.parameters()).dtype
    replies = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids], device=device)
            out = model(x, use_cache=True)
            past, seq = out.past_key_values, []
            for _ in range(tokens):
                tok = int(out.logits[0, -1].argmax())
                seq.append(tok)
                out = model(torch.tensor([[tok]], device=device), past_key_values=past, use_cache=True)
                past = out.past_key_values
            replies.append(seq)
    del model
    torch.cuda.empty_cache() if device == "cuda" else None
    return replies, f"transformers {dtype}"


LLAMA_CHILD = """
import json, sys
from llama_cpp import Llama
a = json.loads(sys.stdin.read())
llm = Llama(model_path=a["path"], n_ctx=max(len(p) for p in a["prompts"]) + a["tokens"] + 8,
            n_threads=a["threads"], n_threads_batch=a["threads"], verbose=False)
out = []
for ids in a["prompts"]:
    llm.reset()
    llm.eval(ids)
    seq = []
    for _ in range(a["tokens"]):
        tok = int(llm.sample(temp=0.0))
        seq.append(tok)
        llm.eval([tok])
    out.append(seq)
print(json.dumps(out))
"""


def llama_cpp(python: str, model_path: str, prompts: list[list[int]], tokens: int) -> tuple[list[list[int]], str]:
    """llama.cpp's greedy replies on the same file and prompt ids, in a child process of `python`."""
    import subprocess

    import models
    threads = max(1, min(os.cpu_count() or 1, 16))
    proc = subprocess.run([python, "-c", LLAMA_CHILD], input=json.dumps(
        {"path": models.resolve(model_path), "prompts": prompts, "tokens": tokens, "threads": threads}),
        capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"llama.cpp child failed: {proc.stderr.strip()[-500:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1]), "llama.cpp (its CPU kernels)"


def agreement(replies: list[list[int]], ref: list[list[int]]) -> dict:
    before = []
    for a, b in zip(replies, ref):
        i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        before.append(i)
    return {"mean_tokens_before_divergence": statistics.mean(before),
            "identical_share": sum(a == b for a, b in zip(replies, ref)) / len(ref),
            "first_token_share": sum(a[:1] == b[:1] for a, b in zip(replies, ref)) / len(ref)}


def main() -> int:
    from engine.device import configure_process
    configure_process()  # (the environment's diagnosis switches and folders, as chat takes them)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--device", default="cuda")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--variants", default=",".join(ALL))
    p.add_argument("--json")
    p.add_argument("--reference", default="hf-fp32", help="the variant the others are compared with")
    p.add_argument("--llama-python", help="a Python that can import llama_cpp (the llama-cpp variant)")
    p.add_argument("--show", type=int, default=0, help="print the first N prompts' replies of every variant")
    args = p.parse_args()
    prompts, _ = prompt_ids(args.model, args.prompts)
    variants = args.variants.split(",")
    if args.reference not in variants:
        variants.insert(0, args.reference)
    if "llama-cpp" in variants and not args.llama_python:
        raise SystemExit("the llama-cpp variant needs --llama-python (a Python that can import llama_cpp)")

    def run(v: str) -> tuple[list[list[int]], str]:
        if v == "llama-cpp":
            return llama_cpp(args.llama_python, args.model, prompts, args.tokens)
        who, _, dt = v.partition("-")
        if v in ("ours-int8", "ours-int8off", "ours-wide"):
            setting = {"ours-int8": "on", "ours-int8off": "off", "ours-wide": "wide"}[v]
            return ours(args.model, args.device, "float32", prompts, args.tokens, "auto", setting)
        if who == "ours" and dt in OURS_DTYPES:
            return ours(args.model, args.device, OURS_DTYPES[dt], prompts, args.tokens,
                        "off" if dt == "dequantized" else "auto")
        if who == "hf" and dt in ("bf16", "fp16", "fp32"):
            return hf(args.model, args.device, dt, prompts, args.tokens)
        raise SystemExit(f"unknown variant {v!r} (ours-auto|bf16|fp16|fp32|dequantized|int8|int8off|wide, hf-bf16|fp16|fp32, llama-cpp)")

    t0 = time.perf_counter()
    ref, ref_what = run(args.reference)
    print(f"reference: {args.reference} ({ref_what}) on {args.device}, {len(prompts)} prompts x {args.tokens} "
          f"tokens ({time.perf_counter() - t0:.0f} s)", flush=True)
    rows, texts = [], {}
    for v in variants:
        t0 = time.perf_counter()
        replies, what = (ref, f"{ref_what} (the reference)") if v == args.reference else run(v)
        texts[v] = replies
        row = {"variant": v, "dtype": what, **agreement(replies, ref), "seconds": time.perf_counter() - t0}
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n| variant | dtype | mean tokens before first divergence (of {args.tokens}) | identical replies | "
          "first token agrees |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['dtype']} | {r['mean_tokens_before_divergence']:.1f} | "
              f"{r['identical_share']:.0%} | {r['first_token_share']:.0%} |")
    if args.show:
        import models
        tok = models.read_checkpoint(models.resolve(args.model)).tokenizer
        for i in range(min(args.show, len(prompts))):
            print(f"\n### {PROMPTS[i % len(PROMPTS)]}")
            for v, replies in texts.items():
                print(f"- {v}: {tok.decode(replies[i])!r}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
