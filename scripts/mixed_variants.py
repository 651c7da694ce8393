"""Times the mixed-2-4-16 GEMV's variants at one token on random block4 layers (needs a CUDA GPU and cupy): rows per
block x warps per block without outliers, fused vs separate outliers, dependent launches on and off, beside cuBLAS
FP16 and the measured copy bandwidth, same process. Graph replays over rotated layers (qtool.bench.timing).

    python scripts/mixed_variants.py [--shapes 4096x4096,...] [--m 1]
"""

from __future__ import annotations

import argparse

import torch

from qtool.bench import stats
from qtool.bench.cuda_cases import CudaCases
from qtool.bench.kernels import rotations
from qtool.bench.timing import CudaTimer
from qtool.cuda import dependent_launch, mixed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="4096x4096,4096x11008,11008x4096,8192x28672")
    ap.add_argument("--m", type=int, default=1)
    ap.add_argument("--iters", type=int, default=100)
    args = ap.parse_args()
    cases, timer = CudaCases(), CudaTimer()

    def t(fns) -> float:
        return stats.summarize(timer(fns, 10, args.iters)).median_us

    copy = max(nbytes / t(fns) / 1e6 for _, fns, nbytes in cases.copy_variants())
    print(f"device {torch.cuda.get_device_name()}  copy {copy:.2f} TB/s  M={args.m}")
    m = args.m
    for k, n in stats.parse_shapes(args.shapes):
        fp16 = t(cases.fp16(k, n, m))
        layers = {}
        for frac in (0.0, 0.002):
            first = cases._mixed_layer(k, n, frac)
            r = rotations(first.nbytes() + 2 * m * k + 2 * m * n, cases.l2)
            layers[frac] = [first] + [cases._mixed_layer(k, n, frac) for _ in range(r - 1)]
        xs = [torch.randn(m, k, device="cuda", dtype=torch.float16) for _ in layers[0.0]]
        outs = [torch.empty(m, n, device="cuda", dtype=torch.float16) for _ in layers[0.0]]
        nbytes = layers[0.0][0].nbytes() + 2 * m * k + 2 * m * n

        def run(frac, **kw):
            return t([lambda p=p, x=x, o=o: mixed.gemv(x, p, out=o, **kw)
                      for p, x, o in zip(layers[frac], xs, outs, strict=True)])

        cells = []
        best = None
        for rows in mixed.ROW_CHOICES.get(mixed.token_slots(m), (4,)):
            for warps in (1, 2, 4, 8):
                if warps > 1 and mixed.gemv_warps(k, warps) < warps:
                    continue
                us = run(0.0, rows=rows, warps=warps)
                cells.append(f"r{rows}w{warps}={us:.2f}")
                if best is None or us < best[0]:
                    best = (us, rows, warps)
        us, rows, warps = best
        print(f"{k}x{n} M={m}: cuBLAS FP16 {fp16:.2f} us; best r{rows} w{warps} {us:.2f} us = {fp16 / us:.2f}x, "
              f"{nbytes / us / 1e6:.2f} TB/s ({100 * nbytes / us / 1e6 / copy:.0f}% of copy)")
        print("   ", " ".join(cells))
        dflt = run(0.0)
        fused = run(0.002, outliers="fused")
        sep = run(0.002, outliers="spmv")
        fused_best = run(0.002, outliers="fused", rows=rows, warps=warps)
        dependent_launch.ENABLED = False
        plain = run(0.0)
        plain_out = run(0.002, outliers="spmv")
        dependent_launch.ENABLED = True
        nb2 = layers[0.002][0].nbytes() + 2 * m * k + 2 * m * n
        print(f"    default {dflt:.2f} us ({fp16 / dflt:.2f}x); 0.2% outliers fused {fused:.2f} ({fp16 / fused:.2f}x, "
              f"{nb2 / fused / 1e6:.2f} TB/s) / at best rows+warps {fused_best:.2f} ({fp16 / fused_best:.2f}x) / "
              f"separate spmv {sep:.2f} ({fp16 / sep:.2f}x); without dependent launch: {plain:.2f}, "
              f"spmv {plain_out:.2f}")


if __name__ == "__main__":
    main()
