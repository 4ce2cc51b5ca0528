"""GGUF tokenizers against llama.cpp's own test vectors: its source tree ships vocab-only GGUFs
(models/ggml-vocab-NAME.gguf) with input strings (.inp, separated by `__ggml_vocab_test__` lines)
and the ids its tokenizer gives them (.out, one line each, no BOS). Every pre-tokenizer we claim
is covered: directly by a vocab file, or (smollm) by the embedded model's file in test_gguf.py and
by starcoder/refact here, which llama.cpp runs with the same regexes; `default` and `llama3` are
names for the gpt-2 and llama-bpe rules."""
import functools

import gguf
import pytest

from models.formats import gguf_tokenizer
from models.formats.checkpoints import _field

pytestmark = pytest.mark.slow  # (llama.cpp's vocabulary files and their test vectors)

VOCABS = ["gpt-2", "llama-bpe", "qwen2", "qwen35", "starcoder", "refact"]
SEPARATOR = "\n__ggml_vocab_test__\n"


def vectors(name):
    from tests.support.llama_cpp_tree import vocab_files
    path, inp, out = vocab_files(name)
    texts = open(inp, encoding="utf-8").read().split(SEPARATOR)
    ids = [[int(x) for x in line.split()] for line in open(out, encoding="utf-8").read().split("\n")]
    assert len(texts) == len(ids), name
    return path, list(zip(texts, ids))


@functools.cache
def tokenizer(path):
    r = gguf.GGUFReader(path)
    return gguf_tokenizer.build(_field(r, "tokenizer.ggml.tokens"), _field(r, "tokenizer.ggml.token_type"),
                                _field(r, "tokenizer.ggml.merges") or [], _field(r, "tokenizer.ggml.pre"),
                                _field(r, "tokenizer.ggml.model"))


@pytest.mark.parametrize("name", VOCABS)
def test_tokenizer_equals_llama_cpp_test_vectors(name):
    path, cases = vectors(name)
    tok = tokenizer(path)
    wrong = [(text, got, ids) for text, ids in cases
             if (got := tok.encode(text, add_special_tokens=False).ids) != ids]
    assert not wrong, f"{len(wrong)} of {len(cases)} differ, e.g. {wrong[0]}"


def test_every_claimed_pre_tokenizer_is_covered():
    pre = gguf_tokenizer._PRE_REGEXES
    covered = set(VOCABS) | {"smollm"}  # smollm: test_gguf.py, on llama.cpp's ids for the embedded model
    aliases = {"default": "gpt-2", "llama3": "llama-bpe"}
    assert set(pre) == covered | set(aliases)
    for alias, name in aliases.items():
        assert pre[alias] == pre[name]
        assert (alias in gguf_tokenizer._IGNORE_MERGES) == (name in gguf_tokenizer._IGNORE_MERGES)
    assert pre["smollm"] == pre["starcoder"] == pre["refact"]


def test_llama3_takes_a_piece_that_is_a_token_whole():
    """llama.cpp's ignore_merges: " Việt" is one token of the Llama 3 vocabulary that its merges
    alone would not reach."""
    path, _ = vectors("llama-bpe")
    assert tokenizer(path).encode("Cửa Việt", add_special_tokens=False).ids == [34, 91163, 101798]


def test_qwen35_keeps_combining_marks_with_their_letters():
    """llama.cpp's qwen35 regex (unlike qwen2's) puts \\p{M} in the letter class: Devanagari vowel
    signs and viramas stay in their word's piece."""
    build = lambda pre: gguf_tokenizer.build(["a"], [1], [], pre, "gpt2")  # noqa: E731
    word = "नमस्ते"
    assert len(build("qwen35").pre_tokenizer.pre_tokenize_str(word)) == 1
    assert len(build("qwen2").pre_tokenizer.pre_tokenize_str(word)) > 1


@pytest.mark.parametrize("name", ["qwen35", "qwen2"])
def test_qwen_vocab_files_template_and_stop_ids(name):
    """The file's ChatML template renders in our sandbox, its control tokens encode whole, and
    generation stops on <|im_end|> as well as the file's eos <|endoftext|> (as llama.cpp does)."""
    from tokenizers import Tokenizer

    from chat.template import ChatTemplate
    from models.formats.checkpoints import _read_gguf_index
    path, _ = vectors(name)
    index = _read_gguf_index(path)
    tok = Tokenizer.from_str(index["tokenizer"])
    text = ChatTemplate(index["chat_template"]).render([{"role": "user", "content": "Cửa Việt, 42?"}])
    ids = tok.encode(text, add_special_tokens=False).ids
    start, end = tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>")
    assert ids[0] == start and ids.count(start) == 3 and ids.count(end) == 2
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert set(index["eos_ids"]) == {tok.token_to_id("<|endoftext|>"), end}
