"""Produce the expected token ids for the embedded GGUF with llama.cpp's own tokenizer.

Run once (llama-cpp-python is an optional tool, never a dependency of the project):
    python tests/data/make_smollm2_token_ids.py [GGUF_PATH] > tests/data/smollm2_token_ids.json
The strings are built deterministically below; the JSON holds [text, ids] pairs.
"""
import itertools
import json
import sys


def cases() -> list[str]:
    base = [
        "Hello, world!", "What is the capital of France?", "  4", "   42 apples", "a  4b", "x\t\t7",
        "3.14159", "1,000,000", "phone: +1 (555) 123-4567", "0x1F 0b1010 1e-9", "year 2024 and 1999",
        "   ", "\n\n\n", "\t", " \n \n", "trailing spaces   ", "   leading", "mixed \t\n whitespace",
        "def f(x):\n    return x ** 2\n", "for i in range(10):\n\tprint(i)", "if (a && b) { return 0; }",
        "SELECT * FROM t WHERE id = 42;", "<div class=\"x\">1</div>", "{\"key\": [1, 2, 3]}",
        "naïve café résumé", "Straße", "日本語のテキスト", "中文测试123", "한국어 텍스트", "Ελληνικά",
        "русский текст 2", "עברית", "العربية ٣٤٥", "हिन्दी १२३", "emoji 😀🎉👍", "👨‍👩‍👧‍👦 family",
        "flags 🇫🇷🇩🇪", "½ ¾ ² ³ Ⅻ", "①②③", "０１２ fullwidth", "math: ∑ x_i ≤ ∞", "arrows → ← ⇒",
        "<|im_start|>user\nhi<|im_end|>\n", "<|endoftext|>", "text<|im_end|>more", "<|im_start|>assistant\n",
        "<repo_name>x<file_sep>", "don't won't I'm you're they've we'll he'd", "DON'T SHOUT",
        "https://example.com/path?q=1&r=2", "user@example.com", "C:\\Windows\\System32", "~/.config/chat",
        "snake_case camelCase PascalCase kebab-case", "ALLCAPS123abc", "a1b2c3d4", "...!!!???", "--- ***",
        "\"quoted\" 'single'", "tab\tseparated\tvalues\t1\t2", "line1\r\nline2\r\n", "zero\u200bwidth",
        "nbsp\u00a0here", "em—dash – en", "«guillemets»", "¿Qué tal? ¡Bien!", "  \t 5 \n  6  ",
    ]
    words = ["the", "  12", " 3 ", "\n7", "é", "😀", "x", "  ", "99 bottles", "\t4", "Ünïcødé", "fn()", "42"]
    combos = ["".join(p) for p in itertools.permutations(words, 3)]
    out = base + combos[:: max(1, len(combos) // 160)]
    return list(dict.fromkeys(out))


def main() -> None:
    from llama_cpp import Llama

    path = sys.argv[1]
    llm = Llama(model_path=path, vocab_only=True, verbose=False)
    pairs = [[s, llm.tokenize(s.encode("utf-8"), add_bos=False, special=True)] for s in cases()]
    json.dump({"source": "llama-cpp-python " + __import__("llama_cpp").__version__, "cases": pairs},
              sys.stdout, ensure_ascii=False, indent=0)


if __name__ == "__main__":
    main()
