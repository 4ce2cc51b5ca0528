"""The chat application: text in, text out (REPL, one-shot, scripted runs, replay)."""
