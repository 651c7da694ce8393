"""Times the mixed-2-4-16 GEMV's variants on random block4 layers (needs a CUDA GPU and cupy): the tiled GEMV's
warps per block, the checkpoint-layout (direct) GEMV, fused vs separate outliers, beside cuBLAS FP16 and the
measured copy bandwidth, same process, in interleaved rounds with the order rotated. Graph replays over rotated
layers (qtool.bench.timing).

    python scripts/mixed_variants.py [--shapes 4096x4096,...] [--m 1] [--rounds 2]
"""

from __future__ import annotations

import argparse

import torch

from qtool.bench import stats
from qtool.bench.cuda_cases import CudaCases
from qtool.bench.kernels import rotations
from qtool.bench.timing import CudaTimer
from qtool.layouts.mixed import cuda as mixed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="4096x4096,4096x11008,11008x4096,8192x28672")
    ap.add_argument("--m", type=int, default=1)
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--variants", default=None, help="comma-separated variant names to time (default: all)")
    args = ap.parse_args()
    cases, timer = CudaCases(), CudaTimer()

    def t(fns) -> float:
        return stats.summarize(timer(fns, 10, args.iters)).median_us

    copy = max(nbytes / t(fns) / 1e6 for _, fns, nbytes in cases.copy_variants())
    print(f"device {torch.cuda.get_device_name()}  copy {copy:.2f} TB/s  M={args.m}")
    m = args.m
    for k, n in stats.parse_shapes(args.shapes):
        layers = {}
        for frac in (0.0, 0.002):
            first = cases._mixed_layer(k, n, frac)
            r = rotations(first.nbytes("direct") + 2 * m * k + 2 * m * n, cases.l2)
            layers[frac] = [first] + [cases._mixed_layer(k, n, frac) for _ in range(r - 1)]
        nrot = max(len(v) for v in layers.values())
        xs = [torch.randn(m, k, device="cuda", dtype=torch.float16) for _ in range(nrot)]
        outs = [torch.empty(m, n, device="cuda", dtype=torch.float16) for _ in range(nrot)]

        def run(frac, layers=layers, xs=xs, outs=outs, **kw):
            return t(
                [
                    lambda p=p, x=x, o=o: mixed.gemv(x, p, out=o, **kw)
                    for p, x, o in zip(layers[frac], xs, outs, strict=False)
                ]
            )

        variants = {"direct": dict(layout="direct")}
        for warps in (1, 2, 3, 4):
            if warps > 1 and mixed.gemv_warps(k, warps) < warps:
                continue
            variants[f"w{warps}"] = dict(layout="tiled", warps=warps)
        fp16s, times = [], {name: [] for name in variants}
        if args.variants:
            keep = set(args.variants.split(",")) | {"direct"}
            variants = {k2: v for k2, v in variants.items() if k2 in keep}
        names = list(variants)
        for rnd in range(args.rounds):
            fp16s.append(t(cases.fp16(k, n, m)))
            order = names[rnd % len(names) :] + names[: rnd % len(names)]
            for name in order:
                times[name].append(run(0.0, **variants[name]))
        fp16 = min(fp16s)
        best = {name: min(v) for name, v in times.items()}
        tiled_best = min((v, name) for name, v in best.items() if name != "direct")
        nb = {lay: layers[0.0][0].nbytes(lay) + 2 * m * k + 2 * m * n for lay in ("tiled", "direct")}

        def cell(name, best=best, fp16=fp16, nb=nb):
            lay = "direct" if name == "direct" else "tiled"
            us = best[name]
            return f"{name}={us:.2f} ({fp16 / us:.2f}x {100 * nb[lay] / us / 1e6 / copy:.0f}%)"

        print(
            f"{k}x{n} M={m}: cuBLAS FP16 {fp16:.2f} us (rounds {' / '.join(f'{v:.2f}' for v in fp16s)}); bytes "
            f"tiled {nb['tiled'] / 1e6:.2f} MB, direct {nb['direct'] / 1e6:.2f} MB"
        )
        print("   ", "  ".join(cell(name) for name in names))
        print(
            "    spread between rounds:",
            " ".join(f"{name}={max(v) - min(v):.2f}" for name, v in times.items()),
        )
        bname = tiled_best[1]
        kw = variants[bname]
        nb2 = layers[0.002][0].nbytes("tiled") + 2 * m * k + 2 * m * n
        fused = run(0.002, outliers="fused", **kw)
        sep = run(0.002, outliers="spmv", **kw)
        dfused = run(0.002, outliers="fused", layout="direct")
        print(
            f"    0.2% outliers ({bname}): fused {fused:.2f} us ({fp16 / fused:.2f}x, {nb2 / fused / 1e6:.2f} TB/s), "
            f"spmv {sep:.2f} ({fp16 / sep:.2f}x); direct fused {dfused:.2f} ({fp16 / dfused:.2f}x)"
        )


if __name__ == "__main__":
    main()
