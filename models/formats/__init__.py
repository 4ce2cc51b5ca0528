"""Checkpoint formats: HF safetensors directories and GGUF files (checkpoints.py), GGUF's
quantized tensors and the CPU modules that compute on them (quant.py), GGUF vocabularies as
`tokenizers` objects (gguf_tokenizer.py), and the loader that builds an architecture from a
checkpoint (loader.py). Nothing here runs a forward."""
