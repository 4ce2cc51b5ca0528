"""Checkpoint formats: HF safetensors directories and GGUF files (checkpoints.py), GGUF's
quantized tensors and the modules that compute on them (quant.py), HF quantized checkpoints
(hf_quant.py: FP8, AWQ, GPTQ), GGUF vocabularies as
`tokenizers` objects (gguf_tokenizer.py), and the loader that builds an architecture from a
checkpoint (loader.py). Nothing here runs a forward."""
