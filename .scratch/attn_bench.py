import time, torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
dev = "cuda"
def bench(fn, n=20):
    for _ in range(3): fn()
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(n): fn()
    torch.cuda.synchronize(); return (time.perf_counter() - t) / n * 1e6
for H, KV, D, T in [(32, 4, 128, 2048), (24, 4, 256, 2048), (16, 2, 256, 2048), (32, 4, 128, 8192)]:
    q = torch.randn(1, H, T, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(1, KV, T, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn(1, KV, T, D, device=dev, dtype=torch.bfloat16)
    flops = 4 * T * T * D * H / 2
    res = {}
    for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        try:
            with sdpa_kernel([be]):
                t0 = time.perf_counter(); F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True); torch.cuda.synchronize(); first = (time.perf_counter() - t0) * 1e3
                us = bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
                # a new length: the first call's time (plan)
                q2, k2, v2 = q[:, :, :T - 37], k[:, :, :T - 37], v[:, :, :T - 37]
                t0 = time.perf_counter(); F.scaled_dot_product_attention(q2, k2, v2, is_causal=True, enable_gqa=True); torch.cuda.synchronize(); new = (time.perf_counter() - t0) * 1e3
            res[name] = f"{us:.0f} us ({flops / us / 1e6:.0f} TFLOP/s), first call {first:.1f} ms, new length {new:.1f} ms"
        except Exception as e:
            res[name] = "fails: " + str(e).splitlines()[0][:80]
    print(f"H{H} KV{KV} D{D} T{T}: " + " | ".join(f"{k}: {v}" for k, v in res.items()), flush=True)
