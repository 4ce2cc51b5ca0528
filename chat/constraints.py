"""Output formats: JSON, a JSON Schema, a regular expression or a Lark grammar, as token masks.

A `Format` is what the user asked for (kind and source text), as flags, /format and transcripts
carry it. `Format.compile(tokenizer, eos_ids, vocab)` checks it with llguidance and returns a
`Compiled` whose `constraint()` is a fresh engine/constraint.py `TokenConstraint` per reply.
llguidance reads our `tokenizers` tokenizer (GGUF-built or an HF tokenizer.json alike); control
tokens never match text, and once the grammar is complete only the end-of-turn ids are allowed,
so a reply ends with the model's end of turn and is never cut mid-value by the constraint
(max_new_tokens or the context still can: chat/turn.py marks such a reply `cut_off`).
A bad format is a `ConstraintError`: one line naming the place (line and column, or the schema's
JSON pointer).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

import llguidance as llg

from .input_files import InputFileError, read_text

KINDS = ("json", "json_schema", "regex", "grammar")
ANY_OBJECT = {"type": "object"}  # `/format json`: any JSON object
# Whitespace between JSON tokens: at most 16 characters a gap (pretty-printing to depth 7), so
# that a model cannot loop on newlines inside a value. A schema's "x-guidance" overrides it.
JSON_OPTIONS = {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,16}"}


class ConstraintError(ValueError):
    """A bad output format: one line for the user."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


@dataclass(frozen=True)
class Format:
    kind: str  # one of KINDS
    source: str = ""  # the schema as JSON text, the regex, or the Lark grammar; "" for json

    def describe(self) -> str:
        text = self.source if len(self.source) <= 60 else self.source[:57] + "..."
        return {"json": "json (any JSON object)", "json_schema": f"json schema {text}",
                "regex": f"regex {text}", "grammar": f"grammar {text!r}"}[self.kind]

    def to_yaml(self):
        """Transcripts: `json`, or a one-key mapping (the schema as a mapping, for readability)."""
        if self.kind == "json":
            return "json"
        if self.kind == "json_schema":
            return {"json_schema": json.loads(self.source)}
        return {self.kind: self.source}

    def grammar(self) -> str:
        if self.kind == "json":
            return llg.LLMatcher.grammar_from_json_schema(ANY_OBJECT, defaults=JSON_OPTIONS)
        if self.kind == "json_schema":
            return llg.LLMatcher.grammar_from_json_schema(self.source, defaults=JSON_OPTIONS)
        if self.kind == "regex":
            return llg.LLMatcher.grammar_from_regex(self.source)
        return llg.LLMatcher.grammar_from_lark(self.source)

    def compile(self, tokenizer, eos_ids, vocab_size: int, where: str = "") -> "Compiled":
        """Check the format against the tokenizer; `where` names it in errors (a flag, a file)."""
        where = where or {"json": "json", "json_schema": "json schema", "regex": "regex",
                          "grammar": "grammar"}[self.kind]
        llt = ll_tokenizer(tokenizer, eos_ids, vocab_size)
        try:
            grammar = self.grammar()
        except ValueError as e:  # (llguidance's own refusal of a schema, regex or grammar)
            raise ConstraintError(f"{where}: {condense(str(e), self)}") from None
        failed, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, llt)
        if failed:
            raise ConstraintError(f"{where}: {condense(messages[0], self)}")
        compiled = Compiled(llt, grammar)
        probe = compiled.constraint()
        if probe.matcher.is_error():
            raise ConstraintError(f"{where}: {condense(probe.matcher.get_error(), self)}")
        import torch
        mask = torch.zeros(probe.mask_words, dtype=torch.int32)
        probe.fill_mask(mask)
        if probe.matcher.is_error() or not bool(mask.any()):  # llguidance: "NoExtensionBias"
            raise ConstraintError(f"{where}: no token sequence can match it")
        return compiled


def from_yaml(value, where: str) -> Format | None:
    """A transcript's `format`: `json`, `off`, or one of {json_schema: MAPPING|JSON}, {regex: RE},
    {grammar: LARK}. None for off."""
    if value in ("off", False):  # YAML 1.1 reads an unquoted off as false
        return None
    if value == "json":
        return Format("json")
    if isinstance(value, dict) and len(value) == 1:
        (kind, body), = value.items()
        if kind == "json_schema":
            if isinstance(body, str):
                return schema_format(body, where)
            if isinstance(body, (dict, bool)):
                return Format("json_schema", _schema_json(body, where))
        elif kind in ("regex", "grammar") and isinstance(body, str) and body:
            return Format(kind, body)
    raise ConstraintError(f"{where}: format must be json, off, or one of {{json_schema: SCHEMA}}, "
                          "{regex: RE}, {grammar: LARK}")


def _not_json(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"{text[:40]} is out of range for a JSON number")
    return value


def _schema_json(body, where: str) -> str:
    """A schema written as YAML (a transcript's mapping) as JSON text; only JSON's values."""
    try:
        return json.dumps(body, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:  # (a YAML date or binary, .nan, .inf)
        raise ConstraintError(f"{where}: the schema holds a value JSON cannot: {str(e)[:80]}") from None
    except RecursionError:
        raise ConstraintError(f"{where}: the schema is nested too deeply") from None


def schema_format(text: str, where: str) -> Format:
    """JSON text of a schema → a Format (its canonical JSON), or a one-line error naming the place."""
    try:
        schema = json.loads(text, parse_constant=_not_json, parse_float=_finite)
    except json.JSONDecodeError as e:
        raise ConstraintError(f"{where}:{e.lineno}:{e.colno}: not valid JSON: {e.msg}") from None
    except ValueError as e:  # (NaN, Infinity, 1e999: Python reads them, JSON and llguidance do not)
        raise ConstraintError(f"{where}: not valid JSON: {e}") from None
    except RecursionError:
        raise ConstraintError(f"{where}: nested too deeply") from None
    if not isinstance(schema, (dict, bool)):
        raise ConstraintError(f"{where}: a JSON Schema is an object (or true/false)")
    return Format("json_schema", json.dumps(schema, ensure_ascii=False))


def read_source(arg: str, what: str) -> tuple[str, str]:
    """A FILE argument's text and the name errors use."""
    if not arg.strip():
        raise ConstraintError(f"{what}: needs a file (the value is empty)")
    try:
        return read_text(arg), arg
    except InputFileError as e:
        raise ConstraintError(f"{what} {e}") from None


def parse_arg(kind: str, arg: str, flag: str) -> Format:
    """A flag's or /format's argument: `json_schema` FILE or inline JSON (starts with `{`), `regex`
    the expression, `grammar` a Lark file."""
    if kind == "json":
        return Format("json")
    if kind == "json_schema":
        if arg.lstrip().startswith("{"):
            return schema_format(arg, flag)
        text, name = read_source(arg, flag)
        return schema_format(text, f"{flag} {name}")
    if not arg:
        raise ConstraintError(f"{flag}: needs an argument")
    if kind == "regex":
        return Format("regex", arg)
    text, _ = read_source(arg, flag)
    return Format("grammar", text)


# --- llguidance ---------------------------------------------------------------------------------

_LL_TOKENIZERS: dict[int, tuple[object, tuple, int, llg.LLTokenizer]] = {}


def ll_tokenizer(tokenizer, eos_ids, vocab_size: int) -> llg.LLTokenizer:
    """llguidance's view of our tokenizer (~0.3 s to build on a 49k vocabulary, so kept per
    tokenizer). The mask covers the model's vocabulary (padding ids beyond the tokenizer are never
    allowed); the end-of-turn ids are the only ones allowed once the grammar is complete."""
    key = id(tokenizer)
    hit = _LL_TOKENIZERS.get(key)
    eos = tuple(eos_ids)
    if hit is None or hit[0] is not tokenizer or hit[1] != eos or hit[2] != vocab_size:
        n_vocab = max(vocab_size, tokenizer.get_vocab_size(with_added_tokens=True))
        llt = llg.LLTokenizer(tokenizer.to_str(), n_vocab=n_vocab, eos_token=list(eos))
        hit = _LL_TOKENIZERS[key] = (tokenizer, eos, vocab_size, llt)
    return hit[3]


class Compiled:
    """A checked grammar for one tokenizer; `constraint()` gives a fresh matcher per reply."""

    def __init__(self, llt: llg.LLTokenizer, grammar: str):
        self.llt, self.grammar = llt, grammar

    def constraint(self) -> "GuidanceConstraint":
        return GuidanceConstraint(llg.LLMatcher(self.llt, self.grammar, log_level=0),
                                  (self.llt.vocab_size + 31) // 32)


class GuidanceConstraint:
    """engine/constraint.py's TokenConstraint over an llguidance LLMatcher (which drops the GIL
    while it computes a mask)."""

    def __init__(self, matcher: llg.LLMatcher, mask_words: int):
        self.matcher, self.mask_words = matcher, mask_words

    def fill_mask(self, out) -> None:
        assert out.dtype.itemsize == 4 and out.is_contiguous() and out.numel() == self.mask_words
        self.matcher.unsafe_compute_mask_ptr(out.data_ptr(), out.numel() * 4)

    def consume(self, token: int) -> bool:
        return self.matcher.consume_token(token)

    def error(self) -> str:
        return self.matcher.get_error()

    @property
    def accepting(self) -> bool:
        return self.matcher.is_accepting()


# --- one-line errors ------------------------------------------------------------------------------

_AT = re.compile(r"^(?:at )?(\d+)\((\d+)\):\s*(.*)$")


def condense(message: str, fmt: Format) -> str:
    """llguidance's multi-line message → one line naming the place: a regex's column, a Lark
    grammar's line:column, a schema's JSON pointer."""
    lines = [ln for ln in message.splitlines() if ln.strip()]
    if not lines:
        return "invalid"
    regex_error = next((ln[len("error: "):] for ln in lines if ln.startswith("error: ")), None)
    if regex_error is not None:  # the regex crate's report: pattern, carets, "error: ..."
        col = next((ln.index("^") - 3 for ln in lines[1:] if ln.strip().startswith("^")), None)
        where = f" at column {col}" if col is not None and fmt.kind == "regex" else ""
        prefix = _schema_place(fmt, "pattern") if fmt.kind == "json_schema" else ""
        return f"{prefix}invalid regex{where}: {regex_error}"
    first = lines[0]
    m = _AT.match(first)
    if m and fmt.kind == "grammar":
        return f"line {m.group(1)}, column {m.group(2)}: {m.group(3)}"
    if m:
        return m.group(3)
    if fmt.kind == "json_schema":
        keys = re.findall(r'"([^"]+)"', first) if first.startswith("Unimplemented keys") else []
        if keys:
            return f"{_schema_place(fmt, keys[0])}unsupported keyword {keys[0]!r}"
        for word in re.findall(r"[A-Za-z$][A-Za-z0-9_]*", first):
            place = _schema_place(fmt, word)
            if place:
                return f"{place}{first}"
    return first


def _schema_place(fmt: Format, key: str) -> str:
    """"at /json/pointer: " of the first object in the schema with `key`, or ""."""
    try:
        schema = json.loads(fmt.source)
    except ValueError:
        return ""

    def walk(node, path):
        if isinstance(node, dict):
            if key in node:
                return path
            items = node.items()
        elif isinstance(node, list):
            items = enumerate(node)
        else:
            return None
        for k, v in items:
            found = walk(v, f"{path}/{str(k).replace('~', '~0').replace('/', '~1')}")
            if found is not None:
                return found
        return None

    found = walk(schema, "")
    return "" if found is None else f"at {found or '/'}: "
