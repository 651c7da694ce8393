"""Every `qtool bench` subcommand on CPU: `--plot` writes a valid PNG, `--json-out` the report, `--json` prints it,
and the tables come out as plain text off a terminal. The kernels and quik benches run their own measuring code
on fake cases and a fake timer; e2e, its throughput mode and attention (whose measuring needs CUDA graphs) are
given reports of their schema. Also torchao's int4 kernel (the peer) against its dequantized reference on CPU."""

from __future__ import annotations

import json
import re

import pytest
import torch

import qtool.bench.command as command
from qtool.bench import kernels as kb
from qtool.bench import tinygemm as tg
from tests.test_bench_quik import FakeCases as QuikFakeCases
from tests.test_bench_quik import FakeTimer as QuikFakeTimer
from tests.test_bench_stats import FakeCases, FakeTimer

from bad_input import assert_one_line_error, run_cli

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def assert_png(path) -> None:
    from PIL import Image

    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, data[:8]
    with Image.open(path) as im:
        im.verify()
    with Image.open(path) as im:
        assert im.format == "PNG" and im.size[0] >= 600 and im.size[1] >= 400, im.size
    assert not [p for p in path.parent.iterdir() if p.name.startswith(f".{path.name}.tmp-")]


@pytest.fixture
def no_gpu_needed(monkeypatch):
    monkeypatch.setattr(command, "_need_gpu", lambda: None)


def test_kernels_plot_json_and_table(tmp_path, monkeypatch, no_gpu_needed):
    monkeypatch.setattr("qtool.bench.cuda_cases.CudaCases", FakeCases)
    monkeypatch.setattr("qtool.bench.timing.CudaTimer", FakeTimer)
    args = [
        "bench",
        "kernels",
        "--shapes",
        "4096x4096,4096x11008",
        "--m",
        "1,16",
        "--w4a8",
        "none-rows",
        "--mixed",
        "none-rows",
        "--vq",
        "none-rows",
        "--warmup",
        "1",
        "--iters",
        "50",
    ]
    res = run_cli([*args, "--plot", tmp_path / "k.png", "--json-out", tmp_path / "sub" / "k.json"])
    assert res.exit_code == 0, res.output
    assert_png(tmp_path / "k.png")
    report = json.loads((tmp_path / "sub" / "k.json").read_text())
    assert report["config"]["tinygemm_group_size"] == 128
    r = report["results"][0]
    # fake times: FP16 12 us, torchao int4 6 us, ours (gemv) 4 us
    assert r["baselines"]["tinygemm"]["group_size"] == 128
    assert r["speedup"]["tinygemm"] == pytest.approx(1.5) and r["speedup"]["fp16"] == pytest.approx(3.0)
    lines = res.stdout.splitlines()
    assert any("torchao int4 g128" in ln for ln in lines)
    row = next(ln for ln in lines if re.match(r"^ *4096x4096 +1 +W4 g128 +gemv ", ln))
    assert re.search(r" 3\.00 +2\.50 +2\.00 +1\.50 ", row), row
    assert "\x1b[" not in res.stdout  # no terminal styles in a pipe
    # the figure: one panel per shape, ours and the three peers against M
    fig = kb.figure(report)
    assert [p.title for p in fig.panels] == ["KxN 4096x4096", "KxN 4096x11008"]
    assert fig.panels[0].series["W4 g128"] == [pytest.approx(3.0), pytest.approx(3.0)]
    assert fig.panels[0].series["torchao int4 g128"] == [pytest.approx(2.0), pytest.approx(2.0)]
    # --json: the report on stdout, nothing else there
    res = run_cli([*args, "--json", "--torchao", "none-rows"])
    assert res.exit_code == 0, res.output
    again = json.loads(res.stdout)
    assert again["schema"] == report["schema"] and "tinygemm" not in again["results"][0]["baselines"]


def test_quik_plot_and_table(tmp_path, monkeypatch, no_gpu_needed):
    monkeypatch.setattr("qtool.bench.cuda_cases.QuikCudaCases", QuikFakeCases)
    monkeypatch.setattr("qtool.bench.timing.CudaTimer", QuikFakeTimer)
    res = run_cli(
        [
            "bench",
            "quik",
            "--shapes",
            "4096x4096,4096x11008",
            "--warmup",
            "1",
            "--iters",
            "50",
            "--plot",
            tmp_path / "q.png",
            "--json-out",
            tmp_path / "q.json",
        ]
    )
    assert res.exit_code == 0, res.output
    assert_png(tmp_path / "q.png")
    report = json.loads((tmp_path / "q.json").read_text())
    assert report["results"][0]["w4a4_ladder"]["fused"]["speedup"]["tinygemm"] == pytest.approx(125.0 / 55.0)
    assert "torchao int4 125.0 us" in res.stdout
    assert re.search(r"^ *w4a4 fused k=256 +55\.0 .* 2\.27 +\+10\.0%$", res.stdout, re.M), res.stdout


def _e2e_report(torchao: bool) -> dict:
    def run(prefill, decode):
        return {
            "prefill": {"tokens": 2048, "us": 1.0, "tokens_per_s": prefill, "capture_s": 0.1},
            "decode": {
                str(b): {"batch": b, "us_per_step": 1.0, "tokens_per_s": t, "kv_cache_bytes_read": 1}
                for b, t in zip((1, 16), decode, strict=True)
            },
            "weight_bytes": 2**30,
            "peak_memory_bytes": 2**31,
        }

    runs = {"fp16": run(1000.0, (100.0, 1000.0)), "w4a16": run(1100.0, (280.0, 1500.0))}
    if torchao:
        runs["torchao-int4"] = run(500.0, (250.0, 1200.0))
    speedups = {
        k: {
            "prefill": v["prefill"]["tokens_per_s"] / 1000.0,
            "decode_b1": v["decode"]["1"]["tokens_per_s"] / 100.0,
            "decode_b16": v["decode"]["16"]["tokens_per_s"] / 1000.0,
        }
        for k, v in runs.items()
        if k != "fp16"
    }
    return {
        "schema": "qtool.bench.e2e/1",
        "model": "tiny",
        "bits": 4,
        "group_size": 128,
        "prompt_tokens": 2048,
        "decode_context": 128,
        "attention": "torch SDPA (FP16 cache)",
        "decode_span": 65,
        "batches": [1, 16],
        "device": "FakeGPU",
        "runs": runs,
        "speedups": speedups,
        "speedup": speedups["w4a16"],
        **({} if torchao else {"torchao_skipped": "no int4 here"}),
    }


def throughput_run(tps: dict[int, float | None], attention: str) -> dict:
    """One format's run in a throughput report: generated tokens/s per batch (None: the batch did not fit), the
    largest batch that fits being the largest with a rate."""
    largest = max(b for b, t in tps.items() if t)
    return {
        "decode": {
            str(b): (
                {"batch": b, "fits": True, "tokens_per_s": t, "largest": b == largest}
                if t
                else {"batch": b, "fits": False}
            )
            for b, t in tps.items()
        },
        "largest_batch": largest,
        "weight_bytes": 2**30,
        "attention": attention,
    }


def _throughput_report() -> dict:
    from qtool.bench import throughput

    sdpa = throughput.SDPA_ATTENTION
    runs = {
        "fp16": throughput_run({16: 1000.0, 64: None}, sdpa),
        "fp8": throughput_run({16: 1200.0, 64: None}, "qtool FP8-cache kernel (CUDA cores)"),
        "fp8-sdpa": throughput_run({16: 1300.0, 64: 2000.0}, sdpa),
        "w4a16": throughput_run({16: 1500.0, 64: 4000.0}, sdpa),
    }
    return {
        "schema": "qtool.bench.throughput/1",
        "model": "tiny",
        "prompt_tokens": 1024,
        "new_tokens": 512,
        "device": "FakeGPU",
        "runs": runs,
        **throughput.ratios(runs),
    }


def _attention_report() -> dict:
    def row(us):
        return {"median_us": us, "tbps": 1.5, "bytes": 1, "sets": 1, "speedup_vs_sdpa": 20.0 / us}

    return {
        "schema": "qtool.bench.attention/1",
        "model": "tiny",
        "heads": 4,
        "kv_heads": 2,
        "head_dim": 64,
        "device": "FakeGPU",
        "sdpa_backend": "flash",
        "results": [
            {
                "batch": b,
                "context": 1024,
                "rows": {"fp16-sdpa": row(20.0), "fp8": row(10.0), "int4": row(5.0)},
            }
            for b in (1, 16)
        ],
    }


@pytest.mark.parametrize(
    "name, args, target, report, words",
    [
        (
            "e2e",
            ["e2e", "--model-config", "tiny"],
            "qtool.bench.e2e.run_e2e",
            _e2e_report(True),
            [r"^ *torchao-int4 / fp16 +0\.50 +2\.50 +1\.20", "bfloat16 activations cast"],
        ),
        (
            "e2e-no-torchao",
            ["e2e", "--model-config", "tiny"],
            "qtool.bench.e2e.run_e2e",
            _e2e_report(False),
            [r"^ *w4a16 / fp16 +1\.10 +2\.80 +1\.50", "torchao-int4 not run: no int4 here"],
        ),
        (
            "throughput",
            ["e2e", "--throughput", "--model-config", "tiny", "--batches", "16,64"],
            "qtool.bench.throughput.run_throughput",
            _throughput_report(),
            [r"^ *w4a16 +torch SDPA \(FP16 cache\) +1500 +4000\* +64 +4000 +4\.00x +2\.00x"],
        ),
        (
            "attention",
            ["attention", "--model-config", "tiny", "--batches", "1,16"],
            "qtool.bench.attention.run_attention_bench",
            _attention_report(),
            [r"^ *1 +1024 +20\.0 \(1\.50\) 1\.00x"],
        ),
    ],
)
def test_subcommand_plot_and_table(tmp_path, monkeypatch, no_gpu_needed, name, args, target, report, words):
    monkeypatch.setattr(target, lambda *a, **k: report)
    png = tmp_path / f"{name}.png"
    res = run_cli(["bench", *args, "--plot", png])
    assert res.exit_code == 0, res.output
    assert_png(png)
    for w in words:
        assert re.search(w, res.stdout, re.M) or w in res.stdout, (w, res.stdout)
    res = run_cli(["bench", *args, "--json"])
    assert res.exit_code == 0 and json.loads(res.stdout) == report


@pytest.mark.parametrize(
    "args, code, words",
    [
        (["--plot", "{tmp}"], 2, ["is a directory; expected a file path"]),
        (
            ["--json-out", "{tmp}/r.json", "--plot", "{tmp}/file/k.png"],
            6,
            ["file' is a file; expected a directory"],
        ),
        (["--torchao", "100"], 2, ["--torchao: found '100'", "32, 64, 128, 256"]),
    ],
)
def test_bench_output_paths_refused_before_the_run(tmp_path, monkeypatch, no_gpu_needed, args, code, words):
    def never(*a, **k):
        raise AssertionError("the bench ran")

    monkeypatch.setattr(kb, "run_kernel_bench", never)
    (tmp_path / "file").write_text("x")
    args = [a.format(tmp=tmp_path) for a in args]
    res = run_cli(["bench", "kernels", "--shapes", "256x256", "--m", "1", *args])
    # nothing written, and the report reserved before the picture was refused is gone again
    assert_one_line_error(res, code, *words, output=[tmp_path / "r.json", tmp_path / "file" / "k.png"])


def test_bench_that_fails_mid_run_leaves_no_report(tmp_path, monkeypatch, no_gpu_needed):
    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(kb, "run_kernel_bench", boom)
    monkeypatch.setattr("qtool.bench.cuda_cases.CudaCases", FakeCases)
    res = run_cli(
        [
            "bench",
            "kernels",
            "--shapes",
            "256x256",
            "--json-out",
            tmp_path / "a" / "r.json",
            "--plot",
            tmp_path / "k.png",
        ]
    )
    assert_one_line_error(res, 130, "interrupted", output=[tmp_path / "a" / "r.json", tmp_path / "k.png"])
    assert not (tmp_path / "a").exists()


@pytest.mark.skipif(tg.available(torch.device("cpu")) is not None, reason="this torch has no CPU int4 kernel")
@pytest.mark.parametrize("group_size", [32, 128])
def test_torchao_int4_matches_its_dequantized_reference_on_cpu(group_size):
    gen = torch.Generator().manual_seed(group_size)
    codes, scales, zeros = tg.random_layer(256, 64, group_size, torch.device("cpu"), gen)
    p = tg.pack(codes, scales, zeros, group_size)
    x = torch.randn(3, 256, generator=gen).to(torch.bfloat16)
    assert tg.check(p, codes, scales, zeros, x) < 5e-3
    # the check is against the layer's own codes, scales and zeros: a layer packed from other codes, or whose
    # scales and zeros were swapped in packing, fails it
    with pytest.raises(ValueError, match="differs from the dequantized reference"):
        tg.check(tg.pack(codes ^ 1, scales, zeros, group_size), codes, scales, zeros, x)
    with pytest.raises(ValueError, match="differs from the dequantized reference"):
        tg.check(tg.pack(codes, zeros, scales, group_size), codes, scales, zeros, x)
    assert "group sizes" in tg.unsupported_reason(256, 64, 16) and "multiple of 128" in tg.unsupported_reason(
        192, 64, 64
    )
