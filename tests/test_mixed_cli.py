"""Stage `mixed` through the CLI: stories260K end to end (quantize → `mixed-2-4-16` checkpoint → `qtool eval` through
the loader), the manifest's bits per weight recomputed from the tensor files, and bad recipes refused in one line
(exit 3) before any model loads.

stories260K has widths 64 (hidden; 4 stripes of 16) and 172 (FFN, not a multiple of 16): down_proj is excluded,
and the second-order groups are 4 output rows (k/v_proj have 32)."""

from __future__ import annotations

import json
import math

import pytest
from safetensors.torch import load_file

from qtool.checkpoint.loader import read_config

from bad_input import assert_one_line_error, run_cli
from conftest import ROOT, SMOLLM2_CACHE, STORIES, TINY_SAMPLE, write_recipe

RECIPE = f"""
model: {STORIES}
calibration:
  source: {TINY_SAMPLE}
  num_samples: 2
  seq_len: 32
  seed: 0
stages:
  - stage: mixed
    scale_group_size: 4
    outlier_fraction: 0.005
    targets: {{exclude: ["*.down_proj"]}}
output: out
"""


def test_stories260k_quantize_eval_and_bits(tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", RECIPE)
    res = run_cli(["quantize", recipe, "--json"], cwd=tmp_path)
    assert res.exit_code == 0, res.output
    out = tmp_path / "out"
    manifest = json.loads((out / "qtool-manifest.json").read_text())
    bpw = manifest["bits_per_weight"]
    layers = read_config(out)["quantization_config"]["layers"]
    assert len(layers) == 5 * 6 and all(cfg["format"] == "mixed-2-4-16" for cfg in layers.values())
    assert not any(name.endswith("down_proj") for name in layers)

    # Bits per weight from the tensor files alone equal the manifest's, per layer and for the model.
    tensors = load_file(str(out / "model.safetensors"))
    total_bits = total_weights = 0
    for name, cfg in layers.items():
        bits = sum(
            t.numel() * t.element_size() * 8
            for key, t in tensors.items()
            if key.startswith(name + ".") and key != name + ".bias"
        )
        weights = cfg["in_features"] * cfg["out_features"]
        assert bpw["layers"][name]["stored"] == pytest.approx(bits / weights, abs=1e-4)
        assert cfg["stripes_4bit"] == 1  # block4: one in four stripes of 16 at width 64
        assert cfg["outliers"] == math.floor(0.005 * weights)
        stripe_bits = tensors[name + ".stripe_bits"]
        assert (stripe_bits.reshape(-1, 4) == 4).sum(1).tolist() == [1]
        total_bits += bits
        total_weights += weights
    assert bpw["quantized_linears"] == pytest.approx(total_bits / total_weights, abs=1e-4)
    assert bpw["reported_layers"]["stored"] == pytest.approx(total_bits / total_weights, abs=1e-4)
    # Eq. 10 with g2 = 4: 0.75·(2 + 6/16 + 20/64) + 0.25·4, plus 30 bits per outlier.
    assert bpw["reported_layers"]["eq10"] == pytest.approx(
        0.75 * (2 + 6 / 16 + 20 / 64) + 1 + 30 * 0.005, abs=2e-3
    )

    pack = run_cli(["pack", out, "--json"])
    assert pack.exit_code == 0, pack.output
    assert json.loads(pack.stdout)["layouts"] == {"mixed-2-4-16 w2/4 g16 block4": 30}

    ev = run_cli(["eval", out, "--text", TINY_SAMPLE, "--seq-len", 64, "--windows", 4, "--json"])
    assert ev.exit_code == 0, ev.output
    ppl = json.loads(ev.stdout)["perplexity"]
    assert math.isfinite(ppl) and 1 < ppl < 512


def test_stories260k_gptq_solver_end_to_end(tmp_path):
    """`solver: gptq` through the CLI: the same layout (bits recomputed from the files), a checkpoint the loader
    takes and `qtool eval` runs."""
    recipe = write_recipe(
        tmp_path / "r.yaml",
        RECIPE.replace("    scale_group_size: 4\n", "    scale_group_size: 4\n    solver: gptq\n"),
    )
    res = run_cli(["quantize", recipe, "--json"], cwd=tmp_path)
    assert res.exit_code == 0, res.output
    out = tmp_path / "out"
    bpw = json.loads((out / "qtool-manifest.json").read_text())["bits_per_weight"]
    layers = read_config(out)["quantization_config"]["layers"]
    tensors = load_file(str(out / "model.safetensors"))
    assert len(layers) == 30
    for name, cfg in layers.items():
        bits = sum(
            t.numel() * t.element_size() * 8 for key, t in tensors.items() if key.startswith(name + ".")
        )
        assert bpw["layers"][name]["stored"] == pytest.approx(
            bits / (cfg["in_features"] * cfg["out_features"]), abs=1e-4
        )
        assert cfg["outliers"] == math.floor(0.005 * cfg["in_features"] * cfg["out_features"])
    ev = run_cli(["eval", out, "--text", TINY_SAMPLE, "--seq-len", 64, "--windows", 4, "--json"])
    assert ev.exit_code == 0, ev.output
    ppl = json.loads(ev.stdout)["perplexity"]
    assert math.isfinite(ppl) and 1 < ppl < 512


def _mixed(text: str) -> str:
    return RECIPE.replace("    scale_group_size: 4\n", "    scale_group_size: 4\n" + text)


@pytest.mark.parametrize(
    "text, words",
    [
        (_mixed("    fraction_4bit: 1.5\n"), ["stages[0].fraction_4bit: found 1.5", "in 0.0..1.0"]),
        (_mixed("    fraction_4bit: -0.1\n    assign: global\n"), ["stages[0].fraction_4bit: found -0.1"]),
        (
            _mixed("    fraction_4bit: 0.1\n"),
            ["stages[0].fraction_4bit: found 0.1 with assign block4", "0.25"],
        ),
        (
            _mixed("    group_size: 24\n"),
            [
                "stages[0].group_size: found 24",
                "targeted linear model.layers.0.self_attn.q_proj has in_features 64",
            ],
        ),
        (_mixed("    group_size: 12\n"), ["stages[0].group_size: found 12", "multiple of 8"]),
        (
            _mixed("    group_size: 32\n"),
            [
                "stages[0].assign: found 'block4'",
                "has 2 stripes of 32",
                "fewer than a whole number of blocks of four",
                "assign global",
            ],
        ),
        (
            RECIPE.replace("scale_group_size: 4", "scale_group_size: 5"),
            ["stages[0].scale_group_size: found 5", "has out_features 64"],
        ),
        (
            RECIPE.replace('targets: {exclude: ["*.down_proj"]}', "assign: block4"),
            ["stages[0].group_size: found 16", "model.layers.0.mlp.down_proj has in_features 172"],
        ),
        (
            _mixed("    assign: global\n    target_bits: 1.5\n"),
            ["stages[0].target_bits: found 1.5", "in 2.0..4.0"],
        ),
        (
            _mixed("    assign: global\n    target_bits: 4.5\n"),
            ["stages[0].target_bits: found 4.5", "in 2.0..4.0"],
        ),
        (
            _mixed("    assign: global\n    target_bits: 2.2\n"),
            ["stages[0].target_bits: found 2.2", "cannot be met"],
        ),
        (
            _mixed("    assign: global\n    target_bits: 3.0\n"),
            ["stages[0].target_bits: found 3.0", "cannot be met", "model.layers.0.self_attn.q_proj stores"],
        ),
        (_mixed("    target_bits: 3.0\n"), ["stages[0].target_bits: found 3.0 with assign block4"]),
        (
            _mixed("    assign: global\n    target_bits: 2.7\n    target_counts: eq10\n"),
            ["stages[0].target_bits: found 2.7", "cannot be met", "counts (Eq. 10) at least 2.8375"],
        ),
        (
            _mixed("    assign: global\n    target_counts: paper\n"),
            ["stages[0].target_counts: found 'paper'"],
        ),
        (
            _mixed("    assign: global\n    fraction_4bit: 0.1\n"),
            ["stages[0].fraction_4bit: found 0.1", "only 4 stripes of 16", "too few"],
        ),
        (_mixed("    solver: awq\n"), ["stages[0].solver: found 'awq'", "one of 'rtn', 'gptq'"]),
        (
            _mixed("    outlier_fraction: 0.01\n").replace("    outlier_fraction: 0.005\n", ""),
            ["stages[0].outlier_fraction: found 0.01", "0.005"],
        ),
        (_mixed("    bits: 3\n"), ["stages[0].bits: unknown option"]),
        (
            _mixed("    sensitivity: hessian\n"),
            ["stages[0].sensitivity: found 'hessian'", "'eq9', 'obs', 'random'"],
        ),
        (_mixed("    finetune_steps: -1\n"), ["stages[0].finetune_steps: found -1"]),
        (_mixed("    finetune_steps: 8\n    finetune_lr: 0\n"), ["stages[0].finetune_lr: found 0"]),
    ],
)
def test_bad_recipes(tmp_path, no_work, text, words):
    r = write_recipe(tmp_path / "r.yaml", text)
    assert_one_line_error(
        run_cli(["quantize", r], cwd=tmp_path), 3, "r.yaml", *words, output=tmp_path / "out"
    )


@pytest.mark.parametrize("name,assign", [("mixed-2-4-16", "block4"), ("mixed-2-4-16-budget", "global")])
def test_shipped_recipes_validate_against_smollm2_config(name, assign):
    """The shipped recipes parse and pass every stage's check of SmolLM2-135M's config (no weight is read)."""
    from qtool.models.loading import load_config
    from qtool.pipeline import check_stages
    from qtool.recipe import load_recipe

    if not (SMOLLM2_CACHE / "config.json").is_file():
        pytest.skip("SmolLM2-135M is not converted in .cache/")

    recipe = load_recipe(ROOT / "recipes" / f"{name}.yaml", {"model": str(SMOLLM2_CACHE)})
    stage = recipe.stages[0].stage
    assert stage.name == "mixed" and stage.options.assign == assign
    check_stages(recipe, load_config(str(SMOLLM2_CACHE)))
