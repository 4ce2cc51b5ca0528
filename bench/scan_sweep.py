"""Block size, warps, stages and product precision of the chunked gated delta scan kernel.

    python3 bench/scan_sweep.py PRECISION BV WARPS STAGES     (one configuration per process:
    a configuration that faults leaves the CUDA context unusable)
e.g. `for c in "tf32x3 32 4 1" "ieee 16 4 2"; do python3 bench/scan_sweep.py $c; done`.
Times the whole chunked form of one layer (2048 tokens, dk = dv = 128; 16 and 48 heads, the
0.8B-like and 27B-like shapes) and reports its largest difference from the torch loop.
"""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from models.architectures import gated_delta  # noqa: E402
from models.kernels.cuda import scan as cuda_scan  # noqa: E402


def main() -> None:
    from engine.device import configure_process
    configure_process()  # (the environment's diagnosis switches and folders, as chat takes them)
    prec, BV, warps, stages = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    cuda_scan.CONFIG.update(BV=BV, num_warps=warps, num_stages=stages, precision=prec)
    dev = "cuda"
    for H in (16, 48):
        T, dk, dv = 2048, 128, 128
        q, k, v, gate, beta, s0 = gated_delta.example_inputs(T, H, dk, dv, dev)
        s_loop = s0.clone()
        ref = gated_delta.chunked(q, k, v, gate, beta, s_loop)
        try:
            s_fused = s0.clone()
            out = gated_delta.chunked(q, k, v, gate, beta, s_fused, fused=True)
            err = max(float((out - ref).abs().max()), float((s_fused - s_loop).abs().max()))
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(5):
                gated_delta.chunked(q, k, v, gate, beta, s0.clone(), fused=True)
            torch.cuda.synchronize()
            ms = (time.perf_counter() - t) / 5 * 1e3
            print(f"H={H} {prec} BV={BV} warps={warps} stages={stages}: chunked {ms:.2f} ms, err {err:.2e}")
        except Exception as e:  # out of shared memory, a fault: report it
            print(f"H={H} {prec} BV={BV} warps={warps} stages={stages}: FAILS {str(e).splitlines()[0][:90]}")
            return


if __name__ == "__main__":
    main()
