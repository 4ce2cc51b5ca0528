"""Quantized weights as modules that compute, and the layouts they are repacked into at load:
layers.py (GGUF blocks on the CPU and CUDA: Int4Linear, BlockLinear, BlockEmbedding, the experts;
QuantLinear and QWeight, what the kernels read), hf_layers.py (HF FP8, AWQ and GPTQ linears),
planar.py and runs.py (the CUDA layouts a plan repacks into, with their exact dequantizers).

Built from the file side (models/formats: the tensors a checkpoint holds); the kernels, the
architectures, the planner and the loader import these; nothing here imports a kernel (a module's
CUDA forms, models/ops/quant.py, are its `forms`, which the kernel plan binds)."""
