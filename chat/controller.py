"""The chat application's state, independent of any terminal: one runtime, one conversation.

`ChatController` owns the conversation, the live settings and the turn log, and runs turns on
the process's one DecodeSession. The REPL, `chat run` and `chat replay` all drive it, so they
behave identically. The conversation is a tree: `/edit N` forks a branch that shares the first
N-1 exchanges and goes on with an edited N-th message; `turns` (and the messages the template
renders) are those of the current branch, which /undo, /retry and new turns change;
`switch(k)` makes another branch current, and the session reuses the prefix they share. A turn that fails or is interrupted changes nothing: the conversation keeps
its messages and the session is rolled back to its pre-turn length (or reset where recurrent
state cannot rewind), so the next turn works.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

from engine.sampling import SAMPLER_VERSION, resolve_seed
from engine.session import ReuseMismatch, common_prefix

from .constraints import Compiled, Format
from .conversation import Conversation
from .runtime import Runtime
from .settings import Settings
from .turn import TurnResult, run_turn


@dataclass
class TurnRecord:
    """One completed exchange, as recordings store it."""
    user: str
    result: TurnResult
    settings: dict = field(default_factory=dict)
    format: Format | None = None  # the output format in force for this turn
    think: str = "auto"  # the `think` setting the prompt was rendered with


@dataclass
class Branch:
    """A line of exchanges. `parent`, `fork`: the branch it was forked from and how many of its
    exchanges it shared then (None, 0 for the first)."""
    turns: list = field(default_factory=list)
    parent: int | None = None
    fork: int = 0


class ChatController:
    def __init__(self, runtime: Runtime, settings: Settings | None = None):
        self.rt = runtime
        self.settings = settings or runtime.settings
        self.conv: Conversation = runtime.conversation()
        self.conv.system_prompt = self.settings.ui.system_prompt
        self.conv.think = self.settings.ui.think
        self.branches: list[Branch] = [Branch()]
        self.current = 0
        self.last: TurnResult | None = None
        self.sampler_version = SAMPLER_VERSION  # recordings carry it; replaying one sets its own
        self.format: Format | None = None  # the output format (/format, --json-schema, ...)
        self._compiled: Compiled | None = None

    @property
    def session(self):
        return self.rt.session

    @property
    def tokenizer(self):
        return self.rt.loaded.tokenizer

    def set(self, key: str, value) -> None:
        settings = self.settings.with_value(key, value)
        if key == "speculative":  # the live session's (a ConfigError where unavailable: nothing changes)
            self.session.set_speculative(settings.engine.speculative)
        self.settings = settings
        if key == "system_prompt":
            self.conv.system_prompt = self.settings.ui.system_prompt
        if key == "think":
            self.conv.think = self.settings.ui.think

    def set_format(self, fmt: Format | None, where: str = "") -> None:
        """Check the format against this model's tokenizer (a ConstraintError names the place)
        and use it for the following turns; None: free text."""
        compiled = None
        if fmt is not None:
            s = self.session
            compiled = fmt.compile(self.tokenizer, s.eos_ids, s.vocab_size, where)
        self.format, self._compiled = fmt, compiled

    def prompt_ids(self, user_text: str) -> list[int]:
        return self.conv.prompt_ids(user_text)

    def send(self, user_text: str, result: TurnResult, seed: int | None = None,
             forced: list[int] | None = None, expected: list[int] | None = None) -> Iterator[str]:
        """Stream one reply. The exchange joins the conversation only when the reply completes.
        The draws are keyed by the number of exchanges before this one (engine/sampling.py);
        `forced`: a teacher-forced replay's recorded ids (chat/replay.py); `expected`: an exact
        replay's, drafted first (they change no token)."""
        ids = self.prompt_ids(user_text)
        result.prompt_ids = ids
        sampling = self.settings.sampling
        seed = resolve_seed(sampling.seed) if seed is None else seed
        self.session.check_fits(ids)  # refuse before anything changes
        before = list(self.session.cached)
        completed = False
        try:
            constraint = None if self._compiled is None else self._compiled.constraint()
            yield from run_turn(self.session, self.tokenizer, ids, sampling, seed, result,
                                turn=len(self.turns), sampler=self.sampler_version, forced=forced,
                                constraint=constraint, expected=expected)
            completed = True
        except ReuseMismatch as e:
            raise ReuseMismatch(f"turn {len(self.turns) + 1}: {e}") from None
        finally:
            if not completed:
                self._rollback(before)
        self.conv.add_exchange(user_text, result.text)
        self.turns.append(TurnRecord(user_text, result, self.sampling_dict(), self.format, self.conv.think))
        self.last = result

    @property
    def turns(self) -> list[TurnRecord]:
        """The current branch's exchanges."""
        return self.branches[self.current].turns

    @turns.setter
    def turns(self, value: list[TurnRecord]) -> None:
        self.branches[self.current].turns = value

    def edit_text(self, n: int) -> str:
        """The current branch's n-th user message (1-based), to edit; ValueError where there is none."""
        if not 1 <= n <= len(self.turns):
            raise ValueError(f"there is no exchange {n} to edit (this branch has {len(self.turns)})")
        return self.turns[n - 1].user

    def fork(self, n: int) -> int:
        """A new branch with the current one's first n-1 exchanges, made current; its index."""
        self.edit_text(n)
        self.branches.append(Branch(list(self.turns[:n - 1]), self.current, n - 1))
        self.switch(len(self.branches) - 1)
        return self.current

    def edit(self, n: int, user_text: str, result: TurnResult, **kwargs) -> Iterator[str]:
        """Fork at exchange n and send `user_text` there: the first turn of the new branch. A
        reply that fails or is interrupted leaves no branch: the one before is current again."""
        before = self.current
        self.fork(n)
        completed = False
        try:
            yield from self.send(user_text, result, **kwargs)
            completed = True
        finally:
            if not completed:
                self.branches.pop()
                self.switch(before)

    def switch(self, k: int) -> None:
        """Make branch k (0-based) current: its messages are the conversation's."""
        if not 0 <= k < len(self.branches):
            raise ValueError(f"there is no branch {k + 1} (there are {len(self.branches)})")
        self.current = k
        self.conv.clear()
        for t in self.turns:
            self.conv.add_exchange(t.user, t.result.text)
        self.last = self.turns[-1].result if self.turns else None

    def tree_signature(self) -> tuple:
        """What the tree holds, cheaply: each branch's turns and which is current."""
        return tuple(tuple(id(t.result) for t in b.turns) for b in self.branches) + (self.current,)

    def _rollback(self, before: list[int]) -> None:
        """Keep only what is still exactly the pre-turn state: the prefix shared with it
        (on hybrid models through the newest checkpoint at or before it)."""
        self.session.rollback_to(common_prefix(self.session.cached, before))

    def sampling_dict(self) -> dict:
        import dataclasses
        return dataclasses.asdict(self.settings.sampling)

    def undo(self) -> tuple[str, str] | None:
        dropped = self.conv.undo()
        if dropped is not None:
            self.turns.pop()
            self.last = self.turns[-1].result if self.turns else None
        return dropped

    def pop_for_retry(self) -> str | None:
        """Drop the last exchange and return its user text, to be sent again."""
        dropped = self.undo()
        return None if dropped is None else dropped[0]

    def reset(self) -> None:
        """A new conversation; the cache is cleared too."""
        self.reset_conversation(keep_cache=False)

    def reset_conversation(self, keep_cache: bool) -> None:
        """Forget the messages. With keep_cache the session keeps its state, and the next turn
        reuses whatever prefix still matches (what replay's reused-session runs exercise)."""
        self.conv.clear()
        self.branches, self.current = [Branch()], 0
        self.last = None
        if not keep_cache:
            self.session.reset()

    def replace_runtime(self, runtime: Runtime, settings: Settings) -> None:
        """Continue the conversation on another runtime (model): its own template renders the
        same messages, and the next turn prefills them on the new session."""
        messages, system, think = self.conv.messages, self.conv.system_prompt, self.conv.think
        self.rt, self.settings = runtime, settings
        self.conv = runtime.conversation()
        self.conv.system_prompt, self.conv.messages, self.conv.think = system, messages, think
        self.set_format(self.format)  # compiled again for the new tokenizer

    @property
    def context_used(self) -> int:
        return self.session.state.length
