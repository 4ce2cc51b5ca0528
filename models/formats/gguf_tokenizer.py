"""Rebuild a GGUF file's byte-level BPE tokenizer as a `tokenizers.Tokenizer`.

The reference is llama.cpp's tokenizer for the same file: vocab and merges from the metadata,
control tokens as special added tokens (matched in text, as llama.cpp's parse_special does),
and the pre-tokenizer named by `tokenizer.ggml.pre` reproduced with the same regexes. For
`smollm` that is one Unicode-number split (`\\p{N}`, each digit its own piece) before the GPT-2
byte-level rules. The Llama 3 pre-tokenizers also take a piece that is itself a token whole,
before any merge (llama.cpp's ignore_merges; "Cửa Việt" → " Việt", not " Vi" "ệ" "t").
An unknown tokenizer model or pre-tokenizer is an error, never a guess. Every pre-tokenizer here
is checked against llama.cpp's own test vectors (tests/formats/test_gguf_vocab.py).
"""
from __future__ import annotations

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

# llama.cpp's pre-tokenizer regexes (src/llama-vocab.cpp), applied before the byte-level mapping.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen3.5 keeps combining marks (\p{M}) with the letters they modify
_QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_REGEXES = {
    "default": [_GPT2],
    "gpt-2": [_GPT2],
    "smollm": [r"\p{N}", _GPT2],
    "llama-bpe": [_LLAMA3],
    "llama3": [_LLAMA3],
    "qwen2": [_QWEN2],
    "qwen35": [_QWEN35],
    # llama.cpp runs these with smollm's regexes
    "starcoder": [r"\p{N}", _GPT2],
    "refact": [r"\p{N}", _GPT2],
}
# pre-tokenizers for which llama.cpp looks a whole piece up in the vocabulary before merging
_IGNORE_MERGES = {"llama-bpe", "llama3"}

CONTROL, USER_DEFINED = 3, 4


class TokenizerError(ValueError):
    pass


def build(tokens: list[str], token_types: list[int], merges: list[str], pre: str,
          model_kind: str) -> Tokenizer:
    if model_kind != "gpt2":
        raise TokenizerError(f"tokenizer model {model_kind!r} is not supported (supported: gpt2 byte-level BPE)")
    if pre not in _PRE_REGEXES:
        raise TokenizerError(f"pre-tokenizer {pre!r} is not supported (supported: {', '.join(sorted(_PRE_REGEXES))})")
    # the arrays as a damaged file may hold them: each a one-line error, never an IndexError
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise TokenizerError("tokenizer.ggml.tokens is not a list of strings")
    if not isinstance(token_types, list) or len(token_types) != len(tokens):
        raise TokenizerError(f"tokenizer.ggml.token_type does not hold one type for each of the {len(tokens)} tokens")
    if not isinstance(merges, list) or not all(isinstance(m, str) and " " in m for m in merges):
        raise TokenizerError("tokenizer.ggml.merges is not a list of space-separated token pairs")
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    try:
        tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False,
                                   ignore_merges=pre in _IGNORE_MERGES))
    except Exception as e:  # e.g. a merge of tokens not in the vocabulary
        raise TokenizerError(f"the GGUF vocabulary does not make a BPE tokenizer ({str(e).splitlines()[0][:80]})") \
            from None
    splits = [pre_tokenizers.Split(Regex(rx), behavior="isolated") for rx in _PRE_REGEXES[pre]]
    tok.pre_tokenizer = pre_tokenizers.Sequence(splits + [pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                    use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    added = [AddedToken(tokens[i], special=token_types[i] == CONTROL, normalized=False)
             for i in range(len(tokens)) if token_types[i] in (CONTROL, USER_DEFINED)]
    tok.add_tokens(added)
    return tok
