"""The turn-boundary checkpoint property (tests/engine/test_checkpoints.py and the families' own):
a controller on a tiny model, sends, /undo, /retry and resets drawn by Hypothesis, every reply
checked against a cold session's."""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings, strategies as st

from chat.controller import ChatController
from chat.runtime import open_runtime
from chat.settings import load_settings
from chat.turn import TurnResult
from engine.session import DecodeSession


WORDS = ["alpha", "beta", "gamma", "delta", "the end", "why?", "more please"]


def controller(path, **over):
    s = load_settings(None, env={}, overrides={"model": path, "max_new_tokens": "6", "history_file": "/dev/null",
                                               **over})
    return ChatController(open_runtime(s), s)


def cold_tokens(c: ChatController, prompt_ids, sampling, seed):
    """A brand-new session over the same prompt, drawing as the controller's last turn did (keyed
    by the exchanges before it): the ground truth for a warm generation."""
    s = DecodeSession(c.session.model, max_context=c.session.max_context, device=c.session.device,
                      dtype=c.session.dtype, eos_ids=c.session.eos_ids)
    return list(s.generate(prompt_ids, sampling, seed=seed, turn=len(c.turns) - 1))


def send_checked(c: ChatController, op: tuple) -> TurnResult | None:
    """("send", text) or ("retry",): the reply checked against a cold session's (seed 3); None
    where there was nothing to retry."""
    text = c.pop_for_retry() if op[0] == "retry" else op[1]
    if text is None:
        return None
    r = TurnResult([])
    list(c.send(text, r, seed=3))
    assert r.ids == cold_tokens(c, r.prompt_ids, c.settings.sampling, 3)
    assert c.session.state.length == len(c.session.cached)
    return r


def check_undo_and_retry(c: ChatController) -> None:
    """/retry of the last turn prefills nothing (its prompt's checkpoint holds the logits); /undo
    then a new message restores the checkpoint after turn 1 and prefills only the gap."""
    list(c.send("alpha", TurnResult([])))
    list(c.send("beta", TurnResult([])))
    r = TurnResult([])
    list(c.send(c.pop_for_retry(), r))
    assert r.stats.prefilled_tokens == 0 and r.stats.reused_tokens == len(r.prompt_ids)
    c.undo()
    r = TurnResult([])
    list(c.send("gamma", r))
    assert 0 < r.stats.reused_tokens and r.stats.prefilled_tokens < len(r.prompt_ids) - 10


def check_property(c, examples: int) -> None:
    """Hypothesis's op lists (sends, /undo, /retry, resets) on one controller: run_ops checks every
    generation against a cold session."""
    @settings(max_examples=examples, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                           HealthCheck.too_slow])
    @given(OPS)
    def run(ops):
        run_ops(c, ops)
    run()


def run_ops(c: ChatController, ops) -> None:
    """A fresh conversation, then each op: ("send", text), ("retry",), ("undo",) or ("reset",)
    (the conversation forgotten, the cache kept); every reply checked against a cold session's."""
    c.reset()
    for op in ops:
        if op[0] == "undo":
            c.undo()
        elif op[0] == "reset":
            c.reset_conversation(keep_cache=True)
        else:
            send_checked(c, op)


OPS = st.lists(st.one_of(st.tuples(st.just("send"), st.sampled_from(WORDS)), st.just(("undo",)),
                         st.just(("retry",)), st.just(("reset",))), min_size=3, max_size=9)
