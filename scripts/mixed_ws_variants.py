"""Times the warp-specialized mixed-2-4-16 GEMM's builds (qtool/layouts/mixed/cuda.py `gemm_ws`: the "regs" and
"tile" forms at each token tile, the planned split and no split) beside cuBLAS FP16 and the block-synchronous
`gemm` in the same process, on random block4 layers, without outliers unless `--outliers` gives their fraction
(the tile form then also timed with them all in mixed_spmv, `/spmv`) (needs a Hopper GPU and cupy). Graph replays
over rotated layers (qtool.bench.timing), medians; one line per (shape, M) with cuBLAS, `gemm`, the planned
`gemm_ws` and the best build, then every build's time.

    python scripts/mixed_ws_variants.py [--shapes 4096x4096,4096x11008,11008x4096,8192x28672] [--m 16,64,256,2048]
        [--outliers 0.002]
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

from qtool.bench import stats
from qtool.bench.cuda_cases import CudaCases, random_mixed_weight
from qtool.bench.kernels import rotations
from qtool.bench.timing import CudaTimer
from qtool.layouts.mixed import cuda as mixed


def builds(m: int) -> list[tuple[str, int]]:
    """The builds worth timing at M tokens: token tiles from M / 4 (at most 128) up to the plan's tile, every
    form."""
    _, top = mixed.gemm_ws_plan(m)
    lo = min(m // 4, 128)
    return [(f, tn) for f, tn in sorted(mixed.GEMM_WS_BUILT) if lo <= tn <= max(top, 16)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="4096x4096,4096x11008,11008x4096,8192x28672")
    ap.add_argument("--m", default="16,64,256,2048")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--no-split-off", action="store_true", help="skip the split=1 timing of each build")
    ap.add_argument(
        "--outliers", type=float, default=0.0, help="fraction of each layer's weights as outliers"
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cases, timer = CudaCases(), CudaTimer()

    def t(fns) -> float:
        return stats.summarize(timer(fns, 5, args.iters)).median_us

    print(f"device {torch.cuda.get_device_name()}")
    rows = []
    for k, n in stats.parse_shapes(args.shapes):
        for m in stats.parse_ints(args.m, "--m"):
            frac = args.outliers
            first = mixed.prepare(
                random_mixed_weight(k, n, frac, cases.dev, cases.gen), keep_checkpoint=False
            )
            r = rotations(first.nbytes("tiled") + 2 * m * k + 2 * m * n, cases.l2)
            layers = [first] + [
                mixed.prepare(random_mixed_weight(k, n, frac, cases.dev, cases.gen), keep_checkpoint=False)
                for _ in range(r - 1)
            ]
            sets = [
                (
                    p,
                    torch.randn(m, k, device="cuda", dtype=torch.float16),
                    torch.empty(m, n, device="cuda", dtype=torch.float16),
                )
                for p in layers
            ]

            def run(fn, sets=sets, **kw) -> float:
                return t([lambda p=p, x=x, o=o: fn(x, p, out=o, **kw) for p, x, o in sets])

            fp16 = t(cases.fp16(k, n, m))
            old = run(mixed.gemm)
            plan = mixed.gemm_ws_plan(m)
            planned = run(mixed.gemm_ws)
            cells = {}
            for form, tn in builds(m):
                modes = (None, "spmv") if frac and form == "tile" else (None,)
                for split, outliers in itertools.product((None,) if args.no_split_off else (None, 1), modes):
                    name = f"{form}{tn}" + ("/s1" if split == 1 else "") + ("/spmv" if outliers else "")
                    try:
                        cells[name] = run(mixed.gemm_ws, form=form, tokens=tn, split=split, outliers=outliers)
                    except Exception as exc:  # a build that cannot run here: say so, time the rest
                        print(f"    {name}: {type(exc).__name__}: {exc}"[:200])
            best = min(cells, key=cells.get) if cells else None
            line = (
                f"{k}x{n} M={m}: cuBLAS FP16 {fp16:.2f} | gemm {old:.2f} ({fp16 / old:.2f}x) | gemm_ws "
                f"{plan[0]}{plan[1]} {planned:.2f} ({fp16 / planned:.2f}x)"
            )
            if best:
                line += f" | best {best} {cells[best]:.2f} ({fp16 / cells[best]:.2f}x)"
            print(line)
            print("    " + " ".join(f"{c}={v:.2f} ({fp16 / v:.2f}x)" for c, v in cells.items()))
            rows.append(
                {
                    "k": k,
                    "n": n,
                    "m": m,
                    "outliers": frac,
                    "fp16": fp16,
                    "gemm": old,
                    "gemm_ws": planned,
                    "plan": list(plan),
                    "builds": cells,
                }
            )
            del sets, layers, first
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
