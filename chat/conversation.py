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


@dataclass
class Conversation:
    template: ChatTemplate
    tokenizer: Tokenizer
    system_prompt: str = ""
    messages: list[dict] = field(default_factory=list)  # user/assistant turns, no system message

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

    def prompt_ids(self, user_text: str) -> list[int]:
        ids = self.encode(self.template.render(self.full_messages(user_text), add_generation_prompt=True))
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
