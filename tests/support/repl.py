"""The REPL driven through a pipe input and a dummy output: what it printed for a list of typed lines."""
from __future__ import annotations

from prompt_toolkit.input import create_pipe_input
from prompt_toolkit.output import DummyOutput

from chat.repl import make_prompt_session, run_loop


class Out:
    def __init__(self):
        self.parts = []

    def write(self, s):
        self.parts.append(s)

    def flush(self):
        pass

    def isatty(self):
        return False

    @property
    def text(self):
        return "".join(self.parts)


def drive(app, settings, keys: str):
    with create_pipe_input() as inp:
        inp.send_text(keys)
        session = make_prompt_session(settings, input=inp, output=DummyOutput())
        return run_loop(app, session)
