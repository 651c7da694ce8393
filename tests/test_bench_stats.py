"""The bench's statistics, accounting and JSON schema, driven by a fake timer and fake cases (no GPU)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from qtool.bench import kernels as kb
from qtool.bench import stats


def test_percentiles_and_summary():
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]
    s = stats.summarize(xs)
    assert s.median_us == 3.0 and s.min_us == 1.0 and s.mean_us == 3.0 and s.n == 5
    assert stats.percentile([1.0, 2.0], 50) == 1.5
    assert stats.percentile(list(map(float, range(101))), 90) == pytest.approx(90.0)
    with pytest.raises(ValueError, match="no samples"):
        stats.summarize([])
    with pytest.raises(ValueError, match="non-positive"):
        stats.summarize([1.0, -2.0])


def test_accounting():
    # 4096x4096 W4 g128 symmetric, M=1: 8 MiB of codes + 256 KiB of scales + x + y.
    b = stats.quant_bytes(1, 4096, 4096, 4, 128, True)
    assert b == 4096 * 512 * 4 + 4096 * 32 * 2 + 2 * 4096 + 2 * 4096
    assert stats.quant_bytes(1, 4096, 4096, 4, 128, False) == b + 4096 * 32
    assert stats.fp16_bytes(1, 4096, 4096) == 2 * 4096 * 4096 + 4 * 4096
    assert stats.gemm_flops(2, 3, 5) == 60
    r = stats.roofline(10.0, 30_000_000, 0, copy_tbps=3.0, peak_tflops=700.0)
    assert r["tbps"] == pytest.approx(3.0) and r["pct_copy_bw"] == pytest.approx(100.0)
    assert r["floor_us"] == pytest.approx(10.0)
    assert stats.speedup(30.0, 10.0) == 3.0 and stats.speedup(None, 1.0) is None
    assert stats.noise(10.0, 11.0) == pytest.approx(0.1)


def test_parsers_name_the_option():
    assert stats.parse_shapes("4096x4096, 4096x11008") == [(4096, 4096), (4096, 11008)]
    with pytest.raises(ValueError, match="--shapes: found '4096'"):
        stats.parse_shapes("4096")
    assert stats.parse_ints("1,16,64", "--m") == [1, 16, 64]
    with pytest.raises(ValueError, match="--m: found 'x'"):
        stats.parse_ints("1,x", "--m")
    assert kb.shapes_for_model("Llama-2-7B") == [(4096, 4096), (4096, 11008), (11008, 4096)]
    with pytest.raises(ValueError, match="--model-config"):
        kb.shapes_for_model("no-such-model")


def test_shapes_from_config_json(tmp_path):
    cfg = {
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert kb.shapes_for_model(str(tmp_path)) == [(2048, 2048), (2048, 256), (2048, 5632), (5632, 2048)]


def test_rotation_exceeds_l2():
    l2 = 50 * 2**20
    for set_bytes in (8_650_000, 33_554_432, 10**9):
        r = kb.rotations(set_bytes, l2)
        assert r >= 2 and (r * set_bytes >= 2 * l2 or r == 64 or r == 2)


class FakeTimer:
    """Returns preset per-call times: each thing's time is a label lookup, with a little spread."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []

    def __call__(self, fns, warmup, iters):
        label = fns[0]()
        self.calls.append((label, warmup, iters))
        base = {
            "floor": 2.0,
            "copy": 1000.0,
            "peak": 1600.0,
            "fp16": 12.0,
            "int8": 10.0,
            "fp8": 8.0,
            "gemv": 4.0,
            "dequant+cublas": 20.0,
            "tinygemm": 6.0,
        }[label]
        return [base * (1 + 0.01 * ((i % 5) - 2)) for i in range(iters)]


class FakeCases:
    def device_info(self):
        return {"name": "FakeGPU", "sms": 1, "l2_mb": 50.0}

    def copy_variants(self):
        # 3 GB in 1000 us -> 3 TB/s; the slower variant must not set the ceiling
        return [("memcpy", [lambda: "copy"], 2_000_000_000), ("elementwise", [lambda: "copy"], 3_000_000_000)]

    def matmul_peak(self):
        return [lambda: "peak"], 1_120_000_000_000  # 1.12 TFLOP in 1600 us -> 700 TFLOP/s

    def launch_floor(self):
        return [lambda: "floor"]

    def paths(self, k, n, m, bits, group_size):
        return (["gemv", "dequant+cublas"], "gemv") if m <= 64 else (["dequant+cublas"], "dequant+cublas")

    def quant(self, k, n, m, bits, group_size, symmetric, path):
        return [lambda: path]

    def fp16(self, k, n, m):
        return [lambda: "fp16"]

    def int8(self, k, n, m):
        return [lambda: "int8"], max(m, 32)

    def fp8(self, k, n, m):
        if m == 2048:
            raise RuntimeError("no fp8 here\nsecond line")
        return [lambda: "fp8"], (m + 15) // 16 * 16

    def tinygemm(self, k, n, m, group_size):
        return [lambda: "tinygemm"], m


def _report():
    cfg = kb.KernelBenchConfig(
        shapes=[(4096, 4096)], ms=[1, 2048], bits=[4], group_sizes=[128], warmup=3, iters=50
    )
    timer = FakeTimer()
    return kb.run_kernel_bench(cfg, FakeCases(), timer), timer


def test_kernel_bench_report_with_fake_timer(tmp_path):
    report, timer = _report()
    assert stats.validate_kernels_report(report) == []
    assert all(iters >= 50 or label == "peak" for label, _, iters in timer.calls)
    c = report["ceilings"]
    assert c["launch_floor_us"] == pytest.approx(2.0, rel=0.02)
    assert c["copy_method"] == "elementwise" and c["copy_variants"]["memcpy"]["tbps"] == pytest.approx(2.0)
    assert c["copy_tbps"] == pytest.approx(3.0) and c["fp16_tflops"] == pytest.approx(700.0, rel=0.02)
    r1, r2048 = report["results"]
    assert r1["path"] == "gemv" and r1["best_path"] == "gemv"
    assert r1["quant"]["median_us"] == pytest.approx(4.0)
    assert r1["speedup"]["fp16"] == pytest.approx(3.0) and r1["speedup"]["fp8"] == pytest.approx(2.0)
    assert r1["baselines"]["int8"]["m_eff"] == 32 and r1["baselines"]["fp8"]["m_eff"] == 16
    assert r1["roofline"]["tbps"] == pytest.approx(
        stats.quant_bytes(1, 4096, 4096, 4, 128, True) / 4e-6 / 1e12
    )
    assert r2048["path"] == "dequant+cublas" and r2048["baselines"]["fp8"] is None
    assert r2048["baseline_errors"]["fp8"] == "RuntimeError: no fp8 here"
    assert r2048["speedup"]["fp8"] is None
    # JSON round trip keeps the schema valid.
    path = tmp_path / "r.json"
    kb.write_json(report, str(path))
    again = json.loads(path.read_text())
    assert stats.validate_kernels_report(again) == []
    text = kb.format_report(report)
    assert "FakeGPU" in text and "gemv" in text and "3.00" in text


class SlowerFirstFp16Timer(FakeTimer):
    """cuBLAS FP16 at 12 us on its first timing and 10 us on its second (a baseline that moves between runs)."""

    def __call__(self, fns, warmup, iters):
        times = super().__call__(fns, warmup, iters)
        if self.calls[-1][0] == "fp16" and sum(c[0] == "fp16" for c in self.calls) % 2 == 0:
            return [t * 10.0 / 12.0 for t in times]
        return times


def test_kernel_bench_divides_by_the_faster_of_two_fp16_timings():
    cfg = kb.KernelBenchConfig(
        shapes=[(4096, 4096)], ms=[1, 16], bits=[4], group_sizes=[128], warmup=3, iters=50
    )
    timer = SlowerFirstFp16Timer()
    report = kb.run_kernel_bench(cfg, FakeCases(), timer)
    assert stats.validate_kernels_report(report) == []
    labels = [label for label, _, _ in timer.calls]
    # per (shape, M): FP16 first, then INT8/FP8 and our paths, then FP16 again
    assert labels.count("fp16") == 4 and labels[-1] == "fp16"
    for r in report["results"]:
        fp16 = r["baselines"]["fp16"]
        assert fp16["runs_us"] == [pytest.approx(12.0), pytest.approx(10.0)]
        assert fp16["median_us"] == pytest.approx(10.0)
        assert r["speedup"]["fp16"] == pytest.approx(10.0 / 4.0)


def test_schema_validation_catches_problems():
    report, _ = _report()
    bad = json.loads(json.dumps(report))
    bad["schema"] = "other"
    del bad["results"][0]["quant"]
    bad["ceilings"]["copy_tbps"] = 0
    errs = stats.validate_kernels_report(bad)
    assert any(e.startswith("schema:") for e in errs)
    assert any("results[0].quant" in e for e in errs)
    assert any("ceilings.copy_tbps" in e for e in errs)


def test_cli_without_gpu_is_one_line(monkeypatch):
    import torch

    from qtool.bench.command import bench

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    res = CliRunner().invoke(bench, ["kernels", "--shapes", "64x64", "--m", "1"])
    assert res.exit_code != 0
    assert res.output.strip().count("\n") == 0 and "no CUDA GPU" in res.output
    res = CliRunner().invoke(bench, ["kernels", "--shapes", "64by64"])
    assert res.exit_code != 0 and "--shapes: found '64by64'" in res.output


def test_e2e_decoder_runs_on_cpu_with_static_cache():
    """The bench's decoder (same code the GPU e2e captures in CUDA graphs): prefill fills the static cache at
    the given positions; a decode step reads it through the mask and returns one token per sequence."""
    import torch

    from qtool.bench.e2e import Decoder, dims_for, fp16_linear

    d = dims_for("tiny")
    dev = torch.device("cpu")
    torch.manual_seed(0)
    model = Decoder(d, fp16_linear(dev), dev)
    tables = model.rope_tables(64, dev)

    def caches(b, length):
        shape = (b, d.kv_heads, length, d.head_dim)
        return [
            (torch.zeros(shape, dtype=torch.float16), torch.zeros(shape, dtype=torch.float16))
            for _ in range(d.layers)
        ]

    cache = caches(1, 16)
    out = model(torch.randint(0, d.vocab, (1, 16)), torch.arange(16), cache, tables, decode=False)
    assert out.shape == (1,) and 0 <= int(out) < d.vocab
    assert all(bool(k.abs().sum() > 0) for k, _ in cache)
    cache = caches(3, 32)
    out = model(torch.randint(0, d.vocab, (3, 1)), torch.tensor([7]), cache, tables, decode=True)
    assert out.shape == (3,)
    assert bool(cache[0][0][:, :, 7].abs().sum() > 0) and not bool(cache[0][0][:, :, 8:].abs().sum() > 0)
    with pytest.raises(ValueError, match="--model-config: found 'nope'"):
        dims_for("nope")
