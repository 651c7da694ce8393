"""Every `qtool bench` subcommand on the GPU at its smallest config, with `--plot`, `--json-out` and `--json`; and
torchao's int4 kernel (the bench's peer) against its dequantized reference through the CUDA operators."""

from __future__ import annotations

import json

import pytest
import torch

from tests.gpu.helpers import gpu_ready
from tests.test_bench_plot import assert_png

from bad_input import run_cli

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(gpu_ready() is not None, reason=str(gpu_ready()))]


@pytest.mark.parametrize(
    "name, args, check",
    [
        (
            "kernels",
            ["kernels", "--shapes", "4096x4096", "--m", "1,16", "--w4a8", "none-rows", "--iters", "50"],
            lambda r: r["results"][0]["baselines"]["tinygemm"]["median_us"] > 0,
        ),
        (
            "quik",
            [
                "quik",
                "--shapes",
                "1024x1024",
                "--m",
                "64",
                "--outliers",
                "0,128",
                "--ladder-outliers",
                "128",
                "--iters",
                "50",
            ],
            lambda r: r["results"][0]["baselines"]["tinygemm"]["median_us"] > 0,
        ),
        (
            "e2e",
            ["e2e", "--model-config", "tiny", "--prompt", "64", "--batches", "1,4", "--iters", "10"],
            lambda r: r["speedups"]["torchao-int4"]["decode_b1"] > 0,
        ),
        (
            "throughput",
            [
                "e2e",
                "--throughput",
                "--model-config",
                "tiny",
                "--prompt",
                "32",
                "--new-tokens",
                "8",
                "--batches",
                "4",
                "--iters",
                "10",
            ],
            # the default variants: both FP8 rows, and the ratios to the better one at the batch
            lambda r: (
                set(r["best"]) == {"fp16", "fp8", "fp8-sdpa", "w4a16", "w4a8kv4"}
                and r["runs"]["fp8-sdpa"]["attention"] == "torch SDPA (FP16 cache)"
                and r["speedup_vs_best_fp8_at_batch"]["w4a8kv4"]["4"] > 0
            ),
        ),
        (
            "attention",
            ["attention", "--model-config", "tiny", "--batches", "1", "--contexts", "256", "--iters", "10"],
            lambda r: r["results"][0]["rows"]["fp16-sdpa"]["median_us"] > 0,
        ),
    ],
)
def test_bench_subcommand_writes_plot_and_json(tmp_path, monkeypatch, name, args, check):
    from qtool.bench import e2e

    # the tiny decoder with an MLP width torchao's int4 kernel takes (a multiple of 128)
    monkeypatch.setitem(e2e.MODEL_DIMS, "tiny", e2e.Dims(256, 768, 2, 4, 2, 1000))
    png, out = tmp_path / f"{name}.png", tmp_path / f"{name}.json"
    res = run_cli(["bench", *args, "--plot", png, "--json-out", out, "--json"])
    assert res.exit_code == 0, res.output
    assert_png(png)
    report = json.loads(out.read_text())
    assert json.loads(res.stdout)["schema"] == report["schema"]
    assert check(report), report


@pytest.mark.parametrize(
    "dims",
    [
        dict(head_dim=128, qk_norm=True),
        dict(head_dim=128, qk_norm=True, experts=4, top_k=2),
        dict(experts=4, top_k=2),
        # head_dim 128, not Gemma's 256, which the FP8 and CQ-2 caches do not take
        dict(
            head_dim=128,
            geglu=True,
            post_norms=True,
            embed_scale=True,
            final_softcap=30.0,
            tie_embeddings=True,
            attn_softcap=50.0,
            sliding_window=4096,
        ),
    ],
    ids=["qwen3", "qwen3-moe", "mixtral", "gemma2"],
)
def test_bench_family_shapes_run_every_format(tmp_path, monkeypatch, dims):
    """The q/k norms ahead of the rotary and quantized-cache writes, head_dim apart from hidden / heads, expert
    blocks (run eagerly) and Gemma's GeGLU and branch norms (captured) through every e2e and --throughput
    format."""
    from qtool.bench import e2e

    shape = e2e.Dims(256, 256, 2, 4, 2, 1000, **dims)
    monkeypatch.setitem(e2e.MODEL_DIMS, "tiny", shape)
    out = tmp_path / "e.json"
    args = ["e2e", "--model-config", "tiny", "--prompt", "64", "--batches", "1,4", "--iters", "10"]
    res = run_cli(["bench", *args, "--mixed", "0", "--json-out", out])
    assert res.exit_code == 0, res.output
    report = json.loads(out.read_text())
    assert report["cuda_graphs"] is not bool(shape.experts) and report["dims"]["head_dim"] == shape.head_dim
    assert all(sp["decode_b4"] > 0 for sp in report["speedups"].values()) and len(report["speedups"]) == 3
    variants = "fp16,fp8,fp8-sdpa,w4a16,w4a8kv4,w4a8cq2"
    args = ["e2e", "--throughput", "--model-config", "tiny", "--prompt", "32", "--new-tokens", "8"]
    res = run_cli(
        ["bench", *args, "--batches", "4", "--iters", "10", "--variants", variants, "--json-out", out]
    )
    assert res.exit_code == 0, res.output
    report = json.loads(out.read_text())
    assert set(report["best"]) == set(variants.split(","))


def test_bench_e2e_vq_runs(tmp_path, monkeypatch):
    """`bench e2e --vq`: a run per preset on random VQ linears, the decode GEMV and the prefill GEMM captured in the
    step, with its row in every part of the report."""
    from qtool.bench import e2e

    # an MLP width that 256-column codebook tiles and the GEMM's 64-column stages divide
    monkeypatch.setitem(e2e.MODEL_DIMS, "tiny", e2e.Dims(256, 768, 2, 4, 2, 1000))
    png, out = tmp_path / "vq.png", tmp_path / "vq.json"
    args = ["e2e", "--model-config", "tiny", "--prompt", "64", "--batches", "1,4", "--iters", "10"]
    res = run_cli(
        ["bench", *args, "--no-torchao", "--vq", "gptvq-2,aqlm-3", "--plot", png, "--json-out", out]
    )
    assert res.exit_code == 0, res.output
    assert_png(png)
    report = json.loads(out.read_text())
    for preset in ("gptvq-2", "aqlm-3"):
        run = report["runs"][preset]
        assert run["prefill"]["tokens_per_s"] > 0 and run["decode"]["4"]["tokens_per_s"] > 0
        assert 0 < run["weight_bytes"] < report["runs"]["fp16"]["weight_bytes"]
        assert report["speedups"][preset]["decode_b1"] > 0
        assert f"{preset} / fp16" in res.output


@pytest.mark.parametrize("k, n, m, group_size", [(4096, 4096, 1, 128), (1024, 512, 64, 32), (256, 8, 3, 256)])
def test_torchao_int4_matches_its_dequantized_reference_on_cuda(k, n, m, group_size):
    from qtool.bench import tinygemm as tg

    dev = torch.device("cuda")
    assert tg.available(dev) is None
    gen = torch.Generator(device=dev).manual_seed(k + n + m)
    codes, scales, zeros = tg.random_layer(k, n, group_size, dev, gen)
    p = tg.pack(codes, scales, zeros, group_size)
    x = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
    assert tg.check(p, codes, scales, zeros, x) < 5e-3
    with pytest.raises(ValueError, match="differs from the dequantized reference"):
        tg.check(tg.pack(codes ^ 1, scales, zeros, group_size), codes, scales, zeros, x)
