"""The exceptions that mean bad input: `chat` reports them as one line and exit status 2, a
replay suite as an invalid recording. Anything else is a bug and keeps its traceback."""
from __future__ import annotations


def user_errors() -> tuple[type[BaseException], ...]:
    """Imported when asked, so that `chat --help` loads no model code."""
    from engine.config import ConfigError
    from engine.constraint import ConstraintDeadEnd
    from engine.session import ContextOverflow, ReuseMismatch
    from engine.state import RewindError
    from models import CheckpointError

    from .constraints import ConstraintError
    from .template import TemplateError
    from .transcript import TranscriptError
    return (ConfigError, CheckpointError, TemplateError, ContextOverflow, RewindError, TranscriptError,
            ReuseMismatch, ConstraintError, ConstraintDeadEnd)
