"""`chat` entry point: the REPL by default, `--prompt` for one reply, `run`, `replay`, `plan`.

Every setting is a flag (`--max-context 4096`, `--temperature 0`), generated from the settings
dataclasses so flags, config.yaml keys and CHAT_* variables stay one to one. Expected failures
(bad config, missing or corrupt model, context overflow) print one line and exit 2; a reply that
max_new_tokens or the context cut off before its output format was complete exits 3 (--prompt,
piped input) with a one-line notice; Ctrl-C exits 130; no traceback reaches the user.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

from .errors import user_errors
from .settings import SECTIONS

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # (3, a constrained reply cut off: chat/turn.py's EXIT_CUT_OFF)


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line and names where help is."""

    def error(self, message: str):
        print(f"{self.prog}: error: {message}; see `{self.prog} --help`", file=sys.stderr)
        sys.exit(EXIT_USAGE)


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
    parser = Parser(
        prog="chat", description="Chat with a local LLM in the terminal.",
        epilog="subcommands: `chat run SCRIPT.yaml [-o REC.yaml]`, `chat replay REC.yaml|DIR ... [--runs N] "
               "[--tolerance MARGIN] [--junit FILE]`, `chat plan [MODEL]` (each takes --help)")
    parser.add_argument("--prompt", help="answer one prompt, print the reply and exit")
    parser.add_argument("--resume", nargs="?", const="", metavar="FILE",
                        help="continue a saved conversation (default: the latest; /history lists them)")
    parser.add_argument("--version", action="store_true", help="print the versions and the device chat would use")
    add_format_flags(parser)
    add_setting_flags(parser)
    return parser


FORMAT_FLAGS = {"json_schema": "--json-schema", "regex": "--regex", "grammar": "--grammar"}


def add_format_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("output format (the REPL's /format)").add_mutually_exclusive_group()
    group.add_argument("--json-schema", metavar="FILE|JSON", help="replies are JSON valid under this schema")
    group.add_argument("--regex", metavar="RE", help="replies match this regular expression in full")
    group.add_argument("--grammar", metavar="FILE", help="replies follow this Lark grammar (llguidance's dialect)")


def format_arg(args):
    """(Format, the flag naming it in errors) from --json-schema/--regex/--grammar, or (None, "").
    A file that cannot be read or JSON that does not parse fails here, before the model loads."""
    from .constraints import parse_arg
    for kind, flag in FORMAT_FLAGS.items():
        value = getattr(args, kind)
        if value is not None:
            where = f"{flag} {value}" if kind == "grammar" or not value.lstrip().startswith("{") else flag
            return parse_arg(kind, value, flag), where
    return None, ""


def build_run_parser() -> argparse.ArgumentParser:
    p = Parser(prog="chat run", description="Run a scripted conversation and record it.")
    p.add_argument("script", help="a transcript (YAML) of user turns and commands")
    p.add_argument("-o", "--output", help="write the recording (token ids, settings, fingerprint) here")
    add_setting_flags(p)
    return p


def build_replay_parser() -> argparse.ArgumentParser:
    p = Parser(prog="chat replay", description="Replay recordings and compare token by token; several files "
                                "or a directory run as a suite with a table. Exit 0: identical (or near ties "
                                "within --tolerance); 1: a divergence; 2: an invalid file or a different model.")
    p.add_argument("recordings", nargs="+", metavar="RECORDING", help="a recording, or a directory of them (*.yaml)")
    p.add_argument("--runs", type=int, default=1, help="extra runs on the same reused session (default 1)")
    p.add_argument("--tolerance", type=float, metavar="MARGIN",
                   help="teacher-forced: feed the recorded tokens; a different choice whose log-prob is within "
                        "MARGIN of the recorded token's is a near tie, not a divergence")
    p.add_argument("--junit", metavar="FILE", help="also write the results as JUnit XML")
    p.add_argument("--allow-model-change", action="store_true", help="compare even if the fingerprint differs")
    add_setting_flags(p)
    return p


def fail(message: str, code: int = EXIT_USAGE) -> int:
    print(f"chat: error: {message}", file=sys.stderr)
    return code


def one_shot(rt, text: str, fmt=None, where: str = "") -> int:
    from .turn import EXIT_CUT_OFF, TurnResult, cut_off_notice, run_turn

    from .conversation import think_note
    s = rt.session
    note = think_note(rt.template, rt.settings.ui.think)
    if note:
        print(f"chat: note: {note}", file=sys.stderr)
    constraint = None if fmt is None else fmt.compile(rt.loaded.tokenizer, s.eos_ids, s.vocab_size, where).constraint()
    conv = rt.conversation()
    ids = conv.prompt_ids(text)
    result = TurnResult(ids)
    for chunk in run_turn(rt.session, rt.loaded.tokenizer, ids, rt.settings.sampling, None, result,
                          constraint=constraint):
        sys.stdout.write(chunk)
        sys.stdout.flush()
    sys.stdout.write("\n")
    if result.cut_off:  # printed as far as it got, but never passed off as whole
        sys.stdout.flush()
        print(f"chat: note: {cut_off_notice(result, rt.settings.sampling, s.max_context, '--max-new-tokens')}",
              file=sys.stderr)
        return EXIT_CUT_OFF
    return 0


def settings_for(args, transcript=None, sections=("engine",)):
    """Config and flags; a transcript's engine section (and with `sections`, its sampling
    section) fills what no flag set."""
    from .settings import KEY_SECTION, load_settings

    given, origins = overrides(args), {}
    if transcript is not None:
        recorded = dict(transcript.engine)
        recorded.pop("cpu_isa", None)  # (the recording CPU's vector level, for replay's note: not the setting)
        recorded.pop("kernel_plan", None)  # (the kernels that served it, for replay's note: not a setting)
        if transcript.model.get("fingerprint") and "quantized" not in recorded:
            recorded["quantized"] = "off"  # recorded before the setting existed: weights were dequantized
        if transcript.model.get("fingerprint") and "cpu_kernel" not in recorded:
            recorded["cpu_kernel"] = "off"  # recorded before the C++ CPU step existed: the torch step ran
        if transcript.model.get("fingerprint") and "cpu_int8" not in recorded:
            recorded["cpu_int8"] = "off"  # recorded before the setting existed: fp32 inputs
        if transcript.model.get("source"):
            recorded["model"] = transcript.model["source"]
        if "sampling" in sections:
            recorded.update(transcript.sampling)
        for key, value in recorded.items():
            if KEY_SECTION.get(key) in sections and key not in given:
                given[key] = value
                origins[key] = f"the recording {transcript.path}" if transcript.path else "the recording"
    return load_settings(args.config, overrides=given, origins=origins)


def cmd_run(argv: list[str]) -> int:
    import os

    from . import transcript as tr
    from .commands import write_problem
    from .controller import ChatController
    from .replay import play
    from .runtime import open_runtime
    from .turn import EXIT_CUT_OFF

    args = build_run_parser().parse_args(argv)
    problem = args.output is not None and write_problem(args.output)
    if problem:  # before the run, not after it
        return fail(f"-o {args.output}: {problem}")
    script = tr.load(args.script)
    settings = settings_for(args, script)
    rt = open_runtime(settings)
    controller = ChatController(rt, rt.settings)

    def show(chunk):
        sys.stdout.write(chunk)
        sys.stdout.flush()

    cut_off: list[str] = []
    events = play(controller, script, show, cut_off=cut_off)
    if args.output:
        rec = tr.recording_from(controller, events)
        rec.sampling = dict(script.sampling)
        rec.system_prompt = script.system_prompt
        rec.format = script.format
        try:
            tr.write_atomic(os.path.realpath(args.output), tr.to_yaml(rec))
        except OSError as e:
            return fail(f"-o {args.output}: cannot write: {e.strerror or e}; name another path")
        print(f"recorded {sum(e.result is not None for e in events)} turns to {args.output}", file=sys.stderr)
    for line in cut_off:  # (recorded as they ran, finish_reason length; never passed off as whole)
        print(f"chat: note: {line}", file=sys.stderr)
    return EXIT_CUT_OFF if cut_off else 0


def cmd_replay(argv: list[str]) -> int:
    import math
    import os

    from .suite import print_report, run_suite, show_problem

    args = build_replay_parser().parse_args(argv)
    if args.runs < 0:
        return fail("--runs must be 0 or more")
    if args.tolerance is not None and not (math.isfinite(args.tolerance) and args.tolerance >= 0):
        return fail(f"--tolerance {args.tolerance:g}: the margin must be a finite log-probability difference >= 0")
    if args.junit:
        from .commands import write_problem
        problem = write_problem(args.junit)
        if problem:
            return fail(f"--junit {args.junit}: {problem}")
    single = len(args.recordings) == 1 and not os.path.isdir(args.recordings[0])  # reported as before suites
    result = run_suite(args.recordings, lambda rec: settings_for(args, rec), args.runs, args.tolerance,
                       args.allow_model_change, on_outcome=None if single else show_problem)
    if args.junit:
        from .junit import write_junit
        try:
            write_junit(os.path.realpath(args.junit), result)
        except OSError as e:
            print_report(result, single, args.runs)
            return fail(f"--junit {args.junit}: cannot write: {e.strerror or e}; name another path")
    return print_report(result, single, args.runs)


def print_version(args) -> int:
    from importlib import metadata

    import torch

    from engine.device import resolve_device
    from .settings import load_settings
    try:
        version = metadata.version("chat-engine")
    except metadata.PackageNotFoundError:
        version = "(not installed)"
    device = resolve_device(load_settings(args.config, overrides=overrides(args)).engine)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"chat {version} · torch {torch.__version__} · device {device} ({name})")
    return 0


def resume(args) -> int:
    """`chat --resume [FILE]`: the conversation's model and engine settings (flags still win), its
    sampling settings, its messages; the REPL goes on saving into the same file."""
    from . import transcript as tr
    from .conversations import ConversationStore, default_directory
    from .repl import run_repl
    from .settings import load_settings

    path = args.resume
    if not path:
        ui = load_settings(args.config, overrides=overrides(args)).ui
        directory = default_directory(ui.conversations_dir)
        path, skipped = ConversationStore(directory, ui.keep_conversations).latest_readable()
        if path is None and skipped:
            return fail(f"no saved conversation in {directory} reads ({'; '.join(skipped)}); "
                        "start a new one with `chat`")
        if path is None:
            return fail(f"no saved conversation in {directory}; "
                        "start one with `chat` (the REPL saves each turn)")
        if skipped:
            print(f"chat: note: skipped {len(skipped)} newer saved conversation{'s' * (len(skipped) > 1)} "
                  f"that do{'es' * (len(skipped) == 1)} not read: {'; '.join(skipped)}", file=sys.stderr)
    rec = tr.load(path)
    if not rec.is_recording:
        return fail(f"{path}: not a recording (no turn has results); run a script with `chat run`")
    return run_repl(settings_for(args, rec, sections=("engine", "sampling")), resume=path)


def build_plan_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="chat plan",
                    description="Print a model's kernel plan: each op's kernel on the device and why, and "
                                "the bytes a decode step reads with the floor a memory bandwidth puts under it.")
    parser.add_argument("model", nargs="?", help="an alias or a path (default: the model setting)")
    parser.add_argument("--bandwidth", type=float, metavar="GB/s",
                        help="memory bandwidth for the floor (default: the GPU's peak by its name, else measured "
                             "by a copy; needed for --device cuda on a host without one)")
    add_setting_flags(parser)
    return parser


def cmd_plan(argv: list[str]) -> int:
    import math

    import torch

    import models
    from engine.device import configure_process, configure_threads, kernel_config, memory_bandwidth, resolve_dtype
    from .plan_report import report
    from .runtime import keeps_blocks
    from .settings import load_settings

    args = build_plan_parser().parse_args(argv)
    if args.bandwidth is not None and not (math.isfinite(args.bandwidth) and 0 < args.bandwidth < 1e6):
        return fail(f"--bandwidth {args.bandwidth:g}: give the memory bandwidth in GB/s, a number above 0")
    given = overrides(args)
    if args.model is not None:
        given["model"] = args.model
    eng = load_settings(args.config, overrides=given).engine
    here = torch.cuda.is_available()
    target = torch.device("cuda" if eng.device == "cuda" or (eng.device == "auto" and here) else "cpu")
    load_on = target if target.type == "cpu" or here else torch.device("cpu")
    dtype, why = resolve_dtype(eng, target, models.native_dtype(models.resolve(eng.model)))
    configure_threads(eng)
    configure_process()
    kernels = kernel_config(eng)
    loaded = models.load(eng.model, load_on, dtype, quantized=keeps_blocks(eng, target), kernels=kernels)
    plan = loaded.plan if load_on == target else models.plan.make(loaded.model, target, dtype, kernels)
    if load_on != target:
        plan.notes.append("modules as this CPU's load holds them: a CUDA load keeps each GGUF matrix in the "
                          "file's blocks, so its bytes may differ by a few percent")
    if args.bandwidth is not None:
        bandwidth = (args.bandwidth * 1e9, "given")
    else:
        bandwidth = memory_bandwidth(load_on) if load_on.type == target.type else None
    name = str(dtype).replace("torch.", "")
    where = f"{target.type}" + ("" if load_on.type == target.type else " (planned on this CPU: no CUDA device here)")
    title = (f"kernel plan of {loaded.source} ({loaded.model_type}, {loaded.weight_format}) on {where}, "
             f"{name} ({why}), quantized: {eng.quantized}")
    print(report(plan, title, bandwidth, eng.max_context))
    return 0


def run_main(argv: list[str]) -> int:
    from .runtime import open_runtime
    from .settings import load_settings

    if argv and argv[0] == "run":
        return cmd_run(argv[1:])
    if argv and argv[0] == "replay":
        return cmd_replay(argv[1:])
    if argv and argv[0] == "plan":
        return cmd_plan(argv[1:])
    args = build_parser().parse_args(argv)
    if args.version:
        return print_version(args)
    if args.resume is not None:
        if args.prompt is not None:
            return fail("--resume continues a conversation in the REPL; it does not take --prompt")
        return resume(args)
    settings = load_settings(args.config, overrides=overrides(args))
    fmt, where = format_arg(args)
    if args.prompt is not None:
        from .input_text import NOTICE, clean
        prompt, replaced = clean(args.prompt)
        if replaced:
            print(f"chat: note: --prompt {NOTICE}", file=sys.stderr)
        return one_shot(open_runtime(settings), prompt, fmt, where)
    from .repl import run_repl
    return run_repl(settings, fmt=(fmt, where))


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
