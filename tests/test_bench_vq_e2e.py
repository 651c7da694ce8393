"""`qtool bench e2e --vq` without a GPU: the presets option and its refusals, the random VQ linears' builder on the
CPU (a layer a checkpoint load accepts, whose module's reference forward is its dequantized weight's product), and
the VQ runs in the printed report."""

from __future__ import annotations

import pytest
import torch

import qtool.bench.command as command
from qtool.bench import e2e, stats
from qtool.bench.command import _vq_presets
from qtool.stages.vq import PRESETS
from tests.test_bench_plot import _e2e_report

from bad_input import assert_one_line_error, run_cli


def test_vq_presets_option():
    assert _vq_presets("gptvq-2, AQLM-3,gptvq-2") == ["gptvq-2", "aqlm-3"]
    assert _vq_presets("none-rows") == [] and _vq_presets("") == []
    with pytest.raises(stats.BenchError, match="--vq: found 'gptvq-9'"):
        _vq_presets("gptvq-9")


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_presets_fit_the_llama_shapes(preset):
    for name in ("llama-2-7b", "llama-3-8b", "mistral-7b"):
        assert e2e.vq_problem(preset, e2e.dims_for(name), 2048) is None, name


def test_vq_problem_names_the_linear_and_what_was_expected():
    tiny = e2e.dims_for("tiny")  # MLP width 688: no multiple of 256, nor of the GEMM's 64 columns
    problem = e2e.vq_problem("gptvq-2", tiny, 1)
    assert (
        "gate_up projection (256 -> 1376): out_features 1376, expected a multiple of tile_rows 256" in problem
    )
    wide = e2e.replace(tiny, intermediate=640)  # 2 x 640 rows: whole row tiles, but 640 columns are not
    assert "down projection (640 -> 256): in_features 640, expected a multiple of tile_cols 256" in (
        e2e.vq_problem("gptvq-2", wide, 1)
    )
    # the decode GEMV takes it; only a step over 16 rows needs the GEMM
    assert e2e.vq_problem("aqlm-3", tiny, 16) is None
    assert "in_features 688 (the GEMM needs a multiple of 64)" in e2e.vq_problem("aqlm-3", tiny, 17)


def test_e2e_vq_option_reaches_the_run_and_refuses_bad_presets(monkeypatch):
    monkeypatch.setattr(command, "_need_gpu", lambda: None)
    seen = {}

    def fake(*a, **k):
        seen.update(k)
        return _e2e_report(False)

    monkeypatch.setattr("qtool.bench.e2e.run_e2e", fake)
    small = ["bench", "e2e", "--model-config", "tiny", "--prompt", "8", "--batches", "1,4"]
    res = run_cli([*small, "--vq", "aqlm-3"])
    assert res.exit_code == 0, res.output
    assert seen["vq"] == ("aqlm-3",)
    res = run_cli(["bench", "e2e", "--model-config", "llama-2-7b", "--vq", "gptvq-2,aqlm-3"])
    assert res.exit_code == 0 and seen["vq"] == ("gptvq-2", "aqlm-3")
    res = run_cli(["bench", "e2e", "--model-config", "tiny"])
    assert res.exit_code == 0 and seen["vq"] == ()
    seen.clear()
    assert_one_line_error(run_cli([*small, "--vq", "vq-4"]), 2, "--vq: found 'vq-4'", "gptvq-2, aqlm-3")
    assert_one_line_error(
        run_cli([*small, "--vq", "gptvq-2"]),
        2,
        "--vq: gptvq-2 does not fit tiny's linears",
        "out_features 1376, expected a multiple of tile_rows 256",
    )
    # the default 2048-token prompt runs through the fused GEMM, which needs K a multiple of 64
    assert_one_line_error(
        run_cli(["bench", "e2e", "--model-config", "tiny", "--vq", "aqlm-3"]),
        2,
        "--vq: aqlm-3 does not fit tiny's linears",
        "multiple of 64",
    )
    assert not seen


@pytest.mark.parametrize("preset, k, n", [("gptvq-2", 512, 768), ("aqlm-3", 256, 512)])
def test_random_vq_weight_on_cpu(preset, k, n):
    from qtool.bench.cuda_cases import random_vq_weight
    from qtool.layouts.vq.layout import VQWeight
    from qtool.layouts.vq.module import VQLinear

    gen = torch.Generator().manual_seed(0)
    w = random_vq_weight(k, n, preset, torch.device("cpu"), gen)
    c = PRESETS[preset]
    assert (w.vector_size, w.entries, w.residuals, w.tile_rows, w.tile_cols) == (
        c["vector_size"],
        c["entries"],
        c["residuals"],
        c["tile_rows"],
        c["tile_cols"],
    )
    # re-indexed entries in descending order of use and the tier boundaries their counts give
    VQWeight.from_tensors("layer", w.config(), {f: getattr(w, f) for f in w.FIELDS})
    assert int(w.entry_tiers[..., 0].max()) > 0
    lin = VQLinear(w)
    dense = w.dequantize(torch.float32)
    for m in (3, 20):  # the lookup GEMV's reference and the dense one
        x = torch.randn(m, k, generator=gen)
        torch.testing.assert_close(lin(x), x @ dense.T, rtol=1e-5, atol=1e-5)


def test_vq_runs_in_the_printed_report_and_plot():
    r = _e2e_report(False)
    r["runs"]["gptvq-2"] = r["runs"]["w4a16"]
    r["speedups"]["gptvq-2"] = {"prefill": 0.9, "decode_b1": 3.5, "decode_b16": 1.25}
    r["vq_presets"] = ["gptvq-2"]
    text = e2e.format_e2e(r)
    lines = text.splitlines()
    assert any(ln.split()[:1] == ["gptvq-2"] for ln in lines), text
    assert any(ln.split()[:5] == ["gptvq-2", "/", "fp16", "0.90", "3.50"] for ln in lines), text
    assert "gptvq-2: VQ<4,8,1> per 256x256 tile (2 index bits per weight)" in text
    assert e2e.figure(r).panels[0].series["gptvq-2"] == [0.9, 3.5, 1.25]
