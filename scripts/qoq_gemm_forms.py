"""Times the W4A8 GEMM's forms (qtool/layouts/qoq/cuda.py: `sync` with its split-K, `ws` at 16/32/64/128/256-token tiles with K
split over 1..16 blocks per tile, the persistent `wsp` at 128/256) on codes quantized beforehand, beside cuBLAS
FP16 and FP8 `_scaled_mm` in the same process (needs a Hopper GPU and cupy). Graph replays over rotated layers
(qtool.bench.timing), medians; prints one line per (shape, M, scheme) with the dispatched form first, then every
form's time and the best, so the dispatch rule (qoq.gemm_kernel) can be checked against the fastest form.

    python scripts/qoq_gemm_forms.py [--shapes 4096x4096,4096x11008,11008x4096] [--m 16,64,128,256,512]
"""

from __future__ import annotations

import argparse
import json

import torch

from qtool.bench import stats
from qtool.bench.cuda_cases import CudaCases
from qtool.bench.kernels import rotations
from qtool.bench.timing import CudaTimer
from qtool.layouts.qoq import cuda as qoq


def forms(m: int, n: int, kt: int, sms: int) -> list[tuple[str, int, int | None, int | None]]:
    """(kernel, tokens, split, whole) candidates: sync (its own split), ws tiles with the splits that keep every
    block within three waves and at least two stages each, ws with whole waves of tiles and the rest split, the
    persistent wsp at 128 and 256 tokens."""
    out: list[tuple[str, int, int | None, int | None]] = [("sync", 0, None, None)]
    rows = (n + 127) // 128
    for tn in (16, 32, 64, 128, 256):
        if tn > max(64, m) or (tn < 64 and m > 64):
            continue
        tiles = rows * ((m + tn - 1) // tn)
        for s in (1, 2, 3, 4, 6, 8, 12, 16):
            if s > 1 and (tiles * s > 3 * sms or kt // s < 2):
                continue
            out.append(("ws", tn, s, 0 if s > 1 else None))
        waves, rem = divmod(tiles, sms)
        if waves and rem:
            for s in sorted({2, 3, max(2, sms // rem)}):
                if rem * s <= 2 * sms and kt // s >= 2:
                    out.append(("ws", tn, s, waves * sms))
    out += [("wsp", 128, None, None), ("wsp", 256, None, None)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="4096x4096,4096x11008,11008x4096")
    ap.add_argument("--m", default="16,32,64,128,256,512")
    ap.add_argument("--schemes", default="ch,128")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--full", default="ch,128", help="schemes timed in every form (the others: the dispatched one)"
    )
    args = ap.parse_args()
    cases, timer = CudaCases(), CudaTimer()
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def t(fns) -> float:
        return stats.summarize(timer(fns, 5, args.iters)).median_us

    print(f"device {torch.cuda.get_device_name()}")
    rows = []
    for k, n in stats.parse_shapes(args.shapes):
        for m in (int(v) for v in args.m.split(",")):
            fp16 = t(cases.fp16(k, n, m))
            fp8 = t(cases.fp8(k, n, m)[0])
            for sch in args.schemes.split(","):
                gs = None if sch == "ch" else int(sch)
                groups = k // gs if gs else 1
                r = rotations(n * k // 2 + 4 * n * groups + m * k + 2 * m * n, cases.l2)
                sets = []
                for _ in range(r):
                    qw = torch.randint(-(2**31), 2**31, (n, k // 8), dtype=torch.int32, device="cuda")
                    zeros = torch.randint(
                        0, 16, (n, groups) if gs else (n,), dtype=torch.uint8, device="cuda"
                    )
                    s1 = torch.randint(1, 9, (n, groups), dtype=torch.uint8, device="cuda") if gs else None
                    p = qoq.build(
                        4, gs, k, qw, (torch.rand(n, device="cuda") * 0.004 + 0.002).half(), zeros, s1, None
                    )
                    a = qoq.quantize_activations(torch.randn(m, k, device="cuda").half(), p)
                    sets.append((a, p, torch.empty(m, n, dtype=torch.float16, device="cuda")))
                kt = sets[0][1].kp // 128
                dflt = t([lambda a=a, p=p, o=o: qoq.gemm(a, p, out=o) for a, p, o in sets])
                pick = qoq.gemm_kernel(m, n, sets[0][0], sets[0][1], sms=sms)
                cells = {}
                cands = (
                    forms(m, n, kt, sms)
                    if sch in args.full.split(",")
                    else [(pick[0], pick[1], pick[2], pick[3])]
                )
                for kern, tn, sp, whole in cands:
                    kw = {"kernel": kern, "split": sp, "whole": whole}
                    if tn:
                        kw["tokens"] = tn
                    name = f"{kern}{tn or ''}" + (f"/{sp}" if sp else "") + (f"+{whole}" if whole else "")
                    try:
                        cells[name] = t(
                            [lambda a=a, p=p, o=o, kw=kw: qoq.gemm(a, p, out=o, **kw) for a, p, o in sets]
                        )
                    except Exception as exc:  # a form that cannot run here: say so, time the rest
                        print(f"    {name}: {type(exc).__name__}: {exc}"[:200])
                best = min(cells, key=cells.get)
                print(
                    f"{k}x{n} M={m} {sch}: FP16 {fp16:.2f} FP8 {fp8:.2f} ({fp16 / fp8:.2f}x) | dispatch {pick} "
                    f"{dflt:.2f} ({fp16 / dflt:.2f}x) | best {best} {cells[best]:.2f} ({fp16 / cells[best]:.2f}x)"
                )
                print("    " + " ".join(f"{c}={v:.2f}" for c, v in cells.items()))
                rows.append(
                    {
                        "k": k,
                        "n": n,
                        "m": m,
                        "scheme": sch,
                        "fp16": fp16,
                        "fp8": fp8,
                        "dispatch": dflt,
                        "pick": list(pick),
                        "forms": cells,
                    }
                )
                del sets
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
