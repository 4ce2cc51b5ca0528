"""Output: rich streaming markdown on a terminal, byte-stable plain text otherwise.

`Renderer.stream(chunks)` shows a reply as it arrives. On a terminal: finished markdown blocks are
committed above a live block that keeps updating; reasoning between `<think>` and `</think>` is
shown dimmed; a stats line follows each turn. Plain mode (stdout not a TTY, or color=never):
the reply text exactly, a newline, nothing else on stdout. `NO_COLOR` turns colour off.
"""
from __future__ import annotations

import os
import sys
from typing import Iterable, TextIO

from rich.console import Console, Group
from rich.live import Live
from rich.markdown import Markdown
from rich.text import Text

from engine.session import GenerationStats


def split_committed(text: str) -> tuple[str, str]:
    """(finished blocks, live tail): cut at the last blank line that is outside a code fence."""
    cut, fence, pos = 0, False, 0
    for line in text.splitlines(keepends=True):
        pos += len(line)
        if line.lstrip().startswith(("```", "~~~")):
            fence = not fence
        elif not fence and line.strip() == "" and pos < len(text):
            cut = pos
    return text[:cut], text[cut:]


def split_reasoning(text: str) -> tuple[str, str]:
    """(reasoning, answer): reasoning is what lies inside a leading <think>…</think>."""
    stripped = text.lstrip()
    if not stripped.startswith("<think>"):
        return "", text
    body = stripped[len("<think>"):]
    end = body.find("</think>")
    if end < 0:
        return body, ""
    return body[:end], body[end + len("</think>"):].lstrip("\n")


def format_stats(stats: GenerationStats, used: int, max_context: int, finish: bool = False) -> str:
    """The stats line; it names the finish reason where the reply did not end by itself (or with
    `finish`, always)."""
    ttft = stats.prefill_seconds
    end = f" · finish: {stats.finish_reason}" if finish or stats.finish_reason not in ("stop", "") else ""
    spec = (f"drafts {stats.accepted}/{stats.drafted} kept ({stats.acceptance:.0%}) in {stats.verifies} "
            f"verifies · ") if stats.drafted else ""
    return (f"{ttft:.2f}s to first token · {stats.decode_tps:.1f} tok/s · {stats.generated_tokens} tokens · "
            f"{spec}prompt {stats.prompt_tokens} (reused {stats.reused_tokens}, new {stats.prefilled_tokens}) · "
            f"context {used}/{max_context}{end}")


class Renderer:
    def __init__(self, out: TextIO | None = None, color: str = "auto", markdown: bool = True,
                 show_stats: bool = True, force_terminal: bool | None = None):
        self.out = out or sys.stdout
        is_tty = force_terminal if force_terminal is not None else self.out.isatty()
        self.rich = is_tty and color != "never"
        no_color = color == "never" or (color == "auto" and "NO_COLOR" in os.environ)
        self.console = Console(file=self.out, force_terminal=self.rich or color == "always",
                               no_color=no_color, highlight=False, soft_wrap=not self.rich)
        self.markdown = markdown
        self.show_stats_line = show_stats and self.rich

    # --- replies ----------------------------------------------------------------------------
    def stream(self, chunks: Iterable[str]) -> str:
        """Show chunks as they come; returns the full text. Interruptions propagate."""
        if not self.rich:
            return self._stream_plain(chunks)
        text = ""
        committed = 0
        with Live(console=self.console, refresh_per_second=12, transient=True,
                  vertical_overflow="visible") as live:
            try:
                for chunk in chunks:
                    text += chunk
                    reasoning, answer = split_reasoning(text)
                    if not reasoning and self.markdown:
                        done, _ = split_committed(answer)
                        if len(done) > committed:
                            live.console.print(Markdown(done[committed:]))
                            committed = len(done)
                    live.update(self._view(reasoning, answer[committed:] if not reasoning else answer))
            finally:
                live.update(Text(""))
        reasoning, answer = split_reasoning(text)
        if reasoning:
            self.console.print(Text(reasoning.strip(), style="dim italic"))
        rest = answer[committed:] if not reasoning else answer
        if rest.strip():
            self.console.print(Markdown(rest) if self.markdown else Text(rest))
        return text

    def _view(self, reasoning: str, answer: str):
        parts = []
        if reasoning:
            parts.append(Text(reasoning, style="dim italic"))
        if answer:
            parts.append(Markdown(answer) if self.markdown else Text(answer))
        return Group(*parts)

    def _stream_plain(self, chunks: Iterable[str]) -> str:
        text = ""
        try:
            for chunk in chunks:
                text += chunk
                self.out.write(chunk)
                self.out.flush()
        finally:
            self.out.write("\n")
            self.out.flush()
        return text

    # --- everything else ----------------------------------------------------------------------
    def stats(self, stats: GenerationStats, used: int, max_context: int) -> None:
        if self.show_stats_line:
            self.console.print(Text(format_stats(stats, used, max_context), style="dim"))

    def info(self, message: str) -> None:
        if self.rich:
            self.console.print(Text(message, style="cyan"))
        else:
            self.out.write(message + "\n")
            self.out.flush()

    def error(self, message: str) -> None:
        # errors go to stderr in plain mode so stdout stays byte-stable for scripts
        if self.rich:
            self.console.print(Text(f"error: {message}", style="bold red"))
        else:
            print(f"error: {message}", file=sys.stderr, flush=True)

    def notice(self, message: str) -> None:
        if self.rich:
            self.console.print(Text(message, style="dim"))
        else:  # stderr: stdout stays the replies alone
            print(message, file=sys.stderr, flush=True)
