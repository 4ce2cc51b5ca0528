"""The model architectures, one file per family (llama.py: Llama/SmolLM2, Qwen2, Qwen3;
qwen3_5.py: the Qwen3.5 and Qwen3-Next hybrids;
lfm2.py: LFM2's short convolutions and attention; olmo_hybrid.py: OLMo-Hybrid), their shared top (causal_lm.py) and layers
(layers.py), the gated delta rule's forms (gated_delta.py), and the state declarations the
engine's StateManager allocates (state_spec.py). An architecture reaches device kernels through
models/ops only; no kernel imports an architecture."""
