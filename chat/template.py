"""Chat templates: untrusted Jinja from model files, rendered in a sandbox.

`ChatTemplate.render(messages, add_generation_prompt)` gives the prompt text. The environment is
jinja2's ImmutableSandboxedEnvironment (no attribute tricks, no mutation of passed objects), with
the helpers HF templates expect: `raise_exception`, `tojson`, `strftime_now`, `bos_token`,
`eos_token`. A template error becomes a `TemplateError` with a one-line message.

A template is code from the model file, so a render is bounded (`Limits`): loop steps over
`range`, seconds, memory the process gains meanwhile, and the text it makes; `*` on text or lists
and `**` on integers are checked before they run (a template's `'a' * 10**9` or `9**9**9`). A
template past a bound fails as any template error does: one line, the conversation unchanged.
"""
from __future__ import annotations

import json
import resource
import time
from dataclasses import dataclass
from datetime import datetime

import jinja2
from jinja2 import meta
from jinja2.sandbox import ImmutableSandboxedEnvironment, safe_range


@dataclass(frozen=True)
class Limits:
    """What one render may take. Real templates stay far below each: they loop over the messages
    and tools, and make the prompt text."""
    loop_steps: int = 1_000_000       # items all `range(...)` loops of a render yield together
    seconds: float = 5.0
    memory: int = 512 << 20           # bytes the process's peak RSS may grow by during a render
    text: int = 16 << 20              # characters of the rendered prompt
    sequence: int = 1 << 20           # items (characters) a `*` may make, an operand's or its result's
    exponent: int = 4096              # |b| of an integer a ** b


CHECK_EVERY = 0.01  # seconds between the clock and memory checks of a render


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # (Linux: KiB)


class _Budget:
    """One render's clock, loop count and memory baseline; `tick` runs at each loop step."""

    def __init__(self, limits: Limits):
        self.limits = limits
        self.steps = 0
        self.start = time.monotonic()
        self.next_check = self.start
        self.base = _peak_rss()

    def tick(self) -> None:
        self.steps += 1
        if self.steps > self.limits.loop_steps:
            raise TemplateError(f"the chat template ran past {self.limits.loop_steps:,} loop steps")
        now = time.monotonic()
        if now >= self.next_check:  # (getrusage is a system call: read it at most every CHECK_EVERY)
            self.next_check = now + CHECK_EVERY
            self.check(now)

    def check(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if now - self.start > self.limits.seconds:
            raise TemplateError(f"the chat template ran past {self.limits.seconds:g} s")
        if _peak_rss() - self.base > self.limits.memory:
            raise TemplateError(f"the chat template took more than {self.limits.memory >> 20} MiB")


class _Range:
    """range() for templates: jinja's sandboxed range (at most 100,000 items), each item it yields
    a step of the render's budget; len and indexing as a range's."""

    def __init__(self, budget_of, *args):
        self._r = safe_range(*args)
        self._budget_of = budget_of

    def __iter__(self):
        budget = self._budget_of()
        for i in self._r:
            if budget is not None:
                budget.tick()
            yield i

    def __len__(self):
        return len(self._r)

    def __getitem__(self, i):
        return self._r[i]

    def __reversed__(self):
        return iter(_Range(self._budget_of, self._r.start + (len(self._r) - 1) * self._r.step,
                           self._r.start - self._r.step, -self._r.step)) if len(self._r) else iter(())


class _Sandbox(ImmutableSandboxedEnvironment):
    """The sandbox with `*` and `**` checked before they run (never folded at compile time:
    jinja folds no intercepted operator)."""
    intercepted_binops = frozenset(["*", "**"])
    limits = Limits()

    def call_binop(self, context, operator, left, right):
        lim = self.limits
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * max(n, 0) > lim.sequence:
                    raise TemplateError(f"the chat template's `*` would make {len(seq) * n:,} items "
                                        f"(at most {lim.sequence:,})")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) \
                and abs(right) > lim.exponent and abs(left) > 1:
            raise TemplateError(f"the chat template's `**` has an exponent of {right:,} (at most {lim.exponent:,})")
        return super().call_binop(context, operator, left, right)

# Used when a checkpoint ships no template: plain ChatML, the format of the models we support.
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
          "+ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


class TemplateError(ValueError):
    pass


def _raise(message: str):
    raise TemplateError(f"the chat template refused the conversation: {message}")


def _tojson(value, indent=None, ensure_ascii=False, sort_keys=False, separators=None):
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys, separators=separators)


class ChatTemplate:
    def __init__(self, source: str | None, bos_token: str | None = None, eos_token: str | None = None,
                 limits: Limits = Limits()):
        self.source = source or CHATML
        self.limits = limits
        self._budget: _Budget | None = None
        env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.limits = limits
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.globals["range"] = lambda *args: _Range(lambda: self._budget, *args)
        try:
            self._template = env.from_string(self.source)
        except jinja2.TemplateSyntaxError as e:
            raise TemplateError(f"the chat template has a syntax error at line {e.lineno}: {e.message}") from None
        self.bos_token, self.eos_token = bos_token or "", eos_token or ""
        self.variables = frozenset(meta.find_undeclared_variables(env.parse(self.source)))

    def reads(self, name: str) -> bool:
        """Whether the template reads this variable (enable_thinking, tools, ...)."""
        return name in self.variables

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        self._budget = budget = _Budget(self.limits)
        try:
            parts, size = [], 0
            for chunk in self._template.generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                                 bos_token=self.bos_token, eos_token=self.eos_token, **extra):
                size += len(chunk)
                if size > self.limits.text:
                    raise TemplateError(f"the chat template made more than {self.limits.text:,} characters")
                parts.append(chunk)
                budget.tick()
            budget.check()
            return "".join(parts)
        except TemplateError:
            raise
        except jinja2.exceptions.SecurityError as e:
            raise TemplateError(f"the chat template tried an unsafe operation: {e}") from None
        except jinja2.TemplateError as e:
            raise TemplateError(f"the chat template failed: {e}") from None
        except (ArithmeticError, LookupError, TypeError, ValueError, RecursionError, MemoryError) as e:
            # (the template is the checkpoint's code: 1/0, a sandbox range limit, runaway recursion)
            raise TemplateError(f"the chat template failed: {type(e).__name__}: {str(e)[:120]}") from None
        finally:
            self._budget = None
