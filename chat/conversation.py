"""The conversation: messages ↔ prompt tokens through the chat template.

History holds what the model should see on later turns: assistant replies are stored without
their reasoning (`<think>…</think>`), as the models' own templates expect. Which tokens are
cached is the session's business; this class only renders the full prompt every turn, and the
session reuses whatever prefix matches.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from tokenizers import Tokenizer

from .template import ChatTemplate, TemplateError

_THINK = re.compile(r"<think>.*?(</think>\s*|$)", re.S)


def strip_reasoning(text: str) -> str:
    return _THINK.sub("", text).strip() if "<think>" in text else text


def think_note(template: ChatTemplate, think: str) -> str | None:
    """A notice where `think` is on or off but this model's template does not read
    enable_thinking (the setting then changes nothing), else None."""
    if think == "auto" or template.reads("enable_thinking"):
        return None
    return (f"think: {think} changes nothing here: this model's chat template does not read enable_thinking "
            f"(Qwen3, Qwen3.5 and Qwen3-Next templates do)")


def think_text(template: ChatTemplate, think: str) -> str:
    """The thinking mode in words, for /show and /think."""
    if think == "auto":
        return "auto (the template's own default)"
    if not template.reads("enable_thinking"):
        return f"{think} (this model's template does not read enable_thinking: no effect)"
    return f"{think} (enable_thinking={'true' if think == 'on' else 'false'})"


@dataclass
class Conversation:
    template: ChatTemplate
    tokenizer: Tokenizer
    system_prompt: str = ""
    messages: list[dict] = field(default_factory=list)  # user/assistant turns, no system message
    think: str = "auto"  # the `think` setting: on / off render with enable_thinking, auto without it

    def full_messages(self, user_text: str | None = None) -> list[dict]:
        msgs = ([{"role": "system", "content": self.system_prompt}] if self.system_prompt else [])
        msgs += self.messages
        if user_text is not None:
            msgs.append({"role": "user", "content": user_text})
        return msgs

    def encode(self, text: str) -> list[int]:
        # Special tokens in the rendered template are real control tokens; users' text is data,
        # but the template has already placed it, so one encode with specials parsed is exact.
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def render_args(self) -> dict:
        """What the template gets beside the messages: enable_thinking where `think` is on or off."""
        return {} if self.think == "auto" else {"enable_thinking": self.think == "on"}

    def prompt_ids(self, user_text: str) -> list[int]:
        ids = self.encode(self.template.render(self.full_messages(user_text), add_generation_prompt=True,
                                               **self.render_args()))
        if not ids:
            raise TemplateError("the chat template rendered nothing for this conversation")
        return ids

    def add_exchange(self, user_text: str, reply: str) -> None:
        self.messages.append({"role": "user", "content": user_text})
        self.messages.append({"role": "assistant", "content": strip_reasoning(reply)})

    def undo(self) -> tuple[str, str] | None:
        """Drop the last exchange; returns (user, reply) or None when empty."""
        if len(self.messages) < 2:
            return None
        reply = self.messages.pop()
        user = self.messages.pop()
        return user["content"], reply["content"]

    def clear(self) -> None:
        self.messages.clear()
