"""The kernel bench's mixed-2-4-16 rows, with fake cases and a fake timer (no GPU): one row per outlier fraction
beside the grouped_int rows, the GEMV with fused or separate outliers below 17 tokens, the bytes the cases count."""

from __future__ import annotations

import pytest

import qtool.bench.command as command
from qtool.bench import kernels as kb
from qtool.bench import stats
from qtool.bench.command import _fractions
from tests.test_bench_plot import _e2e_report
from tests.test_bench_stats import FakeCases, FakeTimer

from bad_input import assert_one_line_error, run_cli

PATH_US = {"mixed-gemv": 2.0, "mixed-gemv+spmv": 2.5, "mixed-dq+cublas": 8.0}


class MixedTimer(FakeTimer):
    def __call__(self, fns, warmup, iters):
        if fns[0]() in PATH_US:
            return [PATH_US[fns[0]()]] * iters
        return super().__call__(fns, warmup, iters)


class MixedCases(FakeCases):
    def mixed_paths(self, k, n, m, outlier_fraction):
        cands = (["mixed-gemv"] + (["mixed-gemv+spmv"] if outlier_fraction else [])) if m <= 16 else []
        return (
            cands + (["mixed-dq+cublas"] if m >= 16 else []),
            "mixed-gemv" if m <= 16 else "mixed-dq+cublas",
            3_000_000,
        )

    def mixed(self, k, n, m, outlier_fraction, path):
        return [lambda: path]


def test_mixed_rows_beside_the_grouped_int_rows():
    cfg = kb.KernelBenchConfig(
        shapes=[(4096, 4096)],
        ms=[1, 64],
        bits=[4],
        group_sizes=[128],
        warmup=3,
        iters=50,
        mixed_outliers=[0.0, 0.002],
    )
    report = kb.run_kernel_bench(cfg, MixedCases(), MixedTimer())
    assert stats.validate_kernels_report(report) == []
    rows = report["results"]
    mixed = [r for r in rows if r.get("layout") == "mixed-2-4-16"]
    assert [(r["m"], r["outlier_fraction"], r["path"]) for r in mixed] == [
        (1, 0.0, "mixed-gemv"),
        (1, 0.002, "mixed-gemv"),
        (64, 0.0, "mixed-dq+cublas"),
        (64, 0.002, "mixed-dq+cublas"),
    ]
    one = mixed[1]
    assert set(one["candidates"]) == {"mixed-gemv", "mixed-gemv+spmv"}
    assert one["quant"]["median_us"] == 2.0 and one["roofline"]["bytes"] == 3_000_000
    line = kb.format_row(one)
    assert "mixed-2-4-16 0.2% mixed-gemv:" in line and "mixed-gemv+spmv=2.5" in line
    assert report["config"]["mixed_outliers"] == [0.0, 0.002]


def test_no_mixed_rows_where_the_shape_has_no_whole_blocks():
    cfg = kb.KernelBenchConfig(
        shapes=[(4096, 1000), (4100, 4096)],
        ms=[1],
        bits=[4],
        group_sizes=[128],
        warmup=3,
        iters=50,
        mixed_outliers=[0.0],
    )
    report = kb.run_kernel_bench(cfg, MixedCases(), MixedTimer())
    assert [r.get("layout") for r in report["results"]] == [None, None]


def test_mixed_fraction_option():
    assert _fractions("0,0.002") == [0.0, 0.002]
    assert _fractions("none-rows") == []
    with pytest.raises(stats.BenchError, match="--mixed: found '0.01'"):
        _fractions("0.01")


def test_e2e_mixed_option_reaches_the_run(monkeypatch):
    """`qtool bench e2e --mixed`: the fractions reach the run; a fraction over the layout's cap is refused."""
    monkeypatch.setattr(command, "_need_gpu", lambda: None)
    seen = {}

    def fake(*a, **k):
        seen.update(k)
        return _e2e_report(False)

    monkeypatch.setattr("qtool.bench.e2e.run_e2e", fake)
    res = run_cli(["bench", "e2e", "--model-config", "tiny", "--mixed", "0,0.002"])
    assert res.exit_code == 0, res.output
    assert seen["mixed"] == (0.0, 0.002)
    res = run_cli(["bench", "e2e", "--model-config", "tiny"])
    assert res.exit_code == 0 and seen["mixed"] == ()
    assert_one_line_error(
        run_cli(["bench", "e2e", "--model-config", "tiny", "--mixed", "0.01"]), 2, "--mixed: found '0.01'"
    )


def test_e2e_weight_bytes_counts_each_storage_on_the_model_device_once():
    """`weights GiB` of `qtool bench e2e`: parameters, buffers and a layer's prepared kernel view, each storage once,
    only what sits on the model's device (a mixed layer's checkpoint tensors in host memory are left out)."""
    import torch

    from qtool.bench import e2e

    lin = torch.nn.Linear(8, 4, bias=False)
    view = torch.zeros(3, dtype=torch.int32)

    class Prepared:
        def tensors(self):
            return [lin.weight, view]

    lin.prepared = Prepared()
    lin.register_buffer("host_copy", torch.zeros(5, device="meta"))
    assert e2e.weight_bytes(lin) == 8 * 4 * 4 + 3 * 4
