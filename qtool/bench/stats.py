"""Statistics, byte/FLOP accounting and the JSON report of `qtool bench` (pure Python: no GPU needed)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from qtool.errors import UsageError


class BenchError(UsageError, ValueError):
    """A bench option the bench cannot take (exit code 2). Also a ValueError: the parsers were ValueError-raising
    before the bench had its own class, and callers outside the CLI may still catch that."""


KERNELS_SCHEMA = "qtool.bench.kernels/1"
E2E_SCHEMA = "qtool.bench.e2e/1"


@dataclass(frozen=True)
class Summary:
    n: int
    median_us: float
    mean_us: float
    min_us: float
    p10_us: float
    p90_us: float

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def percentile(xs: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]."""
    if not xs:
        raise ValueError("percentile: found no samples, expected at least one")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile: found q={q}, expected 0..100")
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(samples_us: Sequence[float]) -> Summary:
    if not samples_us:
        raise ValueError("summarize: found no samples, expected at least one")
    bad = [x for x in samples_us if not math.isfinite(x) or x <= 0]
    if bad:
        raise ValueError(f"summarize: found non-positive or non-finite sample {bad[0]!r}, expected times > 0")
    return Summary(
        n=len(samples_us),
        median_us=percentile(samples_us, 50),
        mean_us=sum(samples_us) / len(samples_us),
        min_us=min(samples_us),
        p10_us=percentile(samples_us, 10),
        p90_us=percentile(samples_us, 90),
    )


def noise(a_us: float, b_us: float) -> float:
    """Relative spread of one thing timed twice: differences below this are not a result."""
    return abs(a_us - b_us) / min(a_us, b_us)


def faster_run(first: dict[str, Any], last: dict[str, Any]) -> dict[str, Any]:
    """A baseline timed before and after ours (summaries as dicts): the faster median, with both in `runs_us`.
    cuBLAS's own time moves between runs by more than ours, so the ratios can only come out lower for it."""
    return {
        **min(first, last, key=lambda v: v["median_us"]),
        "runs_us": [first["median_us"], last["median_us"]],
    }


def speedup(baseline_us: float | None, us: float) -> float | None:
    """> 1 means `us` is faster than the baseline."""
    if baseline_us is None:
        return None
    return baseline_us / us


def packed_words(k: int, bits: int) -> int:
    return (k * bits + 31) // 32


def quant_bytes(m: int, n: int, k: int, bits: int, group_size: int | None, symmetric: bool) -> int:
    """Fewest bytes a grouped_int matmul must move: packed weight, scales (+zeros), activations in, output out."""
    g = group_size or k
    groups = (k + g - 1) // g
    weight = n * packed_words(k, bits) * 4 + n * groups * 2 + (0 if symmetric else n * groups)
    return weight + 2 * m * k + 2 * m * n


def fp16_bytes(m: int, n: int, k: int) -> int:
    return 2 * n * k + 2 * m * k + 2 * m * n


def gemm_flops(m: int, n: int, k: int) -> int:
    return 2 * m * n * k


def roofline(us: float, nbytes: int, flops: int, copy_tbps: float, peak_tflops: float) -> dict[str, float]:
    """Achieved rate against the measured ceilings, and the floor time those ceilings allow."""
    s = us * 1e-6
    tbps = nbytes / s / 1e12
    tflops = flops / s / 1e12
    floor_us = max(nbytes / (copy_tbps * 1e12), flops / (peak_tflops * 1e12)) * 1e6
    return {
        "bytes": nbytes,
        "flops": flops,
        "tbps": tbps,
        "pct_copy_bw": 100 * tbps / copy_tbps,
        "tflops": tflops,
        "pct_fp16_peak": 100 * tflops / peak_tflops,
        "floor_us": floor_us,
        "pct_of_floor": 100 * floor_us / us,
    }


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """`4096x4096,4096x11008` -> [(K, N), ...] (in_features x out_features)."""
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        bits = part.split("x")
        if len(bits) != 2 or not all(b.isdigit() and int(b) > 0 for b in bits):
            raise BenchError(
                f"--shapes: found {part!r}, expected KxN with positive integers, e.g. 4096x11008"
            )
        out.append((int(bits[0]), int(bits[1])))
    if not out:
        raise BenchError(f"--shapes: found {text!r}, expected at least one KxN")
    return out


def parse_ints(text: str, option: str, lo: int = 1) -> list[int]:
    vals = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if not part.isdigit() or int(part) < lo:
            raise BenchError(f"{option}: found {part!r}, expected integers >= {lo}, comma-separated")
        vals.append(int(part))
    if not vals:
        raise BenchError(f"{option}: found {text!r}, expected at least one integer")
    return vals


# (field name, type or tuple of types, required) for each result row of the kernels report.
_RESULT_FIELDS: list[tuple[str, Any, bool]] = [
    ("k", int, True),
    ("n", int, True),
    ("m", int, True),
    ("bits", int, True),
    ("group_size", (int, type(None)), True),
    ("symmetric", bool, True),
    ("path", str, True),
    ("quant", dict, True),
    ("candidates", dict, True),
    ("baselines", dict, True),
    ("roofline", dict, True),
    ("speedup", dict, True),
    ("noise", (float, type(None)), True),
]


def validate_kernels_report(report: dict[str, Any]) -> list[str]:
    """Problems with a kernels report (empty when it matches the schema)."""
    errs: list[str] = []
    if report.get("schema") != KERNELS_SCHEMA:
        errs.append(f"schema: found {report.get('schema')!r}, expected {KERNELS_SCHEMA!r}")
    for key in ("device", "ceilings", "config", "results"):
        if key not in report:
            errs.append(f"{key}: missing")
    ceil = report.get("ceilings", {})
    for key in ("copy_tbps", "fp16_tflops"):
        v = ceil.get(key)
        if not isinstance(v, (int, float)) or v <= 0:
            errs.append(f"ceilings.{key}: found {v!r}, expected a positive number")
    for i, row in enumerate(report.get("results", [])):
        for name, typ, required in _RESULT_FIELDS:
            if name not in row:
                if required:
                    errs.append(f"results[{i}].{name}: missing")
                continue
            if not isinstance(row[name], typ):
                errs.append(f"results[{i}].{name}: found {type(row[name]).__name__}, expected {typ}")
        q = row.get("quant", {})
        if not isinstance(q.get("median_us"), (int, float)):
            errs.append(f"results[{i}].quant.median_us: missing")
        for base, val in row.get("baselines", {}).items():
            if val is not None and not isinstance(val.get("median_us"), (int, float)):
                errs.append(f"results[{i}].baselines.{base}.median_us: missing")
    return errs
