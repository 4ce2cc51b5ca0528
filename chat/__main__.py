"""`chat` entry point: the REPL by default, `--prompt` for one reply, `run`, `replay`, `bench`.

Every setting is a flag (`--max-context 4096`, `--temperature 0`), generated from the settings
dataclasses so flags, config.yaml keys and CHAT_* variables stay one to one. Expected failures
(bad config, missing or corrupt model, context overflow) print one line and exit 2; Ctrl-C
exits 130; no traceback reaches the user.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

from .settings import SECTIONS

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def add_setting_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="PATH", help="a config.yaml overriding the defaults")
    for section, cls in SECTIONS.items():
        group = parser.add_argument_group(f"{section} settings (config.yaml keys)")
        for f in dataclasses.fields(cls):
            group.add_argument(f"--{f.name.replace('_', '-')}", dest=f"set_{f.name}", metavar="VALUE",
                               help=f"{f.metadata['allowed']} (default: {_default(f)!r})")


def _default(f):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def overrides(args: argparse.Namespace) -> dict:
    return {k[4:]: v for k, v in vars(args).items() if k.startswith("set_") and v is not None}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="chat", description="Chat with a local LLM in the terminal.")
    parser.add_argument("--prompt", help="answer one prompt, print the reply and exit")
    add_setting_flags(parser)
    return parser


def fail(message: str, code: int = EXIT_USAGE) -> int:
    print(f"chat: error: {message}", file=sys.stderr)
    return code


def user_errors() -> tuple[type[BaseException], ...]:
    """The exceptions that mean bad input, reported as one line (anything else is a bug)."""
    from engine.config import ConfigError
    from engine.session import ContextOverflow
    from engine.state import RewindError
    from models.checkpoints import CheckpointError

    from .template import TemplateError
    return (ConfigError, CheckpointError, TemplateError, ContextOverflow, RewindError)


def one_shot(rt, text: str) -> int:
    from .turn import TurnResult, run_turn

    conv = rt.conversation()
    ids = conv.prompt_ids(text)
    result = TurnResult(ids)
    for chunk in run_turn(rt.session, rt.loaded.tokenizer, ids, rt.settings.sampling, None, result):
        sys.stdout.write(chunk)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def run_main(argv: list[str]) -> int:
    from .runtime import open_runtime
    from .settings import load_settings

    args = build_parser().parse_args(argv)
    settings = load_settings(args.config, overrides=overrides(args))
    if args.prompt is not None:
        return one_shot(open_runtime(settings), args.prompt)
    from .repl import run_repl
    return run_repl(settings)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        return run_main(argv)
    except user_errors() as e:
        return fail(str(e))
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
