"""`qtool bench kernels`: grouped_int matmuls (W4A16, W8A16), the qoq W4A8 kernels and the mixed-2-4-16 (2/4/16-bit)
kernels against cuBLAS FP16, INT8 and FP8 on the same card, same run."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from qtool.bench import stats
from qtool.bench.timing import Fns, Timer

# (in_features K, out_features N) of the distinct linear shapes of each model.
MODEL_SHAPES: dict[str, list[tuple[int, int]]] = {
    "llama-2-7b": [(4096, 4096), (4096, 11008), (11008, 4096)],
    "llama-2-13b": [(5120, 5120), (5120, 13824), (13824, 5120)],
    "llama-2-70b": [(8192, 8192), (8192, 1024), (8192, 28672), (28672, 8192)],
    "llama-3-8b": [(4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096)],
    "mistral-7b": [(4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096)],
    "qwen2-7b": [(3584, 3584), (3584, 512), (3584, 18944), (18944, 3584)],
}


def shapes_for_model(name: str) -> list[tuple[int, int]]:
    """Shapes of a known model name, or read from a Hugging Face config.json (file or its directory)."""
    key = name.strip().lower()
    if key in MODEL_SHAPES:
        return MODEL_SHAPES[key]
    path = Path(name)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        try:
            cfg = json.loads(path.read_text(encoding="utf-8"))
            h, inter = int(cfg["hidden_size"]), int(cfg["intermediate_size"])
            heads = int(cfg.get("num_attention_heads", 1))
            kv = int(cfg.get("num_key_value_heads", heads))
            hd = int(cfg.get("head_dim") or h // heads)
        except KeyError as exc:
            raise stats.BenchError(f"--model-config {name}: config lacks {exc.args[0]!r}") from None
        except (ValueError, TypeError, AttributeError, ZeroDivisionError) as exc:
            raise stats.BenchError(f"--model-config {name}: cannot read the model's sizes ({type(exc).__name__}: "
                                   f"{exc}); expected a Hugging Face config.json") from None
        shapes = [(h, h), (h, kv * hd), (h, inter), (inter, h)]
        return list(dict.fromkeys(shapes))
    raise stats.BenchError(f"--model-config: found {name!r}, expected one of {sorted(MODEL_SHAPES)} or a config.json path")


class Cases(Protocol):
    """Makes the rotated callables for each thing to time (a fake in the CPU tests, CUDA work on a GPU)."""

    def device_info(self) -> dict[str, Any]: ...
    def copy_variants(self) -> list[tuple[str, Fns, int]]: ...
    def matmul_peak(self) -> tuple[Fns, int]: ...
    def launch_floor(self) -> Fns: ...
    def quant(self, k: int, n: int, m: int, bits: int, group_size: int | None, symmetric: bool, path: str) -> Fns: ...
    def fp16(self, k: int, n: int, m: int) -> Fns: ...
    def int8(self, k: int, n: int, m: int) -> tuple[Fns, int]: ...
    def fp8(self, k: int, n: int, m: int) -> tuple[Fns, int]: ...
    def paths(self, k: int, n: int, m: int, bits: int, group_size: int | None) -> tuple[list[str], str]: ...
    def w4a8(self, k: int, n: int, m: int, group_size: int | None, path: str) -> Fns: ...
    def mixed_paths(self, k: int, n: int, m: int, outlier_fraction: float) -> tuple[list[str], str, int]: ...
    def mixed(self, k: int, n: int, m: int, outlier_fraction: float, path: str) -> Fns: ...


# The qoq W4A8 rows' paths: the float16 layer call (activation quantization + GEMM, what a model runs), and the
# GEMM alone on activations quantized beforehand.
W4A8_PATHS = ("w4a8", "w4a8-gemm")


@dataclass
class KernelBenchConfig:
    shapes: list[tuple[int, int]]
    ms: list[int]
    bits: list[int]
    group_sizes: list[int | None]
    symmetric: bool = True
    warmup: int = 10
    iters: int = 100
    w4a8_group_sizes: list[int | None] = field(default_factory=list)  # qoq W4A8 rows (None: per-channel)
    mixed_outliers: list[float] = field(default_factory=list)  # mixed-2-4-16 rows, one per outlier fraction


def measure_ceilings(cases: Cases, timer: Timer, warmup: int, iters: int) -> dict[str, Any]:
    # The copy ceiling is the best of several ways to copy (a memcpy captured in a graph may run on a copy
    # engine, slower than an SM copy kernel); bytes are counted read + write.
    copies = {}
    for name, fns, nbytes in cases.copy_variants():
        s = stats.summarize(timer(fns, warmup, iters))
        copies[name] = {**s.to_dict(), "tbps": nbytes / (s.median_us * 1e-6) / 1e12, "bytes": nbytes}
        del fns
    best = max(copies, key=lambda k: copies[k]["tbps"])
    fns, flops = cases.matmul_peak()
    mm = stats.summarize(timer(fns, warmup, max(10, iters // 4)))
    del fns
    # What one tiny kernel costs in the same back-to-back graph replay: the part of every small kernel's time
    # that no kernel design removes.
    floor = stats.summarize(timer(cases.launch_floor(), warmup, iters))
    return {
        "copy_tbps": copies[best]["tbps"],
        "copy_method": best,
        "copy_variants": copies,
        "fp16_tflops": flops / (mm.median_us * 1e-6) / 1e12,
        "fp16_flops": flops,
        "fp16_matmul": mm.to_dict(),
        "launch_floor_us": floor.median_us,
    }


def _time(timer: Timer, make: Callable[[], Fns], warmup: int, iters: int) -> stats.Summary:
    fns = make()
    try:
        return stats.summarize(timer(fns, warmup, iters))
    finally:
        del fns


def run_kernel_bench(cfg: KernelBenchConfig, cases: Cases, timer: Timer,
                     log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Measure every (shape, M, bits, group size) and return the report (schema stats.KERNELS_SCHEMA)."""
    ceilings = measure_ceilings(cases, timer, cfg.warmup, cfg.iters)
    log(f"ceilings: copy {ceilings['copy_tbps']:.2f} TB/s, fp16 matmul {ceilings['fp16_tflops']:.0f} TFLOP/s")
    results = []
    for k, n in cfg.shapes:
        for m in cfg.ms:
            base: dict[str, Any] = {}
            base_err: dict[str, str] = {}
            # The lambdas below run immediately inside _time (never later), so late binding is harmless.
            first = _time(timer, lambda: cases.fp16(k, n, m), cfg.warmup, cfg.iters).to_dict()  # noqa: B023
            base["fp16"] = first
            for name, maker in (("int8", cases.int8), ("fp8", cases.fp8)):
                try:
                    fns, m_eff = maker(k, n, m)
                    s = stats.summarize(timer(fns, cfg.warmup, cfg.iters))
                    del fns
                    base[name] = {**s.to_dict(), "m_eff": m_eff}
                except Exception as exc:  # noqa: BLE001  a baseline the card/library lacks is reported, not fatal
                    base[name] = None
                    base_err[name] = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
            rows = []

            def measure(bits: int, gs: int | None, symmetric: bool, paths: list[str], dispatched: str,
                        make: Callable[[str], Fns], nbytes: int | None = None) -> dict[str, Any]:
                cands = {p: _time(timer, lambda p=p: make(p), cfg.warmup, cfg.iters).to_dict() for p in paths}
                again = _time(timer, lambda: make(dispatched), cfg.warmup, cfg.iters)
                q = cands[dispatched]
                us = q["median_us"]
                if nbytes is None:
                    nbytes = stats.quant_bytes(m, n, k, bits, gs, symmetric)  # noqa: B023
                roof = stats.roofline(us, nbytes,  # noqa: B023
                                      stats.gemm_flops(m, n, k), ceilings["copy_tbps"],  # noqa: B023
                                      ceilings["fp16_tflops"])
                return {
                    "k": k, "n": n, "m": m, "bits": bits, "group_size": gs, "symmetric": symmetric,  # noqa: B023
                    "path": dispatched, "best_path": min(cands, key=lambda p: cands[p]["median_us"]), "quant": q,
                    "candidates": cands, "baselines": base, "baseline_errors": base_err, "roofline": roof,  # noqa: B023
                    "noise": stats.noise(us, again.median_us),
                }

            for bits in cfg.bits:
                for gs in cfg.group_sizes:
                    paths, dispatched = cases.paths(k, n, m, bits, gs)
                    rows.append(measure(bits, gs, cfg.symmetric, paths, dispatched,
                                        lambda p, bits=bits, gs=gs: cases.quant(k, n, m, bits, gs, cfg.symmetric, p)))  # noqa: B023
            for gs in cfg.w4a8_group_sizes:
                # weight bytes as an asymmetric 4-bit layer's (the group words stand in for scales and zeros)
                rows.append(measure(4, gs, False, list(W4A8_PATHS), W4A8_PATHS[0],
                                    lambda p, gs=gs: cases.w4a8(k, n, m, gs, p)))  # noqa: B023
            # the bench's mixed layers: 64-channel blocks with one 4-bit stripe each, second-order groups of 16 rows
            for frac in cfg.mixed_outliers if k % 64 == 0 and n % 16 == 0 else []:
                # bits 2, group size 16: the layout's 2-bit groups (its 4-bit stripes and outliers are in `layout`)
                paths, dispatched, nbytes = cases.mixed_paths(k, n, m, frac)
                row = measure(2, 16, False, paths, dispatched,
                              lambda p, frac=frac: cases.mixed(k, n, m, frac, p), nbytes)  # noqa: B023
                rows.append({**row, "layout": "mixed-2-4-16", "outlier_fraction": frac})
            last = _time(timer, lambda: cases.fp16(k, n, m), cfg.warmup, cfg.iters).to_dict()  # noqa: B023
            base["fp16"] = stats.faster_run(first, last)
            for row in rows:
                row["speedup"] = {
                    name: (stats.speedup(v["median_us"], row["quant"]["median_us"]) if isinstance(v, dict) else None)
                    for name, v in base.items()
                }
                results.append(row)
                log(format_row(row))
    return {
        "schema": stats.KERNELS_SCHEMA,
        "device": cases.device_info(),
        "ceilings": ceilings,
        "config": {
            "shapes": [f"{k}x{n}" for k, n in cfg.shapes], "m": cfg.ms, "bits": cfg.bits,
            "group_sizes": cfg.group_sizes, "symmetric": cfg.symmetric, "warmup": cfg.warmup,
            "iters": cfg.iters, "shape_convention": "KxN = in_features x out_features",
            "w4a8_group_sizes": cfg.w4a8_group_sizes, "mixed_outliers": cfg.mixed_outliers,
        },
        "timer": getattr(timer, "graph_failures", None) and {"graph_failures": timer.graph_failures},
        "results": results,
    }


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


HEADER = (f"{'KxN':>12} {'M':>5} {'w':>2} {'g':>4}  {'path':<15} {'us':>8} {'TB/s':>5} {'%BW':>4} "
          f"{'TFLOP/s':>7} {'%pk':>4} {'fp16us':>8} {'xFP16':>5} {'xINT8':>5} {'xFP8':>5} {'noise':>5}  alt")


def format_row(r: dict[str, Any]) -> str:
    roof, sp = r["roofline"], r["speedup"]
    alts = [f"{p}={v['median_us']:.1f}" for p, v in r["candidates"].items() if p != r["path"]]
    flag = "" if r.get("best_path", r["path"]) == r["path"] else " (best: " + r["best_path"] + ")"
    fp16 = r["baselines"].get("fp16")
    if r.get("layout") == "mixed-2-4-16":
        alts.append(f"outliers {100 * r['outlier_fraction']:g}%")
    w = "mx" if r.get("layout") == "mixed-2-4-16" else r["bits"]
    return (f"{r['k']:>5}x{r['n']:<6} {r['m']:>5} {w:>2} {str(r['group_size'] or 'ch'):>4}  "
            f"{r['path']:<15} {r['quant']['median_us']:>8.2f} {roof['tbps']:>5.2f} {roof['pct_copy_bw']:>4.0f} "
            f"{roof['tflops']:>7.1f} {roof['pct_fp16_peak']:>4.0f} {_fmt(fp16 and fp16['median_us'], '8.2f'):>8} "
            f"{_fmt(sp.get('fp16'), '5.2f'):>5} {_fmt(sp.get('int8'), '5.2f'):>5} {_fmt(sp.get('fp8'), '5.2f'):>5} "
            f"{_fmt(100 * r['noise'] if r['noise'] is not None else None, '4.1f'):>4}%  {' '.join(alts)}{flag}")


def format_report(report: dict[str, Any]) -> str:
    d, c = report["device"], report["ceilings"]
    lines = [
        f"device: {d.get('name')}  SMs {d.get('sms')}  L2 {d.get('l2_mb')} MB  torch {d.get('torch')}  "
        f"cupy {d.get('cupy')}",
        f"ceilings (measured): copy {c['copy_tbps']:.2f} TB/s (read+write), cuBLAS FP16 {c['fp16_tflops']:.0f} TFLOP/s, "
        f"launch floor {c.get('launch_floor_us', float('nan')):.2f} us per kernel (tiny kernel, graph replay)",
        "%BW: bytes the kernel must read+write / time vs copy bandwidth; xBASE: baseline time / our time "
        "(INT8/FP8 run at M padded to their minimum; cuBLAS FP16 timed before and after ours, the faster counts); "
        "noise: same path timed twice",
        HEADER,
    ]
    lines += [format_row(r) for r in report["results"]]
    return "\n".join(lines)


def write_plot(report: dict[str, Any], path: str) -> None:
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        raise stats.BenchError("--plot: matplotlib is not installed; install it or drop --plot") from None
    rows = report["results"]
    labels = [f"{r['k']}x{r['n']}\nM={r['m']} w{r['bits']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(rows)), 4))
    width = 0.27
    for i, base in enumerate(("fp16", "int8", "fp8")):
        vals = [r["speedup"].get(base) or 0.0 for r in rows]
        ax.bar([j + (i - 1) * width for j in range(len(rows))], vals, width, label=f"vs cuBLAS {base.upper()}")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(labels, fontsize=6)
    ax.set_ylabel("speedup (baseline time / grouped_int time)")
    ax.set_title(f"grouped_int kernels on {report['device'].get('name')}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_json(report: dict[str, Any], path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(report, indent=2, sort_keys=False) + "\n")


def rotations(set_bytes: int, l2_bytes: int, cap: int = 64) -> int:
    """Buffer sets needed so one pass over them is well beyond L2 (so no call finds its inputs cached)."""
    return max(2, min(cap, math.ceil(2.5 * l2_bytes / max(1, set_bytes))))

