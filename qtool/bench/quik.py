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

from qtool.bench import stats
from qtool.bench.kernels import measure_ceilings
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


def _summ(timer: Timer, make: Callable[[], Fns], warmup: int, iters: int) -> dict[str, float]:
    fns = make()
    try:
        return stats.summarize(timer(fns, warmup, iters)).to_dict()
    finally:
        del fns


def _ratios(base: dict[str, Any], us: float) -> dict[str, float | None]:
    return {name: (stats.speedup(v["median_us"], us) if isinstance(v, dict) else None) for name, v in base.items()}


def run_quik_bench(cfg: QuikBenchConfig, cases: QuikCases, timer: Timer,
                   log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    ceilings = measure_ceilings(cases, timer, cfg.warmup, cfg.iters)
    log(f"ceilings: copy {ceilings['copy_tbps']:.2f} TB/s, fp16 matmul {ceilings['fp16_tflops']:.0f} TFLOP/s")
    rows = []
    m = cfg.m
    for k, n in cfg.shapes:
        first = _summ(timer, lambda: cases.fp16(k, n, m), cfg.warmup, cfg.iters)  # noqa: B023
        base: dict[str, Any] = {"fp16": first}
        errors: dict[str, str] = {}
        for name, maker in (("int8", cases.int8), ("fp8", cases.fp8)):
            try:
                fns, m_eff = maker(k, n, m)
                base[name] = {**stats.summarize(timer(fns, cfg.warmup, cfg.iters)).to_dict(), "m_eff": m_eff}
                del fns
            except Exception as exc:  # noqa: BLE001  a baseline the card/library lacks is reported, not fatal
                base[name] = None
                errors[name] = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]

        timed: list[dict[str, Any]] = []

        def t(bits: int, ko: int, rung: str, k: int = k, n: int = n,
              timed: list[dict[str, Any]] = timed) -> dict[str, Any]:
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
        overhead = {str(ko): (v["median_us"] / zero["median_us"] - 1.0 if zero else None) for ko, v in sweep.items()}
        row = {
            "k": k, "n": n, "m": m, "baselines": base, "baseline_errors": errors,
            "w4a4_ladder": ladder, "ladder_outliers": cfg.ladder_outliers, "w4a4_forms": forms,
            "w4a4_outliers": {str(ko): v for ko, v in sweep.items()}, "outlier_overhead": overhead,
            "w8a8": w8a8,
            "noise": stats.noise(ladder["fused"]["median_us"], again["median_us"]),
        }
        rows.append(row)
        for line in format_row(row):
            log(line)
    return {
        "schema": QUIK_SCHEMA,
        "device": cases.device_info(),
        "ceilings": ceilings,
        "config": {"shapes": [f"{k}x{n}" for k, n in cfg.shapes], "m": m, "outliers": list(cfg.outlier_counts),
                   "ladder_outliers": cfg.ladder_outliers, "warmup": cfg.warmup, "iters": cfg.iters,
                   "shape_convention": "KxN = in_features x out_features; TOPS counts 2*M*N*K"},
        "results": rows,
    }


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def format_row(r: dict[str, Any]) -> list[str]:
    fp16 = r["baselines"]["fp16"]["median_us"]
    runs = r["baselines"]["fp16"].get("runs_us")
    both = f" (faster of {runs[0]:.1f} before / {runs[1]:.1f} after ours)" if runs else ""
    out = [f"{r['k']}x{r['n']} M={r['m']}: cuBLAS fp16 {fp16:.1f} us{both}"
           + "".join(f", {b} {_x(v and v['median_us'])} us" for b, v in r["baselines"].items() if b != "fp16")]

    def line(label: str, v: dict[str, Any]) -> str:
        sp = v["speedup"]
        return (f"  {label:<24} {v['median_us']:>8.1f} us {v['tops']:>6.0f} TOPS  xFP16 {_x(sp.get('fp16'))}  "
                f"xINT8 {_x(sp.get('int8'))}  xFP8 {_x(sp.get('fp8'))}")

    for rung, v in r["w4a4_ladder"].items():
        out.append(line(f"w4a4 {rung} k={r['ladder_outliers']}", v))
    for form, v in r.get("w4a4_forms", {}).items():
        if v is None:
            out.append(f"  w4a4 {form:<19} -  ({r['baseline_errors'].get(form, 'not run')})")
        else:
            out.append(line(f"w4a4 {form} k={r['ladder_outliers']}", v))
    for ko, v in r["w4a4_outliers"].items():
        ov = r["outlier_overhead"].get(ko)
        out.append(line(f"w4a4 fused k={ko}", v) + (f"  outliers +{100 * ov:.1f}%" if ov is not None else ""))
    if r.get("w8a8"):
        out.append(line(f"w8a8 fused k={r['ladder_outliers']}", r["w8a8"]))
    return out


def format_report(report: dict[str, Any]) -> str:
    d, c = report["device"], report["ceilings"]
    lines = [f"device: {d.get('name')}  SMs {d.get('sms')}  torch {d.get('torch')}  cupy {d.get('cupy')}",
             f"ceilings (measured): copy {c['copy_tbps']:.2f} TB/s, cuBLAS FP16 {c['fp16_tflops']:.0f} TFLOP/s",
             "xBASE: baseline time / our time, same shape, same run; TOPS: 2*M*N*K / time"]
    for r in report["results"]:
        lines += format_row(r)
    return "\n".join(lines)


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
