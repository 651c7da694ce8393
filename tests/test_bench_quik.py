"""`qtool bench quik`'s report (ladder, outlier sweep, baselines, overheads, schema) with a fake timer, no GPU."""

from __future__ import annotations

import json
import re

import pytest
from click.testing import CliRunner

from qtool.bench import quik as qb
from tests.test_bench_stats import FakeCases as KernelFakeCases

# Per-call microseconds the fake timer returns for each labelled callable.
TIMES = {
    "floor": 2.0,
    "copy": 1000.0,
    "peak": 1600.0,
    "fp16": 100.0,
    "int8": 90.0,
    "fp8": 55.0,
    "unfused": 700.0,
    "fused-quant": 330.0,
    "fused/4/0": 50.0,
    "fused/4/128": 52.0,
    "fused/4/256": 55.0,
    "fused/4/512": 60.0,
    "fused/4/1024": 70.0,
    "fused/8/256": 80.0,
    "fused/8/128": 78.0,
    "two-kernel": 56.0,
    "one-kernel": 54.0,
    "tinygemm": 125.0,
}


class FakeTimer:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def __call__(self, fns, warmup, iters):
        label = fns[0]()
        self.calls.append((label, iters))
        return [TIMES[label] * (1 + 0.01 * ((i % 3) - 1)) for i in range(iters)]


class FakeCases(KernelFakeCases):
    def __init__(self) -> None:
        self.asked: list[tuple] = []

    def fp8(self, k, n, m):
        return [lambda: "fp8"], m

    def quik(self, k, n, m, bits, outliers, rung):
        self.asked.append((k, n, m, bits, outliers, rung))
        label = rung if rung != "fused" else f"fused/{bits}/{outliers}"
        return [lambda: label]


def _run(**kw):
    cfg = qb.QuikBenchConfig(shapes=[(4096, 4096)], warmup=2, iters=50, **kw)
    cases = FakeCases()
    return qb.run_quik_bench(cfg, cases, FakeTimer()), cases


def test_ladder_sweep_and_ratios():
    report, cases = _run()
    assert qb.validate_report(report) == []
    json.dumps(report)  # serialisable as written by --json
    (row,) = report["results"]
    assert row["m"] == 2048 and report["config"]["ladder_outliers"] == 256
    assert set(row["w4a4_ladder"]) == {"unfused", "fused-quant", "fused"}
    assert row["w4a4_ladder"]["fused"]["median_us"] == pytest.approx(55.0)
    assert row["w4a4_ladder"]["fused"]["speedup"]["fp16"] == pytest.approx(100.0 / 55.0)
    assert row["w4a4_ladder"]["fused"]["speedup"]["fp8"] == pytest.approx(1.0)
    assert row["w4a4_ladder"]["unfused"]["speedup"]["fp16"] == pytest.approx(100.0 / 700.0)
    assert list(row["w4a4_outliers"]) == ["0", "128", "256", "512", "1024"]
    assert row["outlier_overhead"]["256"] == pytest.approx(0.10)
    assert row["outlier_overhead"]["1024"] == pytest.approx(0.40)
    assert row["w8a8"]["median_us"] == pytest.approx(80.0)
    tops = 2 * 2048 * 4096 * 4096 / (55.0e-6) / 1e12
    assert row["w4a4_ladder"]["fused"]["tops"] == pytest.approx(tops)
    # Every quik measurement was asked for the weight bits and outlier count it reports.
    assert (4096, 4096, 2048, 8, 256, "fused") in cases.asked
    text = qb.format_report(report)
    # the sweep's row at 256 outlier columns: xFP8 1.00 and 10% over the layer without outliers
    assert re.search(r"^ *w4a4 fused k=256 +55\.0 .* 1\.00 +- +\+10\.0%$", text, re.M), text
    # both forms of the W4A4 layer, forced, beside the dispatched one
    assert row["w4a4_forms"]["two-kernel"]["median_us"] == pytest.approx(56.0)
    assert row["w4a4_forms"]["one-kernel"]["speedup"]["fp16"] == pytest.approx(100.0 / 54.0)
    assert "w4a4 one-kernel k=256" in text and "w4a4 two-kernel k=256" in text


def test_one_kernel_form_that_cannot_take_a_shape_is_reported_not_fatal():
    class NoOneKernel(FakeCases):
        def quik(self, k, n, m, bits, outliers, rung):
            if rung == "one-kernel":
                raise ValueError(
                    "107 stages per tile (the 5-stage ring of the two-kernel path is faster from 64)"
                )
            return super().quik(k, n, m, bits, outliers, rung)

    cfg = qb.QuikBenchConfig(shapes=[(11008, 4096)], warmup=2, iters=50)
    report = qb.run_quik_bench(cfg, NoOneKernel(), FakeTimer())
    (row,) = report["results"]
    assert row["w4a4_forms"]["one-kernel"] is None and row["w4a4_forms"]["two-kernel"] is not None
    assert row["baseline_errors"]["one-kernel"].startswith("107 stages per tile")
    assert qb.validate_report(report) == []
    assert re.search(r"^ *w4a4 one-kernel +- .* 107 stages per tile", qb.format_report(report), re.M)


def test_fp16_baseline_is_the_faster_of_its_two_runs():
    class DriftingTimer(FakeTimer):
        """cuBLAS FP16 100 us when first timed, 80 us when timed again after the quik kernels."""

        def __call__(self, fns, warmup, iters):
            samples = super().__call__(fns, warmup, iters)
            if self.calls[-1][0] == "fp16" and sum(c[0] == "fp16" for c in self.calls) > 1:
                return [0.8 * v for v in samples]
            return samples

    cfg = qb.QuikBenchConfig(shapes=[(4096, 4096)], warmup=2, iters=50)
    report = qb.run_quik_bench(cfg, FakeCases(), DriftingTimer())
    (row,) = report["results"]
    fp16 = row["baselines"]["fp16"]
    assert fp16["runs_us"] == [pytest.approx(100.0), pytest.approx(80.0)]
    assert fp16["median_us"] == pytest.approx(80.0)
    # every ratio uses it, the ones timed before the second run included
    assert row["w4a4_ladder"]["unfused"]["speedup"]["fp16"] == pytest.approx(80.0 / 700.0)
    assert row["w4a4_ladder"]["fused"]["speedup"]["fp16"] == pytest.approx(80.0 / 55.0)
    assert row["w8a8"]["speedup"]["fp16"] == pytest.approx(80.0 / 80.0)
    assert "faster of 100.0 before / 80.0 after ours" in qb.format_report(report)


def test_sweep_without_zero_has_no_overhead_and_skips_counts_above_k():
    report, _ = _run(outlier_counts=(128, 8192), ladder_outliers=128)
    (row,) = report["results"]
    assert list(row["w4a4_outliers"]) == ["128"]
    assert row["outlier_overhead"] == {"128": None}


def test_schema_problems_are_named():
    report, _ = _run()
    report["results"][0]["w4a4_ladder"].pop("fused")
    assert any("w4a4_ladder.fused" in p for p in qb.validate_report(report))
    assert qb.validate_report({"schema": "other"})[0].startswith("schema: found 'other'")


def test_cli_without_gpu_is_one_line(monkeypatch):
    import torch

    from qtool.bench.command import bench

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    res = CliRunner().invoke(bench, ["quik", "--shapes", "256x256", "--m", "64"])
    assert res.exit_code != 0 and res.output.strip().count("\n") == 0 and "no CUDA GPU" in res.output
    res = CliRunner().invoke(bench, ["quik", "--outliers", "0,x"])
    assert res.exit_code != 0 and "--outliers: found 'x'" in res.output
