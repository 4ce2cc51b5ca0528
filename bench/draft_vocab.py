"""How much of real text the MTP drafts' reduced head can draft (models/architectures/mtp.py
DraftHead): the share of a text's tokens among a vocabulary's first N ids, and among those or the
tokens already seen earlier in the same text (what DraftHead adds: the conversation's tokens).

    python bench/draft_vocab.py [--vocab qwen35] [--rows 8192,16384,32768,65536] [FILE ...]

The vocabulary is one of the vocab-only GGUFs in llama.cpp's tree (tests/support/llama_cpp_tree.py:
ggml-vocab-NAME.gguf; Qwen3.5's by default), tokenized by our GGUF tokenizer. The texts default to
this repository's prose (docs/, README.md: English) and Python (engine/, chat/), each file a
document; name other files to measure other text.
A token outside the set is a draft the layer cannot make: at most the acceptance it costs.
"""
from __future__ import annotations

import argparse
import glob
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def shares(docs: list[list[int]], n: int) -> tuple[float, float]:
    """(ids < n, ids < n or seen before in the same document), as shares of all tokens."""
    total = inside = either = 0
    for ids in docs:
        seen: set[int] = set()
        for t in ids:
            total += 1
            inside += t < n
            either += t < n or t in seen
            seen.add(t)
    return inside / total, either / total


def main() -> None:
    import gguf

    from models.formats import gguf_tokenizer
    from models.formats.checkpoints import _field
    from tests.support.llama_cpp_tree import vocab_files
    p = argparse.ArgumentParser()
    p.add_argument("--vocab", default="qwen35", help="llama.cpp's ggml-vocab-NAME.gguf")
    p.add_argument("--rows", default="8192,16384,32768,65536")
    p.add_argument("files", nargs="*")
    args = p.parse_args()
    r = gguf.GGUFReader(vocab_files(args.vocab)[0])
    tokens = _field(r, "tokenizer.ggml.tokens")
    tok = gguf_tokenizer.build(tokens, _field(r, "tokenizer.ggml.token_type"),
                               _field(r, "tokenizer.ggml.merges") or [],
                               _field(r, "tokenizer.ggml.pre"), _field(r, "tokenizer.ggml.model"))
    kinds = {"files": args.files} if args.files else {
        "prose": sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))) + [os.path.join(ROOT, "README.md")],
        "python": sorted(glob.glob(os.path.join(ROOT, "engine", "*.py")) + glob.glob(os.path.join(ROOT, "chat", "*.py")))}
    print(f"vocabulary {args.vocab}: {len(tokens)} ids")
    for kind, files in kinds.items():
        docs = [tok.encode(open(f, encoding="utf-8").read(), add_special_tokens=False).ids for f in files]
        count = sum(len(d) for d in docs)
        for n in (int(x) for x in args.rows.split(",")):
            a, b = shares(docs, n)
            print(f"{kind} ({len(files)} files, {count} tokens): ids < {n}: {a:.1%}; or seen before in the file: {b:.1%}")


if __name__ == "__main__":
    main()
