"""Stage `progressive` through the CLI: recipe errors before any weight loads, and stories260K end to end
(quantize → `qoq` checkpoint → load → perplexity), W4 progressive with GPTQ and W8A8 with RTN.

stories260K protocol (kept small for CPU): calibration 16 random 256-token windows of the 2 MiB TinyStories head
(seed 0); perplexity on its first 16 windows of 256 tokens, BOS per story (split at <|endoftext|>). Its widths are
64 (hidden) and 172 (FFN), so the progressive groups are 4 columns wide.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from qtool.checkpoint.loader import read_config
from qtool.checkpoint.manifest import file_sha256

from conftest import STORIES, TINYSTORIES, write_recipe

RECIPE = """
model: {model}
calibration:
  source: {text}
  num_samples: 16
  seq_len: 256
  seed: 0
stages:
  - stage: progressive
    bits: {bits}
    group_size: {group_size}
    solver: {solver}
    sequential: false
    targets: {{exclude: {exclude}}}
eval:
  text: {text}
  seq_len: 256
  max_windows: 16
  separator: "<|endoftext|>"
output: {out}
"""


def recipe_text(
    out: Path, *, bits: int = 4, group_size: int | str = 4, solver: str = "gptq", exclude: str = "[]"
) -> str:
    return RECIPE.format(
        model=STORIES,
        text=TINYSTORIES,
        bits=bits,
        group_size=group_size,
        solver=solver,
        exclude=exclude,
        out=out,
    )


def _one_line_error(res, code: int) -> str:
    assert res.exit_code == code, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("qtool: error: "), res.output
    return lines[0]


# ---- recipe errors ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,fragments",
    [
        (
            {"group_size": 32},
            [
                "stages[0].group_size: found 32",
                "model.layers.0.mlp.down_proj has in_features 172",
                "expected a divisor",
            ],
        ),
        ({"group_size": 8, "exclude": '["*.q_proj"]'}, ["model.layers.0.mlp.down_proj has in_features 172"]),
        ({"bits": 8}, ["stages[0].group_size: found 4 with bits 8", "expected null"]),
        ({"bits": 6}, ["stages[0].bits: found 6", "one of 4, 8"]),
        ({"solver": "awq"}, ["stages[0].solver: found 'awq'", "one of 'rtn', 'gptq'"]),
        ({"group_size": 0}, ["stages[0].group_size: found 0"]),
    ],
)
def test_recipe_errors_name_file_and_key(cli, tmp_path, kwargs, fragments):
    res = cli("quantize", write_recipe(tmp_path / "r.yaml", recipe_text(tmp_path / "o", **kwargs)))
    line = _one_line_error(res, 3)
    assert "r.yaml:" in line
    for f in fragments:
        assert f in line, (f, line)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "old,new,fragments",
    [
        ("solver: gptq", "solver: gptq\n    act_bits: 4", ["stages[0].act_bits: found 4", "one of 8"]),
        ("solver: gptq", "solver: gptq\n    clip_grid: 1", ["stages[0].clip_grid: found 1"]),
        ("solver: gptq", "solver: gptq\n    symmetric: true", ["stages[0].symmetric: unknown option"]),
        (
            "solver: gptq",
            "solver: gptq\n    act_order: true",
            ["stages[0].static_groups: found false with act_order", "expected true"],
        ),
    ],
)
def test_bad_option_values(cli, tmp_path, old, new, fragments):
    text = recipe_text(tmp_path / "o").replace(old, new, 1)
    line = _one_line_error(cli("quantize", write_recipe(tmp_path / "r.yaml", text)), 3)
    for f in fragments:
        assert f in line, (f, line)


def test_group_check_passes_when_the_narrow_linears_are_excluded(tmp_path):
    from qtool.models.loading import load_config
    from qtool.recipe import load_recipe

    config = load_config(str(STORIES))
    ok = load_recipe(
        write_recipe(
            tmp_path / "a.yaml", recipe_text(tmp_path / "o", group_size=32, exclude='["*.down_proj"]')
        )
    )
    ok.stages[0].stage.check_config(config, "a.yaml:stages[0]")  # 64 is a multiple of 32: no error
    per_channel = load_recipe(
        write_recipe(tmp_path / "b.yaml", recipe_text(tmp_path / "o", group_size="null"))
    )
    per_channel.stages[0].stage.check_config(config, "b.yaml:stages[0]")


# ---- stories260K ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stories(tmp_path_factory):
    """W4 g4 GPTQ through `qtool quantize` (with both perplexities); W8A8 RTN in process, the quantized model's
    perplexity only (it needs no calibration, and the original's is the same as the first run's)."""
    from click.testing import CliRunner

    from qtool.cli import cli as group
    from qtool.console import Reporter
    from qtool.eval.perplexity import perplexity
    from qtool.pipeline import quantize_model
    from qtool.recipe import load_recipe

    tmp = tmp_path_factory.mktemp("qoq-stories")
    recipe = write_recipe(tmp / "w4.yaml", recipe_text(tmp / "w4g4-gptq"))
    res = CliRunner().invoke(group, ["quantize", str(recipe), "--json"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    w8 = load_recipe(
        write_recipe(tmp / "w8.yaml", recipe_text(tmp / "w8", bits=8, group_size="null", solver="rtn"))
    )
    quiet = Reporter(quiet=True)
    qm = quantize_model(w8, quiet)
    with torch.no_grad():
        w8_ppl = perplexity(qm.model, qm.tokenizer, w8.eval, torch.device("cpu"), quiet)["perplexity"]
    return tmp, summary, qm, w8_ppl


@pytest.mark.slow
@pytest.mark.skipif(not STORIES.is_dir(), reason="stories260K assets not found")
def test_stories260k_checkpoint_loads_and_matches_the_in_memory_perplexity(cli, stories):
    import qtool
    from qtool.layouts.qoq.module import QoQLinear

    tmp, summary, w8_model, w8 = stories
    ev = summary["eval"]
    fp, w4 = ev["original"]["perplexity"], ev["quantized"]["perplexity"]
    assert 3.5 < fp < 5.0
    assert fp < w4 < 1.10 * fp
    assert w8 < 1.03 * fp
    assert {(m.bits, m.group_size) for m in w8_model.model.modules() if isinstance(m, QoQLinear)} == {
        (8, None)
    }

    ckpt = tmp / "w4g4-gptq"
    res = cli(
        "eval",
        ckpt,
        "--text",
        TINYSTORIES,
        "--seq-len",
        "256",
        "--windows",
        "16",
        "--separator",
        "<|endoftext|>",
        "--json",
    )
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["perplexity"] == pytest.approx(w4, rel=1e-5)

    layers = read_config(ckpt)["quantization_config"]["layers"]
    assert len(layers) == 5 * 7
    assert layers["model.layers.0.mlp.down_proj"] == {
        "format": "qoq",
        "bits": 4,
        "act_bits": 8,
        "group_size": 4,
        "in_features": 172,
        "out_features": 64,
        "bias": False,
    }
    model = qtool.load(ckpt)
    down = model.get_submodule("model.layers.0.mlp.down_proj")
    assert isinstance(down, QoQLinear) and down.group_scales.shape == (64, 43)
    assert int(down.group_scales.max()) <= 16 and int(down.zeros.max()) <= 15
    res = cli("pack", ckpt, "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["layouts"] == {"qoq w4 g4 a8": 35}


@pytest.mark.slow
@pytest.mark.skipif(not STORIES.is_dir(), reason="stories260K assets not found")
def test_broken_checkpoint_tensor_is_one_line(cli, stories, tmp_path):
    src = stories[0]
    ckpt = tmp_path / "broken"
    shutil.copytree(src / "w4g4-gptq", ckpt)
    layer = "model.layers.2.self_attn.v_proj"
    t = load_file(str(ckpt / "model.safetensors"))
    t[f"{layer}.group_scales"] = torch.zeros_like(t[f"{layer}.group_scales"])
    save_file(t, str(ckpt / "model.safetensors"))
    m = json.loads((ckpt / "qtool-manifest.json").read_text())
    m["files"]["model.safetensors"] = file_sha256(ckpt / "model.safetensors")
    m["sizes"]["model.safetensors"] = (ckpt / "model.safetensors").stat().st_size
    (ckpt / "qtool-manifest.json").write_text(json.dumps(m))
    res = cli("eval", ckpt, "--text", TINYSTORIES, "--seq-len", "32", "--windows", "1", "--quiet")
    line = _one_line_error(res, 5)
    assert f"tensor {layer}.group_scales: found values in [0, 0], expected integers in 1..16" in line
