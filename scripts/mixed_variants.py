"""Times the mixed-2-4-16 GEMV's variants on random block4 layers (needs a CUDA GPU and cupy): warps per block x
the next block's loads ahead or not without outliers, fused vs separate outliers, dependent launches on and off,
beside cuBLAS FP16 and the measured copy bandwidth, same process. Graph replays over rotated layers (qtool.bench.timing).

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

        def run(frac, layers=layers, xs=xs, outs=outs, **kw):
            return t([lambda p=p, x=x, o=o: mixed.gemv(x, p, out=o, **kw)
                      for p, x, o in zip(layers[frac], xs, outs, strict=True)])

        cells = []
        best = None
        for warps in (1, 2, 4):
            if warps > 1 and mixed.gemv_warps(k, warps) < warps:
                continue
            for pipe in ((False, True) if m == 1 else (False,)):
                us = run(0.0, warps=warps, pipe=pipe)
                cells.append(f"w{warps}{'p' if pipe else ''}={us:.2f}")
                if best is None or us < best[0]:
                    best = (us, warps, pipe)
        us, warps, pipe = best
        print(f"{k}x{n} M={m}: cuBLAS FP16 {fp16:.2f} us; best w{warps}{'p' if pipe else ''} {us:.2f} us = "
              f"{fp16 / us:.2f}x, {nbytes / us / 1e6:.2f} TB/s ({100 * nbytes / us / 1e6 / copy:.0f}% of copy)")
        print("   ", " ".join(cells))
        dflt = run(0.0)
        fused = run(0.002, outliers="fused")
        sep = run(0.002, outliers="spmv")
        dependent_launch.ENABLED = False
        plain = run(0.0)
        plain_fused = run(0.002, outliers="fused")
        dependent_launch.ENABLED = True
        nb2 = layers[0.002][0].nbytes() + 2 * m * k + 2 * m * n
        print(f"    default {dflt:.2f} us ({fp16 / dflt:.2f}x); 0.2% outliers fused {fused:.2f} ({fp16 / fused:.2f}x, "
              f"{nb2 / fused / 1e6:.2f} TB/s) / separate spmv {sep:.2f} ({fp16 / sep:.2f}x); without dependent "
              f"launch: {plain:.2f}, fused {plain_fused:.2f}")


if __name__ == "__main__":
    main()
