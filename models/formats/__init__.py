"""Checkpoint formats, read: HF safetensors directories and GGUF files (checkpoints.py), GGUF's
block layouts and exact dequantizers (gguf_blocks.py), its quantized tensors as stored
(gguf_tensors.py), HF quantized checkpoints' tensors (hf_quant.py: FP8, AWQ, GPTQ) and GGUF
vocabularies as `tokenizers` objects (gguf_tokenizer.py). Nothing here runs a forward, and
nothing here imports the rest of models: models/quant builds modules from these tensors and
models/loader.py builds an architecture from a checkpoint."""
