"""`qtool bench quik`: the QUIK kernels against cuBLAS FP16/INT8/FP8 in one run, with the paper's ladder.

* Fig. 5 ladder (W4A4 at one outlier count): ``unfused`` (torch split + quantize, integer GEMM to int32, torch
  dequantization and outlier matmul), ``fused-quant`` (the quantize kernel instead of the torch ops) and
  ``fused`` (the dispatched path: quantize kernel + GEMM with the Eq. 1 epilogue and the outlier product inside, or
  for long W4A4 layers one kernel that also quantizes). Beside it, both forms forced (``w4a4_forms``:
  ``two-kernel``, ``one-kernel``; None where the one-kernel form cannot take the shape).
* Fig. 14 sweep: the fused W4A4 path at several outlier counts; overhead = time(k) / time(0) - 1.
* W8A8 fused at the ladder's outlier count, beside the FP8 `_scaled_mm` baseline.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from qtool.bench import plot, stats, tables
from qtool.bench.kernels import PEER_LABELS, measure_ceilings, time_peers
from qtool.bench.timing import Fns, Timer

QUIK_SCHEMA = "qtool.bench.quik/1"
RUNGS = ("unfused", "fused-quant", "fused")


class QuikCases(Protocol):
    def device_info(self) -> dict[str, Any]: ...
    def copy_variants(self) -> list[tuple[str, Fns, int]]: ...
    def matmul_peak(self) -> tuple[Fns, int]: ...
    def launch_floor(self) -> Fns: ...
    def fp16(self, k: int, n: int, m: int) -> Fns: ...
    def int8(self, k: int, n: int, m: int) -> tuple[Fns, int]: ...
    def fp8(self, k: int, n: int, m: int) -> tuple[Fns, int]: ...
    def tinygemm(self, k: int, n: int, m: int, group_size: int) -> tuple[Fns, int]: ...
    def quik(self, k: int, n: int, m: int, bits: int, outliers: int, rung: str) -> Fns: ...


@dataclass
class QuikBenchConfig:
    shapes: list[tuple[int, int]]
    m: int = 2048
    outlier_counts: tuple[int, ...] = (0, 128, 256, 512, 1024)
    ladder_outliers: int = 256
    w8a8: bool = True
    warmup: int = 10
    iters: int = 100
    tinygemm_group_size: int | None = None  # torchao int4 (W4A16) peer at this group size; None: not timed


def _summ(timer: Timer, make: Callable[[], Fns], warmup: int, iters: int) -> dict[str, float]:
    fns = make()
    try:
        return stats.summarize(timer(fns, warmup, iters)).to_dict()
    finally:
        del fns


def _ratios(base: dict[str, Any], us: float) -> dict[str, float | None]:
    return {
        name: (stats.speedup(v["median_us"], us) if isinstance(v, dict) else None) for name, v in base.items()
    }


def run_quik_bench(
    cfg: QuikBenchConfig, cases: QuikCases, timer: Timer, log: Callable[[str], None] = lambda s: None
) -> dict[str, Any]:
    ceilings = measure_ceilings(cases, timer, cfg.warmup, cfg.iters)
    log(f"ceilings: copy {ceilings['copy_tbps']:.2f} TB/s, fp16 matmul {ceilings['fp16_tflops']:.0f} TFLOP/s")
    rows = []
    m = cfg.m
    for k, n in cfg.shapes:
        first = _summ(timer, lambda: cases.fp16(k, n, m), cfg.warmup, cfg.iters)  # noqa: B023
        peers, errors = time_peers(cases, timer, k, n, m, cfg.warmup, cfg.iters, cfg.tinygemm_group_size)
        base: dict[str, Any] = {"fp16": first, **peers}

        timed: list[dict[str, Any]] = []

        def t(
            bits: int, ko: int, rung: str, k: int = k, n: int = n, timed: list[dict[str, Any]] = timed
        ) -> dict[str, Any]:
            s = _summ(timer, lambda: cases.quik(k, n, m, bits, ko, rung), cfg.warmup, cfg.iters)
            tops = stats.gemm_flops(m, n, k) / (s["median_us"] * 1e-6) / 1e12
            timed.append({**s, "tops": tops})
            return timed[-1]

        ladder = {rung: t(4, cfg.ladder_outliers, rung) for rung in RUNGS}
        sweep = {ko: t(4, ko, "fused") for ko in cfg.outlier_counts if ko <= k}
        if cfg.ladder_outliers not in sweep:
            sweep[cfg.ladder_outliers] = ladder["fused"]
        again = t(4, cfg.ladder_outliers, "fused")
        forms: dict[str, Any] = {}
        for form in ("two-kernel", "one-kernel"):
            try:
                forms[form] = t(4, cfg.ladder_outliers, form)
            except ValueError as exc:  # the one-kernel form does not take this shape: say why
                forms[form] = None
                errors[form] = str(exc)
        w8a8 = t(8, cfg.ladder_outliers, "fused") if cfg.w8a8 else None
        last = _summ(timer, lambda: cases.fp16(k, n, m), cfg.warmup, cfg.iters)  # noqa: B023
        base["fp16"] = stats.faster_run(first, last)
        for v in timed:
            v["speedup"] = _ratios(base, v["median_us"])
        zero = sweep.get(0)
        overhead = {
            str(ko): (v["median_us"] / zero["median_us"] - 1.0 if zero else None) for ko, v in sweep.items()
        }
        row = {
            "k": k,
            "n": n,
            "m": m,
            "baselines": base,
            "baseline_errors": errors,
            "w4a4_ladder": ladder,
            "ladder_outliers": cfg.ladder_outliers,
            "w4a4_forms": forms,
            "w4a4_outliers": {str(ko): v for ko, v in sweep.items()},
            "outlier_overhead": overhead,
            "w8a8": w8a8,
            "noise": stats.noise(ladder["fused"]["median_us"], again["median_us"]),
        }
        rows.append(row)
        log(tables.render([_table(row)]))
    return {
        "schema": QUIK_SCHEMA,
        "device": cases.device_info(),
        "ceilings": ceilings,
        "config": {
            "shapes": [f"{k}x{n}" for k, n in cfg.shapes],
            "m": m,
            "outliers": list(cfg.outlier_counts),
            "ladder_outliers": cfg.ladder_outliers,
            "warmup": cfg.warmup,
            "iters": cfg.iters,
            "tinygemm_group_size": cfg.tinygemm_group_size,
            "shape_convention": "KxN = in_features x out_features; TOPS counts 2*M*N*K",
        },
        "results": rows,
    }


def _cells(label: str, v: dict[str, Any], overhead: float | None = None) -> list[str]:
    sp, num = v["speedup"], tables.num
    return [
        label,
        f"{v['median_us']:.1f}",
        f"{v['tops']:.0f}",
        num(sp.get("fp16"), ".2f"),
        num(sp.get("int8"), ".2f"),
        num(sp.get("fp8"), ".2f"),
        num(sp.get("tinygemm"), ".2f"),
        "" if overhead is None else f"{100 * overhead:+.1f}%",
    ]


def _table(r: dict[str, Any]) -> Any:
    fp16 = r["baselines"]["fp16"]
    runs = fp16.get("runs_us")
    both = f" (faster of {runs[0]:.1f} before / {runs[1]:.1f} after ours)" if runs else ""
    title = f"{r['k']}x{r['n']} M={r['m']}: cuBLAS FP16 {fp16['median_us']:.1f} us{both}" + "".join(
        f", {PEER_LABELS.get(b, b)} {tables.num(v and v['median_us'], '.1f')} us"
        for b, v in r["baselines"].items()
        if b != "fp16"
    )
    ko = r["ladder_outliers"]
    rows = [_cells(f"w4a4 {rung} k={ko}", v) for rung, v in r["w4a4_ladder"].items()]
    for form, v in r.get("w4a4_forms", {}).items():
        rows.append(
            _cells(f"w4a4 {form} k={ko}", v)
            if v is not None
            else [f"w4a4 {form}", "-", "-", "-", "-", "-", "-", r["baseline_errors"].get(form, "not run")]
        )
    rows += [
        _cells(f"w4a4 fused k={k}", v, r["outlier_overhead"].get(k)) for k, v in r["w4a4_outliers"].items()
    ]
    if r.get("w8a8"):
        rows.append(_cells(f"w8a8 fused k={ko}", r["w8a8"]))
    return tables.table(
        title, ("kernel", "us", "TOPS", "xFP16", "xINT8", "xFP8", "xtorchao", "outliers"), rows, left_last=1
    )


def report_parts(report: dict[str, Any]) -> list[Any]:
    d, c = report["device"], report["ceilings"]
    parts: list[Any] = [
        f"device: {d.get('name')}  SMs {d.get('sms')}  torch {d.get('torch')}  cupy {d.get('cupy')}",
        f"ceilings (measured): copy {c['copy_tbps']:.2f} TB/s, cuBLAS FP16 {c['fp16_tflops']:.0f} TFLOP/s",
        "xBASE: baseline time / our time, same shape, same run; TOPS: 2*M*N*K / time; outliers: time over the "
        "fused W4A4 layer without outlier columns",
    ]
    for r in report["results"]:
        parts.append(_table(r))
        parts += [
            f"  {PEER_LABELS.get(b, b)} not timed: {why}"
            for b, why in r["baseline_errors"].items()
            if b in PEER_LABELS
        ]
    return parts


def format_report(report: dict[str, Any]) -> str:
    return tables.render(report_parts(report))


def figure(report: dict[str, Any]) -> plot.Figure:
    """FP16 time / time of each QUIK layer per shape at the ladder's outlier count, beside the peers; and of the
    fused W4A4 layer against the outlier count."""
    rs = report["results"]
    shapes = [f"{r['k']}x{r['n']}" for r in rs]
    ko = report["config"]["ladder_outliers"]
    series: dict[str, list[float | None]] = {
        f"W4A4 {rung}": [r["w4a4_ladder"][rung]["speedup"].get("fp16") for r in rs] for rung in RUNGS
    }
    series["W8A8 fused"] = [(r.get("w8a8") or {}).get("speedup", {}).get("fp16") for r in rs]
    peers = []
    for name in ("int8", "fp8", "tinygemm"):
        ys = [
            stats.speedup(r["baselines"]["fp16"]["median_us"], r["baselines"][name]["median_us"])
            if isinstance(r["baselines"].get(name), dict)
            else None
            for r in rs
        ]
        if any(y is not None for y in ys):
            label = PEER_LABELS[name] + (
                f" g{report['config']['tinygemm_group_size']}" if name == "tinygemm" else ""
            )
            series[label] = ys
            peers.append(label)
    counts = sorted({int(k) for r in rs for k in r["w4a4_outliers"]})
    sweep = {
        f"W4A4 fused {s}": [r["w4a4_outliers"].get(str(c), {}).get("speedup", {}).get("fp16") for c in counts]
        for s, r in zip(shapes, rs, strict=True)
    }
    m = report["config"]["m"]
    return plot.Figure(
        f"qtool bench quik on {report['device'].get('name')}, M={m}",
        "cuBLAS FP16 time / time",
        "cuBLAS FP16",
        [
            plot.Panel(
                f"QUIK layers, {ko} outlier columns",
                shapes,
                series,
                kind="bar",
                xlabel="KxN",
                peers=tuple(peers),
            ),
            plot.Panel("W4A4 fused against outlier columns", counts, sweep, xlabel="outlier columns"),
        ],
    )


def validate_report(report: dict[str, Any]) -> list[str]:
    """Schema problems of a quik bench report (empty when it is well-formed)."""
    errs = []
    if report.get("schema") != QUIK_SCHEMA:
        errs.append(f"schema: found {report.get('schema')!r}, expected {QUIK_SCHEMA!r}")
    for key in ("device", "ceilings", "config", "results"):
        if key not in report:
            errs.append(f"{key}: missing")
    for i, r in enumerate(report.get("results", [])):
        for key in ("k", "n", "m", "baselines", "w4a4_ladder", "w4a4_outliers", "outlier_overhead", "noise"):
            if key not in r:
                errs.append(f"results[{i}].{key}: missing")
        for rung in RUNGS:
            v = r.get("w4a4_ladder", {}).get(rung)
            if not isinstance(v, dict) or not v.get("median_us", 0) > 0:
                errs.append(f"results[{i}].w4a4_ladder.{rung}: found {v!r}, expected a timing")
    return errs
