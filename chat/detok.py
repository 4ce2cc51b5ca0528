"""Incremental detokenization that never emits broken UTF-8.

Byte-level BPE splits multi-byte characters across tokens; decoding token by token would print
U+FFFD halves. `IncrementalDecoder.push(id)` returns only text that is final: it re-decodes a
short window of recent tokens and holds back output while it ends in an incomplete character.
"""
from __future__ import annotations

from tokenizers import Tokenizer

_REPLACEMENT = "\ufffd"


class IncrementalDecoder:
    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0   # start of the window re-decoded for context
        self._read = 0     # tokens already turned into emitted text
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def push(self, token: int) -> str:
        self.ids.append(token)
        prefix_text = self._decode(self.ids[self._prefix:self._read])
        full = self._decode(self.ids[self._prefix:])
        if full.endswith(_REPLACEMENT) or len(full) <= len(prefix_text):
            return ""  # an incomplete character (or nothing visible) so far: wait for more bytes
        new = full[len(prefix_text):]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += new
        return new

    def flush(self) -> str:
        """At the end: whatever is still held back (a truly broken tail decodes to U+FFFD)."""
        rest = self._decode(self.ids[self._prefix:])[len(self._decode(self.ids[self._prefix:self._read])):]
        self._prefix = self._read = len(self.ids)
        self.text += rest
        return rest
