"""The decode engine: tokens in, tokens out; knows nothing of text or terminals."""
