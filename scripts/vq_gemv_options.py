"""Times the VQ GEMV's launch options (qtool/layouts/vq/cuda.py `knobs`) on the bench's random re-indexed layers (needs a
CUDA GPU and cupy): clusters adding the splits through distributed shared memory (capped at 16 or 8 blocks, or
off: the global split-K reduction), the next column tile's prefetch, the dependent launch, the warps along K;
beside cuBLAS FP16, same process, in interleaved rounds with the order rotated. Graph replays over rotated layers
(qtool.bench.timing). Prints one line per (shape, M, preset, cache) and writes JSON.

    python scripts/vq_gemv_options.py [--shapes 4096x4096,...] [--ms 1] [--rounds 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from qtool.bench import stats
from qtool.bench.cuda_cases import CudaCases
from qtool.bench.timing import CudaTimer
from qtool.cuda import dependent_launch

KNOBS = (
    "QTOOL_VQ_CLUSTER",
    "QTOOL_VQ_PREFETCH",
    "QTOOL_VQ_DEPENDENT",
    "QTOOL_VQ_MAX_WK",
)
VARIANTS = {  # (cluster cap, prefetch, dependent, warps along K cap)
    "plain": (1, 0, 0, 8),
    "all": (16, 1, 1, 8),
    "all-cluster8": (8, 1, 1, 8),
    "all-no-cluster": (1, 1, 1, 8),
    "all-no-prefetch": (16, 0, 1, 8),
    "all-wk4": (16, 1, 1, 4),
    "all-ordinary": (16, 1, 0, 8),
}
# One option at a time against "all": (environment variable, the variants that differ from "all" in it only, the
# presets whose times decide it).
FACTORS = (
    ("QTOOL_VQ_CLUSTER", ("all-cluster8", "all-no-cluster"), ("gptvq-2", "aqlm-3")),
    ("QTOOL_VQ_PREFETCH", ("all-no-prefetch",), ("gptvq-2",)),
    ("QTOOL_VQ_MAX_WK", ("all-wk4",), ("aqlm-3",)),
    ("QTOOL_VQ_DEPENDENT", ("all-ordinary",), ("gptvq-2", "aqlm-3")),
)


def pick(rows: list[dict]) -> dict[str, int]:
    """Per option, the value whose variant has the smallest summed best time over the deciding presets' rows."""
    env = {}
    for key, alts, presets in FACTORS:
        i = KNOBS.index(key)
        cands = [v for v in ("all", *alts) if all(v in r["us"] for r in rows)]
        mine = [r for r in rows if r["preset"] in presets]
        if not cands or not mine:
            continue
        best = min(cands, key=lambda v: sum(min(r["us"][v]) for r in mine))
        env[key] = VARIANTS[best][i]
    return env


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="4096x4096,4096x11008,11008x4096")
    ap.add_argument("--ms", default="1")
    ap.add_argument("--presets", default="gptvq-2:tiered,aqlm-3:sc,gptvq-2:gc,gptvq-2:sc,aqlm-3:gc")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--pick", default=None, help="write `export NAME=VALUE` lines of the fastest options here"
    )
    args = ap.parse_args()
    cases, timer = CudaCases(), CudaTimer()
    names = args.variants.split(",")

    def t(fns) -> float:
        return stats.summarize(timer(fns, 5, args.iters)).median_us

    print(f"device {torch.cuda.get_device_name()}")
    out = []
    for k, n in stats.parse_shapes(args.shapes):
        for m in (int(v) for v in args.ms.split(",")):
            fp16 = min(t(cases.fp16(k, n, m)) for _ in range(2))
            for pc in args.presets.split(","):
                preset, cache = pc.split(":")
                times: dict[str, list[float]] = {v: [] for v in names}
                plans: dict[str, dict] = {}
                for r in range(args.rounds):
                    order = names[r % len(names) :] + names[: r % len(names)]
                    for v in order:
                        for key, val in zip(KNOBS, VARIANTS[v], strict=True):
                            os.environ[key] = str(val)
                        times[v].append(t(cases.vq(k, n, m, preset, cache)))
                        if v not in plans:
                            plans[v] = cases.vq_info(k, n, m, preset, cache)[1]
                best = {v: min(ts) for v, ts in times.items()}
                cells = "  ".join(f"{v} {best[v]:.2f} (x{fp16 / best[v]:.2f})" for v in names)
                print(f"{k}x{n} M={m} {preset} {cache}: fp16 {fp16:.2f}  {cells}", flush=True)
                out.append(
                    {
                        "k": k,
                        "n": n,
                        "m": m,
                        "preset": preset,
                        "cache": cache,
                        "fp16_us": fp16,
                        "us": times,
                        "plans": plans,
                    }
                )
    for key in KNOBS:
        os.environ.pop(key, None)
    if dependent_launch.cluster_fallback_reason():
        print(f"cluster launches fell back: {dependent_launch.cluster_fallback_reason()}")
    if args.pick:
        env = pick(out)
        print("picked: " + " ".join(f"{k}={v}" for k, v in env.items()))
        with open(args.pick, "w") as f:
            f.writelines(f"export {k}={v}\n" for k, v in env.items())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "device": torch.cuda.get_device_name(),
                    "rows": out,
                    "cluster_fallback": dependent_launch.cluster_fallback_reason(),
                },
                f,
                indent=1,
                default=str,
            )


if __name__ == "__main__":
    main()
