"""`qtool calibrate` statistics against a direct computation, their reuse by `quantize --stats`, and CLI basics."""

from __future__ import annotations

import json

import torch

from conftest import TINY_SAMPLE, write_recipe


def test_calibrate_stats_match_direct_computation(cli, tiny_llama, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qtool.calibration.data import TextSource, sample_windows
    from qtool.calibration.stats import load_stats

    out = tmp_path / "stats.safetensors"
    res = cli(
        "calibrate",
        "--model",
        tiny_llama,
        "--calibration",
        TINY_SAMPLE,
        "--num-samples",
        "6",
        "--seq-len",
        "48",
        "--seed",
        "3",
        "--hessians",
        "--device",
        "cpu",
        "-o",
        out,
        "--json",
    )
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    stats, stamp = load_stats(out)
    assert (
        stamp["num_samples"] == 6
        and stamp["seq_len"] == 48
        and stamp["data_sha256"] == summary["data_sha256"]
    )
    assert len(stats) == 2 * 7

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    windows, digest = sample_windows(tok, TextSource(str(TINY_SAMPLE)), 6, 48, 3)
    assert digest == stamp["data_sha256"]
    seen = []
    h = model.model.layers[1].mlp.down_proj.register_forward_hook(
        lambda m, a, o: seen.append(a[0].reshape(-1, a[0].shape[-1]))
    )
    with torch.no_grad():
        for row in windows:
            model(row[None], use_cache=False)
    h.remove()
    x = torch.cat(seen).double()
    s = stats["model.layers.1.mlp.down_proj"]
    assert s.tokens == 6 * 48
    torch.testing.assert_close(s.absmax.double(), x.abs().amax(0), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(s.mean_sq.double(), (x**2).mean(0), rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(s.hessian().double(), 2 * x.T @ x / x.shape[0], rtol=1e-4, atol=1e-5)


def test_quantize_reuses_stats_for_rtn_clipping(cli, tiny_llama, tmp_path):
    stats = tmp_path / "stats.safetensors"
    assert (
        cli(
            "calibrate",
            "--model",
            tiny_llama,
            "--calibration",
            TINY_SAMPLE,
            "--num-samples",
            "4",
            "--seq-len",
            "32",
            "-o",
            stats,
            "-q",
        ).exit_code
        == 0
    )
    recipe = write_recipe(
        tmp_path / "r.yaml",
        f"""
model: {tiny_llama}
calibration: {{source: {TINY_SAMPLE}, num_samples: 4, seq_len: 32, stats: {stats}}}
stages:
  - stage: rtn
    bits: 3
    group_size: 32
    clip: true
output: ckpt
""",
    )
    res = cli("quantize", recipe, "--json")
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    assert summary["calibration"] is None  # no block-wise pass: the FP stats file served the clipping search
    assert summary["quantized_linears"] == 14


def test_help_explains_every_command(cli):
    for cmd in ("quantize", "calibrate", "eval", "pack", "bench"):
        res = cli(cmd, "--help")
        assert res.exit_code == 0 and len(res.output) > 200, cmd


def test_eval_reports_protocol(cli, tiny_llama):
    res = cli(
        "eval",
        tiny_llama,
        "--text",
        TINY_SAMPLE,
        "--seq-len",
        "64",
        "--windows",
        "3",
        "--device",
        "cpu",
        "--json",
    )
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["windows"] == 3 and out["scored_tokens"] == 3 * 63
    assert out["protocol"]["seq_len"] == 64 and out["protocol"]["stride"] == 64 and out["kind"] == "original"
    assert out["perplexity"] > 1
