"""Chat templates: untrusted Jinja from model files, rendered in a sandbox.

`ChatTemplate.render(messages, add_generation_prompt)` gives the prompt text. The environment is
jinja2's ImmutableSandboxedEnvironment (no attribute tricks, no mutation of passed objects), with
the helpers HF templates expect: `raise_exception`, `tojson`, `strftime_now`, `bos_token`,
`eos_token`. A template error becomes a `TemplateError` with a one-line message.
"""
from __future__ import annotations

import json
from datetime import datetime

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

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
    def __init__(self, source: str | None, bos_token: str | None = None, eos_token: str | None = None):
        self.source = source or CHATML
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(self.source)
        except jinja2.TemplateSyntaxError as e:
            raise TemplateError(f"the chat template has a syntax error at line {e.lineno}: {e.message}") from None
        self.bos_token, self.eos_token = bos_token or "", eos_token or ""

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token, eos_token=self.eos_token, **extra)
        except TemplateError:
            raise
        except jinja2.exceptions.SecurityError as e:
            raise TemplateError(f"the chat template tried an unsafe operation: {e}") from None
        except jinja2.TemplateError as e:
            raise TemplateError(f"the chat template failed: {e}") from None
        except (ArithmeticError, LookupError, TypeError, ValueError, RecursionError, MemoryError) as e:
            # (the template is the checkpoint's code: 1/0, a sandbox range limit, runaway recursion)
            raise TemplateError(f"the chat template failed: {type(e).__name__}: {str(e)[:120]}") from None
