"""The kernel bench's qoq W4A8 rows, with fake cases and a fake timer (no GPU): one row per group size beside the
grouped_int rows, both paths timed, the dispatched one reported, every baseline ratio filled."""

from __future__ import annotations

from qtool.bench import kernels as kb
from qtool.bench import stats
from tests.test_bench_stats import FakeCases, FakeTimer


class W4A8Timer(FakeTimer):
    def __call__(self, fns, warmup, iters):
        if fns[0]() in kb.W4A8_PATHS:
            return [3.0 if fns[0]() == "w4a8" else 2.5] * iters
        return super().__call__(fns, warmup, iters)


class W4A8Cases(FakeCases):
    def w4a8(self, k, n, m, group_size, path):
        assert path in kb.W4A8_PATHS
        return [lambda: path]


def test_w4a8_rows_beside_the_grouped_int_rows():
    cfg = kb.KernelBenchConfig(
        shapes=[(4096, 4096)],
        ms=[1, 64],
        bits=[4],
        group_sizes=[128],
        warmup=3,
        iters=50,
        w4a8_group_sizes=[None, 128],
    )
    report = kb.run_kernel_bench(cfg, W4A8Cases(), W4A8Timer())
    assert stats.validate_kernels_report(report) == []
    rows = report["results"]
    assert [(r["m"], r["path"], r["group_size"]) for r in rows] == [
        (m, p, g) for m in (1, 64) for p, g in ((rows[0]["path"], 128), ("w4a8", None), ("w4a8", 128))
    ]
    for r in rows[1:3]:
        assert set(r["candidates"]) == set(kb.W4A8_PATHS) and r["bits"] == 4 and not r["symmetric"]
        assert r["quant"]["median_us"] == 3.0 and r["best_path"] == "w4a8-gemm"
        assert r["speedup"]["fp16"] == 4.0 and "w4a8-gemm=2.5" in kb.format_row(r)
