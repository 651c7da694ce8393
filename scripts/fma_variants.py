"""A/B bench of the CUDA-core decode kernel's variants (grouped_int `gemv-fma`; needs a CUDA GPU and cupy).

For each Llama-2-7B shape and bit width at M = 1 it times cuBLAS FP16, the tensor-core `gemv`, and `gemv-fma`
with FMA_SCALE_AFTER = 0 and 1, alternating the two variants over several rounds (the spread between rounds of
one variant is the noise), and checks both variants against the float64 reference on the bench's own inputs.
M = 16 is timed for `gemv` and FP16 only (no variant there). Same timer as `qtool bench kernels`.

    python scripts/fma_variants.py [--model-config llama-2-7b] [--bits 4,8] [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
from rich import box
from rich.table import Table

from qtool.bench import stats, tables
from qtool.bench.kernels import MODEL_SHAPES


def _median_us(timer, fns, warmup: int, iters: int) -> float:
    try:
        return stats.summarize(timer(fns, warmup, iters)).median_us
    finally:
        del fns


def _check(k: int, n: int, bits: int, gs: int, seed: int) -> dict[str, float]:
    """Relative error of each variant against float64 on random inputs (the kernel test's measure)."""
    from qtool.bench.cuda_cases import random_packed
    from qtool.layouts.grouped_int import cuda as gi
    from qtool.layouts.grouped_int.layout import GroupedIntWeight
    from qtool.quant.grid import GridSpec

    gen = torch.Generator(device="cuda").manual_seed(seed)
    qw, sc, z = random_packed(n, k, bits, gs, False, torch.device("cuda"), gen)
    p = gi.prepare(qw, sc, z, bits, gs, k, n)
    x = torch.randn(1, k, device="cuda", dtype=torch.float16, generator=gen)
    x[0, :8] *= 500.0  # a few large activations, as real decoders have
    w = GroupedIntWeight(GridSpec(bits=bits, symmetric=False, group_size=gs), k, n, qw, sc, z).dequantize(
        torch.float32
    )
    ref = (x.double() @ w.double().T).cpu()
    out = {}
    default = gi.FMA_SCALE_AFTER
    for sa in (0, 1):
        gi.FMA_SCALE_AFTER = sa
        y = gi.gemv_fma(x, p).double().cpu()
        out[f"s{sa}"] = float((y - ref).norm() / ref.norm()) if torch.isfinite(y).all() else float("inf")
    gi.FMA_SCALE_AFTER = default
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-config", default="llama-2-7b")
    ap.add_argument("--bits", default="4,8")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--json")
    args = ap.parse_args(argv)

    from qtool.bench.cuda_cases import CudaCases
    from qtool.bench.timing import CudaTimer
    from qtool.layouts.grouped_int import cuda as gi

    cases, timer, warm, it = CudaCases(), CudaTimer(), 10, args.iters
    default = gi.FMA_SCALE_AFTER
    info = cases.device_info()
    copy = max(
        nbytes / (_median_us(timer, fns, warm, it) * 1e-6) / 1e12 for _, fns, nbytes in cases.copy_variants()
    )
    print(f"device {info['name']} ({info['sms']} SMs), copy ceiling {copy:.2f} TB/s", flush=True)
    rows = []
    gs = args.group_size
    for k, n in MODEL_SHAPES[args.model_config]:
        fp16_1 = _median_us(timer, cases.fp16(k, n, 1), warm, it)
        fp16_16 = _median_us(timer, cases.fp16(k, n, 16), warm, it)
        for bits in [int(b) for b in args.bits.split(",")]:
            nbytes = stats.quant_bytes(1, n, k, bits, gs, True)
            errs = _check(k, n, bits, gs, seed=k + n + bits)
            t = {"s0": [], "s1": []}
            for _ in range(args.rounds):
                for sa in (0, 1):
                    gi.FMA_SCALE_AFTER = sa
                    t[f"s{sa}"].append(
                        _median_us(timer, cases.quant(k, n, 1, bits, gs, True, "gemv-fma"), warm, it)
                    )
            gi.FMA_SCALE_AFTER = default
            tc1 = _median_us(timer, cases.quant(k, n, 1, bits, gs, True, "gemv"), warm, it)
            tc16 = _median_us(timer, cases.quant(k, n, 16, bits, gs, True, "gemv"), warm, it)
            row = {
                "KxN": f"{k}x{n}",
                "bits": bits,
                "fp16_m1_us": fp16_1,
                "fp16_m16_us": fp16_16,
                "dispatched_m1": gi.choose_path(1, torch.float16, bits, gs, k, n),
                "gemv_m1_us": tc1,
                "gemv_m16_us": tc16,
                "err": errs,
            }
            for v in ("s0", "s1"):
                med = statistics.median(t[v])
                row[v] = {
                    "rounds_us": t[v],
                    "median_us": med,
                    "spread_us": max(t[v]) - min(t[v]),
                    "x_fp16": fp16_1 / med,
                    "pct_copy_bw": 100 * nbytes / (med * 1e-6) / 1e12 / copy,
                }
            rows.append(row)
            print(json.dumps(row), flush=True)
    # a markdown table (rich's MARKDOWN box), pasted as is into kernels/NOTES.md
    table = Table(box=box.MARKDOWN)
    for col in (
        "KxN",
        "w",
        "M=1 fp16 us",
        "fma s0 us (x, %BW)",
        "fma s1 us (x, %BW)",
        "s1/s0",
        "spread s0/s1",
        "err s0/s1",
        "gemv M=1 us",
        "M=16 gemv us (x fp16)",
    ):
        table.add_column(col)
    for r in rows:
        a, b = r["s0"], r["s1"]
        table.add_row(
            r["KxN"],
            str(r["bits"]),
            f"{r['fp16_m1_us']:.2f}",
            f"{a['median_us']:.2f} ({a['x_fp16']:.2f}x, {a['pct_copy_bw']:.0f}%)",
            f"{b['median_us']:.2f} ({b['x_fp16']:.2f}x, {b['pct_copy_bw']:.0f}%)",
            f"{b['median_us'] / a['median_us']:.3f}",
            f"{a['spread_us']:.2f}/{b['spread_us']:.2f}",
            f"{r['err']['s0']:.1e}/{r['err']['s1']:.1e}",
            f"{r['gemv_m1_us']:.2f}",
            f"{r['gemv_m16_us']:.2f} ({r['fp16_m16_us'] / r['gemv_m16_us']:.2f}x)",
        )
    print()
    tables.echo([table])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": info, "copy_tbps": copy, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
