"""A/B sweep of the qoq W4A8 decode GEMV's forms (needs a CUDA GPU and cupy).

For each Llama-2-7B shape and M in 1, 2, 4 it times every entry of the measurement build of kernels/qoq/gemv.cu
(fused quantization or codes from the producer; warps per block; weight chunks in flight per lane; the group
arithmetic) beside our W4A16 decode kernel (the dispatched grouped_int path) and the `sync` GEMM on the same codes,
over rounds that alternate the variants. Before timing, each variant's int32 products and float16 outputs are
checked against the layout's arithmetic on the sweep's own inputs (a mismatch is reported and the variant not
timed). Same timer and rotated buffer sets as `qtool bench kernels`.

    python scripts/qoq_gemv_variants.py [--model-config llama-2-7b] [--m 1,2,4] [--rounds 2] [--json sweep.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from qtool.bench.kernels import MODEL_SHAPES, rotations

SCHEMES = {"pc": None, "g128": 128}


def variants(scheme: str, mt: int) -> list[tuple[str, str, int]]:
    """(label, entry, warps) of the measurement build (kernels/qoq/gemv.cu QG_TUNE)."""
    out = []
    for codes in (0, 1):
        for w in (8, 16) if not codes else (8,):
            for u in (4, 8):
                for gs in (0, 1) if scheme != "pc" else (0,):
                    label = f"{'codes' if codes else 'fused'} w{w} u{u}" + (
                        f" gs{gs}" if scheme != "pc" else ""
                    )
                    out.append((label, f"qoq_gemv_tune_{scheme}_m{mt}_w{w}_c{codes}_u{u}_gs{gs}", w))
    return out


def _layer(k: int, n: int, group_size: int | None, gen: torch.Generator):
    """Random valid fields (s1 <= 8 keeps every z in [0, 15] valid), as the bench's W4A8 rows build them."""
    from qtool.layouts.qoq import cuda as qoq

    dev = torch.device("cuda")
    groups = k // group_size if group_size else 1
    qw = torch.randint(-(2**31), 2**31, (n, k // 8), dtype=torch.int32, device=dev, generator=gen)
    scales = (torch.rand(n, device=dev, generator=gen) * 0.004 + 0.002).half()
    zeros = torch.randint(
        0, 16, (n, groups) if group_size else (n,), dtype=torch.uint8, device=dev, generator=gen
    )
    s1 = (
        torch.randint(1, 9, (n, groups), dtype=torch.uint8, device=dev, generator=gen) if group_size else None
    )
    bias = (torch.randn(n, device=dev, generator=gen) * 0.1).half()
    return qoq.build(4, group_size, k, qw, scales, zeros, s1, bias), (qw, zeros, s1)


def _codes(x: torch.Tensor, p):
    """The activation codes at the layer's positions, s_x and sums, by the layout's torch arithmetic."""
    from qtool.layouts.qoq import cuda as qoq

    q, sx, rs = qoq.quantize_torch(x)
    codes = torch.zeros(x.shape[0], p.kp, dtype=torch.int8, device=x.device)
    codes[:, p.dest.long()] = q
    return qoq.QoQActivations(codes=codes, scale=sx, rowsum=rs), q


def _reference(q: torch.Tensor, fields, k: int, group_size: int | None) -> torch.Tensor:
    from qtool.layouts.bitpack import unpack_codes

    qw, zeros, s1 = fields
    w = unpack_codes(qw, 4, k).to(torch.float64)
    if group_size is None:
        w -= zeros.to(torch.float64)[:, None]
    else:
        w = (w - zeros.to(torch.float64).repeat_interleave(group_size, 1)) * s1.to(
            torch.float64
        ).repeat_interleave(group_size, 1)
    return (q.to(torch.float64) @ w.t()).round().to(torch.int32)


def _check(fn, acc: torch.Tensor, sx: torch.Tensor, p) -> str | None:
    from qtool.layouts.qoq import cuda as qoq

    raw = torch.full(acc.shape, -0x5A5A5A5A, dtype=torch.int32, device=acc.device)
    fn(raw, True)
    y = torch.full(acc.shape, float("nan"), dtype=torch.float16, device=acc.device)
    fn(y, False)
    torch.cuda.synchronize()
    if not torch.equal(raw, acc):
        return f"int32 differs in {(raw != acc).sum().item()} places"
    if not torch.equal(y, qoq.epilogue_torch(acc, sx, p)):
        return "float16 output differs from the layout's order"
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-config", default="llama-2-7b")
    ap.add_argument("--m", default="1,2,4")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--json")
    args = ap.parse_args(argv)

    from qtool.bench.cuda_cases import CudaCases
    from qtool.bench.stats import summarize
    from qtool.bench.timing import CudaTimer
    from qtool.layouts.qoq import cuda as qoq

    cases, timer, warm = CudaCases(), CudaTimer(), 5
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"device {cases.device_info()['name']}", flush=True)

    def med(fns) -> float:
        return summarize(timer(fns, warm, args.iters)).median_us

    rows = []
    for k, n in MODEL_SHAPES[args.model_config]:
        for m in [int(v) for v in args.m.split(",")]:
            mt = next(t for t in qoq.GEMV_TOKENS if m <= t)
            paths, w16_path = cases.paths(k, n, m, 4, 128)
            row = {"KxN": f"{k}x{n}", "m": m, "w4a16_path": w16_path, "us": {}, "errors": {}}
            # the variants' rotated sets: layer, float16 rows, codes, outputs
            sets = {}
            for sch, gs in SCHEMES.items():
                groups = k // gs if gs else 1
                r = rotations(n * k // 2 + 4 * n * groups + 3 * m * k + 2 * m * n, cases.l2)
                sets[sch] = []
                for i in range(r):
                    p, fields = _layer(k, n, gs, gen)
                    x = torch.randn(m, k, device="cuda", generator=gen).half()
                    a, q = _codes(x, p)
                    out = torch.empty(m, n, dtype=torch.float16, device="cuda")
                    sets[sch].append((p, x, a, out))
                    if i == 0:
                        acc = _reference(q, fields, k, gs)
                        for label, entry, w in variants(sch, mt):
                            v = (entry, w)
                            if label.startswith("fused"):

                                def fn(o, raw, v=v, x=x, p=p):
                                    return qoq.gemv(x, p, out=o, raw=raw, variant=v)
                            else:

                                def fn(o, raw, v=v, a=a, p=p):
                                    return qoq.gemv_codes(a, p, out=o, raw=raw, variant=v)

                            err = _check(fn, acc, a.scale, p)
                            if err:
                                row["errors"][f"{sch} {label}"] = err
                        del acc
            times: dict[str, list[float]] = {}
            for _ in range(args.rounds):
                times.setdefault("w4a16", []).append(med(cases.quant(k, n, m, 4, 128, True, w16_path)))
                for sch in SCHEMES:
                    for label, entry, w in variants(sch, mt):
                        key = f"{sch} {label}"
                        if key in row["errors"]:
                            continue
                        v = (entry, w)
                        if label.startswith("fused"):
                            fns = [
                                lambda s=s, v=v: qoq.gemv(s[1], s[0], out=s[3], variant=v) for s in sets[sch]
                            ]
                        else:
                            fns = [
                                lambda s=s, v=v: qoq.gemv_codes(s[2], s[0], out=s[3], variant=v)
                                for s in sets[sch]
                            ]
                        times.setdefault(key, []).append(med(fns))
            row["us"] = {key: statistics.median(v) for key, v in times.items()}
            row["rounds_us"] = times
            rows.append((row, sets))
            base = row["us"]["w4a16"]
            print(f"{k}x{n} M={m} W4A16 {w16_path} {base:.2f} us", flush=True)
            for key, us in sorted(row["us"].items(), key=lambda kv: kv[1]):
                print(f"  {key:28s} {us:7.2f} us  {us / base - 1:+6.1%}  rounds {times[key]}", flush=True)
            for key, err in row["errors"].items():
                print(f"  {key}: WRONG {err}", flush=True)
    # last (its build is the largest): the block-synchronous GEMM on the same codes, gemm()'s form above 4 tokens
    for row, sets in rows:
        for sch in SCHEMES:
            fns = [lambda s=s: qoq.gemm(s[2], s[0], out=s[3], kernel="sync") for s in sets[sch]]
            row["us"][f"{sch} sync"] = us = med(fns)
            print(
                f"{row['KxN']} M={row['m']} {sch} sync {us:.2f} us ({us / row['us']['w4a16'] - 1:+.1%})",
                flush=True,
            )
        sets.clear()
    rows = [row for row, _ in rows]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": cases.device_info(), "rows": rows}, f, indent=1)
    return 1 if any(r["errors"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
