"""`qtool bench kernels`: grouped_int matmuls (W4A16, W8A16), the qoq W4A8 kernels, the mixed-2-4-16 (2/4/16-bit)
kernels and the VQ kernels (gptvq-2, aqlm-3: the GEMV with the codebook in global memory, in shared memory or the
tiered cache up to 16 rows, the fused GEMM above) against cuBLAS FP16, INT8 and FP8 on the same card, same run."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from qtool.bench import plot, stats, tables
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
            raise stats.BenchError(
                f"--model-config {name}: cannot read the model's sizes ({type(exc).__name__}: "
                f"{exc}); expected a Hugging Face config.json"
            ) from None
        shapes = [(h, h), (h, kv * hd), (h, inter), (inter, h)]
        return list(dict.fromkeys(shapes))
    raise stats.BenchError(
        f"--model-config: found {name!r}, expected one of {sorted(MODEL_SHAPES)} or a config.json path"
    )


class Cases(Protocol):
    """Makes the rotated callables for each thing to time (a fake in the CPU tests, CUDA work on a GPU)."""

    def device_info(self) -> dict[str, Any]: ...
    def copy_variants(self) -> list[tuple[str, Fns, int]]: ...
    def matmul_peak(self) -> tuple[Fns, int]: ...
    def launch_floor(self) -> Fns: ...
    def quant(
        self, k: int, n: int, m: int, bits: int, group_size: int | None, symmetric: bool, path: str
    ) -> Fns: ...
    def fp16(self, k: int, n: int, m: int) -> Fns: ...
    def int8(self, k: int, n: int, m: int) -> tuple[Fns, int]: ...
    def fp8(self, k: int, n: int, m: int) -> tuple[Fns, int]: ...
    def tinygemm(self, k: int, n: int, m: int, group_size: int) -> tuple[Fns, int]: ...
    def paths(self, k: int, n: int, m: int, bits: int, group_size: int | None) -> tuple[list[str], str]: ...
    def w4a8(self, k: int, n: int, m: int, group_size: int | None, path: str) -> Fns: ...
    def mixed_paths(self, k: int, n: int, m: int, outlier_fraction: float) -> tuple[list[str], str, int]: ...
    def mixed(self, k: int, n: int, m: int, outlier_fraction: float, path: str) -> Fns: ...
    def vq_gemm_paths(self, k: int, n: int, m: int, preset: str) -> tuple[list[str], str, int, int]: ...
    def vq_gemm(self, k: int, n: int, m: int, preset: str, path: str) -> Fns: ...
    def vq_info(self, k: int, n: int, m: int, preset: str, cache: str) -> tuple[int, dict[str, Any]]: ...
    def vq(self, k: int, n: int, m: int, preset: str, cache: str, form: str | None = None) -> Fns: ...


# The qoq W4A8 rows' paths: the float16 layer call (activation quantization + GEMM; at decode sizes the GEMV that
# quantizes its rows itself), and the kernel alone on activations quantized beforehand (at decode sizes the GEMV on
# codes, what a model runs where RMSNorm or SwiGLU write the codes).
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
    tinygemm_group_size: int | None = None  # torchao int4 (W4A16) peer at this group size; None: not timed
    vq_presets: list[str] = field(default_factory=list)  # VQ rows: GEMV per cache (M <= VQ_MAX_M), GEMM above


# The VQ rows: index bits per weight of each preset (z·b/d), the GEMV's cache variants, the largest M the GEMV takes
# (the fused GEMM's rows above it).
VQ_BITS = {"gptvq-2": 2, "aqlm-3": 3}
VQ_OTHER_FORM = (
    "fma"  # qtool/layouts/vq/cuda.py's GEMV form that is not dispatched, timed beside the tiered rows
)
VQ_CACHES = ("gc", "sc", "tiered")
VQ_MAX_M = 16


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


# Peers timed beside cuBLAS FP16 for every shape and M: name -> the Cases method making them.
PEERS = ("int8", "fp8", "tinygemm")
PEER_LABELS = {"fp16": "cuBLAS FP16", "int8": "cuBLAS INT8", "fp8": "cuBLAS FP8", "tinygemm": "torchao int4"}


def time_peers(
    cases: Cases,
    timer: Timer,
    k: int,
    n: int,
    m: int,
    warmup: int,
    iters: int,
    tinygemm_group_size: int | None,
) -> tuple[dict[str, Any], dict[str, str]]:
    """({peer: timing with m_eff, or None}, {peer: why it has no timing}): a peer the card or library lacks, or
    that fails its own check, is reported, not fatal."""
    base: dict[str, Any] = {}
    errors: dict[str, str] = {}
    makers: dict[str, Callable[[], tuple[Fns, int]]] = {
        "int8": lambda: cases.int8(k, n, m),
        "fp8": lambda: cases.fp8(k, n, m),
    }
    if tinygemm_group_size is not None:
        makers["tinygemm"] = lambda: cases.tinygemm(k, n, m, tinygemm_group_size)
    for name, make in makers.items():
        try:
            fns, m_eff = make()
            s = stats.summarize(timer(fns, warmup, iters))
            del fns
            base[name] = {**s.to_dict(), "m_eff": m_eff}
            if name == "tinygemm":
                base[name]["group_size"] = tinygemm_group_size
        except Exception as exc:
            base[name] = None
            errors[name] = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
    return base, errors


def run_kernel_bench(
    cfg: KernelBenchConfig, cases: Cases, timer: Timer, log: Callable[[str], None] = lambda s: None
) -> dict[str, Any]:
    """Measure every (shape, M, bits, group size) and return the report (schema stats.KERNELS_SCHEMA)."""
    ceilings = measure_ceilings(cases, timer, cfg.warmup, cfg.iters)
    log(f"ceilings: copy {ceilings['copy_tbps']:.2f} TB/s, fp16 matmul {ceilings['fp16_tflops']:.0f} TFLOP/s")
    results = []
    for k, n in cfg.shapes:
        for m in cfg.ms:
            # The lambdas below run immediately inside _time (never later), so late binding is harmless.
            first = _time(timer, lambda: cases.fp16(k, n, m), cfg.warmup, cfg.iters).to_dict()
            peers, base_err = time_peers(
                cases, timer, k, n, m, cfg.warmup, cfg.iters, cfg.tinygemm_group_size
            )
            base: dict[str, Any] = {"fp16": first, **peers}
            rows = []

            def measure(
                bits: int,
                gs: int | None,
                symmetric: bool,
                paths: list[str],
                dispatched: str,
                make: Callable[[str], Fns],
                nbytes: int | None = None,
            ) -> dict[str, Any]:
                cands = {p: _time(timer, lambda p=p: make(p), cfg.warmup, cfg.iters).to_dict() for p in paths}
                again = _time(timer, lambda: make(dispatched), cfg.warmup, cfg.iters)
                q = cands[dispatched]
                us = q["median_us"]
                if nbytes is None:
                    nbytes = stats.quant_bytes(m, n, k, bits, gs, symmetric)
                roof = stats.roofline(
                    us,
                    nbytes,
                    stats.gemm_flops(m, n, k),
                    ceilings["copy_tbps"],
                    ceilings["fp16_tflops"],
                )
                return {
                    "k": k,
                    "n": n,
                    "m": m,
                    "bits": bits,
                    "group_size": gs,
                    "symmetric": symmetric,
                    "path": dispatched,
                    "best_path": min(cands, key=lambda p: cands[p]["median_us"]),
                    "quant": q,
                    "candidates": cands,
                    "baselines": base,
                    "baseline_errors": base_err,
                    "roofline": roof,
                    "noise": stats.noise(us, again.median_us),
                }

            for bits in cfg.bits:
                for gs in cfg.group_sizes:
                    paths, dispatched = cases.paths(k, n, m, bits, gs)
                    rows.append(
                        measure(
                            bits,
                            gs,
                            cfg.symmetric,
                            paths,
                            dispatched,
                            lambda p, bits=bits, gs=gs: cases.quant(k, n, m, bits, gs, cfg.symmetric, p),
                        )
                    )
            for gs in cfg.w4a8_group_sizes:
                # weight bytes as an asymmetric 4-bit layer's (the group words stand in for scales and zeros)
                rows.append(
                    measure(
                        4,
                        gs,
                        False,
                        list(W4A8_PATHS),
                        W4A8_PATHS[0],
                        lambda p, gs=gs: cases.w4a8(k, n, m, gs, p),
                    )
                )
            # the bench's mixed layers: 64-channel blocks with one 4-bit stripe each, second-order groups of 16 rows
            for frac in cfg.mixed_outliers if k % 64 == 0 and n % 16 == 0 else []:
                # bits 2, group size 16: the layout's 2-bit groups (its 4-bit stripes and outliers are in `layout`)
                paths, dispatched, nbytes = cases.mixed_paths(k, n, m, frac)
                row = measure(
                    2,
                    16,
                    False,
                    paths,
                    dispatched,
                    lambda p, frac=frac: cases.mixed(k, n, m, frac, p),
                    nbytes,
                )
                rows.append({**row, "layout": "mixed-2-4-16", "outlier_fraction": frac})
            for preset in cfg.vq_presets if m <= VQ_MAX_M else []:
                for cache in VQ_CACHES:
                    nbytes, plan = cases.vq_info(k, n, m, preset, cache)
                    path = f"vq-{cache}"
                    # the tiered row also times the other GEMV form (`vq-tiered-fma`: CUDA-core products)
                    paths = [path, *([f"{path}-{VQ_OTHER_FORM}"] if cache == "tiered" else [])]
                    row = measure(
                        VQ_BITS[preset],
                        None,
                        True,
                        paths,
                        path,
                        lambda p, preset=preset, cache=cache: cases.vq(
                            k, n, m, preset, cache, form=p.split("-")[2] if p.count("-") == 2 else None
                        ),
                        nbytes,
                    )
                    rows.append({**row, "layout": "vq", "preset": preset, "cache": cache, "plan": plan})
            # the fused VQ GEMM above the GEMV's rows (stages of 64 columns), one candidate path per fusion
            for preset in cfg.vq_presets if m > VQ_MAX_M and k % 64 == 0 else []:
                paths, dispatched, nbytes, bits = cases.vq_gemm_paths(k, n, m, preset)
                row = measure(
                    bits,
                    None,
                    True,
                    paths,
                    dispatched,
                    lambda p, preset=preset: cases.vq_gemm(k, n, m, preset, p),
                    nbytes,
                )
                rows.append({**row, "layout": "vq", "preset": preset})
            last = _time(timer, lambda: cases.fp16(k, n, m), cfg.warmup, cfg.iters).to_dict()
            base["fp16"] = stats.faster_run(first, last)
            for row in rows:
                row["speedup"] = {
                    name: (
                        stats.speedup(v["median_us"], row["quant"]["median_us"])
                        if isinstance(v, dict)
                        else None
                    )
                    for name, v in base.items()
                }
                results.append(row)
                log(format_row(row))
    return {
        "schema": stats.KERNELS_SCHEMA,
        "device": cases.device_info(),
        "ceilings": ceilings,
        "config": {
            "shapes": [f"{k}x{n}" for k, n in cfg.shapes],
            "m": cfg.ms,
            "bits": cfg.bits,
            "group_sizes": cfg.group_sizes,
            "symmetric": cfg.symmetric,
            "warmup": cfg.warmup,
            "iters": cfg.iters,
            "shape_convention": "KxN = in_features x out_features",
            "w4a8_group_sizes": cfg.w4a8_group_sizes,
            "mixed_outliers": cfg.mixed_outliers,
            "tinygemm_group_size": cfg.tinygemm_group_size,
            "vq_presets": cfg.vq_presets,
        },
        "timer": getattr(timer, "graph_failures", None) and {"graph_failures": timer.graph_failures},
        "results": results,
    }


def row_label(r: dict[str, Any]) -> str:
    """What a result row measures, without its shape and M: `W4 g128`, `W4A8 g128`, `mixed 0.2%`."""
    g = "ch" if r["group_size"] is None else f"g{r['group_size']}"
    if r.get("layout") == "mixed-2-4-16":
        return f"mixed-2-4-16 {100 * r['outlier_fraction']:g}%"
    if r.get("layout") == "vq":
        return f"{r['preset']} {r['cache']}" if "cache" in r else str(r["preset"])
    if r["path"] in W4A8_PATHS:
        return f"W4A8 {g}"
    return f"W{r['bits']} {g}{'' if r['symmetric'] else ' asym'}"


def _alternatives(r: dict[str, Any]) -> list[str]:
    alts = [f"{p}={v['median_us']:.1f}" for p, v in r["candidates"].items() if p != r["path"]]
    if r.get("best_path", r["path"]) != r["path"]:
        alts.append(f"(best: {r['best_path']})")
    return alts


def format_row(r: dict[str, Any]) -> str:
    """One progress line per measured row (stderr while the bench runs)."""
    sp, roof = r["speedup"], r["roofline"]
    ratios = ", ".join(
        f"x{PEER_LABELS.get(b, b).split()[-1]} {v:.2f}" for b, v in sp.items() if v is not None
    )
    alts = _alternatives(r)
    return (
        f"{r['k']}x{r['n']} M={r['m']} {row_label(r)} {r['path']}: {r['quant']['median_us']:.2f} us, "
        f"{roof['tbps']:.2f} TB/s ({roof['pct_copy_bw']:.0f}% BW); {ratios}"
        + (f"; other paths {' '.join(alts)}" if alts else "")
    )


COLUMNS = (
    "KxN",
    "M",
    "weights",
    "path",
    "us",
    "TB/s",
    "%BW",
    "TFLOP/s",
    "%pk",
    "fp16 us",
    "xFP16",
    "xINT8",
    "xFP8",
    "xtorchao",
    "noise",
    "alt",
)


def _cells(r: dict[str, Any]) -> list[str]:
    roof, sp, num = r["roofline"], r["speedup"], tables.num
    alts = _alternatives(r)
    fp16 = r["baselines"].get("fp16")
    return [
        f"{r['k']}x{r['n']}",
        str(r["m"]),
        row_label(r),
        r["path"],
        f"{r['quant']['median_us']:.2f}",
        f"{roof['tbps']:.2f}",
        f"{roof['pct_copy_bw']:.0f}",
        f"{roof['tflops']:.1f}",
        f"{roof['pct_fp16_peak']:.0f}",
        num(fp16 and fp16["median_us"], ".2f"),
        num(sp.get("fp16"), ".2f"),
        num(sp.get("int8"), ".2f"),
        num(sp.get("fp8"), ".2f"),
        num(sp.get("tinygemm"), ".2f"),
        num(r["noise"] if r["noise"] is None else 100 * r["noise"], ".1f", "%"),
        " ".join(alts),
    ]


def _peer_errors(report: dict[str, Any]) -> list[str]:
    seen: dict[str, str] = {}
    for r in report["results"]:
        for name, why in r.get("baseline_errors", {}).items():
            seen.setdefault(f"{PEER_LABELS.get(name, name)}: {why}", f"{r['k']}x{r['n']} M={r['m']}")
    return [f"not timed, {msg} (first at {where})" for msg, where in seen.items()]


def report_parts(report: dict[str, Any]) -> list[Any]:
    d, c = report["device"], report["ceilings"]
    tg = report["config"].get("tinygemm_group_size")
    return [
        f"device: {d.get('name')}  SMs {d.get('sms')}  L2 {d.get('l2_mb')} MB  torch {d.get('torch')}  "
        f"cupy {d.get('cupy')}",
        f"ceilings (measured): copy {c['copy_tbps']:.2f} TB/s (read+write), cuBLAS FP16 {c['fp16_tflops']:.0f} "
        f"TFLOP/s, launch floor {c.get('launch_floor_us', float('nan')):.2f} us per kernel (tiny kernel, graph "
        "replay)",
        tables.table(
            "quantized matmuls against cuBLAS FP16/INT8/FP8"
            + (f" and torchao int4 g{tg} (bfloat16)" if tg else ""),
            COLUMNS,
            (_cells(r) for r in report["results"]),
            left=4,
            left_last=1,
            caption="%BW: bytes the kernel must read+write / time vs copy bandwidth; xBASE: baseline time / our "
            "time (INT8/FP8 run at M padded to their minimum; cuBLAS FP16 timed before and after ours, the "
            "faster counts); noise: same path timed twice",
        ),
        *_peer_errors(report),
    ]


def format_report(report: dict[str, Any]) -> str:
    return tables.render(report_parts(report))


def figure(report: dict[str, Any]) -> plot.Figure:
    """Per shape, time of cuBLAS FP16 / time of each kernel against M: ours and the peers."""
    panels = []
    shapes = list(dict.fromkeys((r["k"], r["n"]) for r in report["results"]))
    for k, n in shapes:
        rows = [r for r in report["results"] if (r["k"], r["n"]) == (k, n)]
        ms = sorted({r["m"] for r in rows})
        series: dict[str, list[float | None]] = {}
        for r in rows:
            series.setdefault(row_label(r), [None] * len(ms))[ms.index(r["m"])] = r["speedup"].get("fp16")
        peers = []
        for name in PEERS:
            label = PEER_LABELS[name]
            if name == "tinygemm" and report["config"].get("tinygemm_group_size"):
                label += f" g{report['config']['tinygemm_group_size']}"
            ys: list[float | None] = [None] * len(ms)
            for r in rows:
                b, f = r["baselines"].get(name), r["baselines"].get("fp16")
                if isinstance(b, dict) and isinstance(f, dict):
                    ys[ms.index(r["m"])] = stats.speedup(f["median_us"], b["median_us"])
            if any(y is not None for y in ys):
                series[label] = ys
                peers.append(label)
        panels.append(plot.Panel(f"KxN {k}x{n}", ms, series, xlabel="tokens M", peers=tuple(peers)))
    return plot.Figure(
        f"qtool bench kernels on {report['device'].get('name')}",
        "cuBLAS FP16 time / time",
        "cuBLAS FP16",
        panels,
    )


def write_plot(report: dict[str, Any], path: str) -> None:
    plot.write(figure(report), path)


def write_json(report: dict[str, Any], path: str) -> None:
    """`--json-out`: the report at `path`, through a temporary sibling (a file appears only whole)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps(report, indent=2, sort_keys=False) + "\n")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


def rotations(set_bytes: int, l2_bytes: int, cap: int = 64) -> int:
    """Buffer sets needed so one pass over them is well beyond L2 (so no call finds its inputs cached)."""
    return max(2, min(cap, math.ceil(2.5 * l2_bytes / max(1, set_bytes))))
