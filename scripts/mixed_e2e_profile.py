"""Where a batch-1 decode step of the bench decoder (qtool/bench/e2e.py, random Llama-shaped weights) spends its time:
the step replayed from a CUDA graph (median us), then a few eager steps under torch.profiler with each kernel's
time summed by kind (projections, attention, norms, ...). Runs FP16 and mixed-2-4-16 (with and without the SwiGLU
in the gate/up GEMV's epilogue) one after the other in one process (needs a CUDA GPU and cupy).

    python scripts/mixed_e2e_profile.py [--model-config llama-2-7b] [--context 128] [--outliers 0]
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch

from qtool.bench import e2e
from qtool.cuda.graphs import GraphedStep

# torch SDPA's kernels first: their names (flash, memory-efficient, cuDNN) can carry architecture tags such as
# "sm90" that would otherwise count them as cuBLAS
KINDS = [
    ("flash", "attention"),
    ("fmha", "attention"),
    ("sdpa", "attention"),
    ("attention", "attention"),
    ("mixed_gemv", "mixed GEMV"),
    ("mixed_spmv", "mixed SpMV"),
    ("gemv", "other GEMV"),
    ("gemm", "GEMM"),
    ("cublas", "cuBLAS"),
    ("sm90", "cuBLAS"),
    ("rms_norm", "norm"),
    ("rope", "rotary"),
    ("swiglu", "SwiGLU"),
    ("argmax", "argmax"),
    ("reduce", "reduce"),
]


def kind(name: str) -> str:
    low = name.lower()
    return next((label for key, label in KINDS if key in low), "other")


def profile(label: str, make, d: e2e.Dims, context: int, iters: int, dev: torch.device) -> None:
    model = e2e.Decoder(d, make, dev).eval()
    tables = model.rope_tables(context + 1, dev)
    shape = (1, d.kv_heads, context, d.head_dim)
    caches = [
        (
            torch.zeros(shape, device=dev, dtype=torch.float16),
            torch.zeros(shape, device=dev, dtype=torch.float16),
        )
        for _ in range(d.layers)
    ]
    ids = torch.randint(0, d.vocab, (1, 1), device=dev)
    pos = torch.tensor([context // 2], device=dev)
    with torch.inference_mode():

        def fn(ids, pos):
            return model(ids, pos, caches, tables, decode=True, span=context // 2 + 1)

        step = GraphedStep(fn, [ids, pos])
        us = e2e._time_graph(step, iters)
        steps = 3
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                fn(ids, pos)
            torch.cuda.synchronize()
    by_kind: dict[str, float] = defaultdict(float)
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        t = ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
        by_kind[kind(ev.name)] += t / steps
        by_name[ev.name][0] += t / steps
        by_name[ev.name][1] += 1 / steps
    total = sum(by_kind.values())
    print(
        f"\n{label}: graph replay {us:.1f} us/step ({1e6 / us:.1f} tok/s); eager kernel time {total:.1f} us/step"
    )
    for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"  {k:12s} {v:8.1f} us")
    for name, (t, c) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:12]:
        print(f"    {t:8.1f} us  {c:5.0f} calls  {t / max(c, 1):6.2f} us/call  {name[:90]}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-config", default="llama-2-7b")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--outliers", type=float, default=0.0)
    args = ap.parse_args()
    d = e2e.dims_for(args.model_config)
    dev = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device=dev).manual_seed(0)
    print(f"device {torch.cuda.get_device_name(dev)}, {args.model_config}, context {args.context}, batch 1")
    profile("fp16", e2e.fp16_linear(dev), d, args.context, args.iters, dev)
    torch.cuda.empty_cache()
    label = e2e.mixed_label(args.outliers)
    profile(
        f"{label}, SwiGLU in the gate/up GEMV",
        e2e.mixed_linear(dev, args.outliers, gen),
        d,
        args.context,
        args.iters,
        dev,
    )
    torch.cuda.empty_cache()
    e2e.FUSED_GATE_UP_SWIGLU = False
    profile(
        f"{label}, SwiGLU kernel", e2e.mixed_linear(dev, args.outliers, gen), d, args.context, args.iters, dev
    )


if __name__ == "__main__":
    main()
