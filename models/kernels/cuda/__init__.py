"""Triton kernels for CUDA forwards, one file per kind, each tested against the torch form it
replaces (tests/kernels, the session's on the models: tests/engine/test_graphs.py): launcher.py (a compiled kernel's C launcher called directly once
Triton has launched its key), base.py (launch, the predicates that say where kernels serve, PDL,
the start-up precompile; q/k norm + RoPE + KV write; add + RMSNorm; SwiGLU's silu * up over
many rows), linear.py (one-row GEMV,
its norm prologue and SwiGLU epilogue), qlinear.py (the same on quantized weights, and their
dequantization for prefill), attention.py (split-K decode attention), delta.py (the
Gated DeltaNet decode step), scan.py (the chunked gated delta scan of prefill, its
terms from the layer's raw projections, its gated output norm), conv.py (the
causal depthwise conv of a prefill), moe.py (the MoE decode step, the grouped prefill's routing, sort
and weighted sum with the shared expert's gated output), fp8.py and qplanar.py (quantized GEMVs), shortconv.py and ssd.py (LFM2's and Mamba2's
decode steps)."""
