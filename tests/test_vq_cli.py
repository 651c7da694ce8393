"""Stages `vq` and `vq_kv` through the CLI: stories260K end to end (quantize → `vq` checkpoint with a CQ-2 KV cache
→ `qtool pack` → `qtool eval` through the loader, which reproduces the pipeline's perplexity), the manifest's bits
per weight recomputed from the tensor files, and bad recipes refused in one line (exit 3) before any model loads.

stories260K is tiny (widths 64 and 172, head_dim 8, 4 KV heads): the codebooks here are small (16 entries) so
that every tile holds enough vectors and the run stays short."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from qtool.checkpoint.loader import read_config

from bad_input import assert_one_line_error, run_cli
from conftest import ROOT, SMOLLM2_CACHE, STORIES, TINY_SAMPLE, write_recipe

RECIPE = f"""
model: {STORIES}
calibration:
  source: {TINY_SAMPLE}
  num_samples: 4
  seq_len: 64
  seed: 0
stages:
  - stage: vq_kv
    preset: cq-2
    entries: 16
    kmeans_iters: 8
  - stage: vq
    preset: gptvq-2
    vector_size: 2
    entries: 16
    tile_rows: 32
    tile_cols: 64
    kmeans_iters: 8
eval:
  text: {TINY_SAMPLE}
  seq_len: 64
  max_windows: 4
output: out
"""


def test_stories260k_quantize_eval_and_bits(tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", RECIPE)
    res = run_cli(["quantize", recipe, "--json"], cwd=tmp_path)
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    out = tmp_path / "out"
    manifest = json.loads((out / "qtool-manifest.json").read_text())
    bpw = manifest["bits_per_weight"]
    qcfg = read_config(out)["quantization_config"]
    layers = qcfg["layers"]
    assert len(layers) == 5 * 7 and all(cfg["format"] == "vq" for cfg in layers.values())
    assert qcfg["kv_cache"] == {
        "format": "vq",
        "vector_size": 4,
        "entries": 16,
        "index_bits": 4,
        "keys": "post_rope",
        "bits_per_element": 1.0,
    }

    # Bits per weight from the tensor files alone equal the manifest's, per layer and for the model.
    tensors = load_file(str(out / "model.safetensors"))
    total_bits = total_weights = 0
    for name, cfg in layers.items():
        assert (cfg["vector_size"], cfg["entries"], cfg["index_bits"], cfg["residuals"]) == (2, 16, 4, 1)
        assert cfg["reindexed"] is True
        bits = sum(
            t.numel() * t.element_size() * 8
            for key, t in tensors.items()
            if key.startswith(name + ".") and key != name + ".bias"
        )
        weights = cfg["in_features"] * cfg["out_features"]
        assert bpw["layers"][name] == {"stored": pytest.approx(bits / weights, abs=1e-4), "indices": 2.0}
        assert tensors[name + ".codebooks"].dtype == torch.float16
        total_bits += bits
        total_weights += weights
    assert bpw["quantized_linears"] == pytest.approx(total_bits / total_weights, abs=1e-4)
    assert bpw["reported_layers"]["stored"] == pytest.approx(total_bits / total_weights, abs=1e-4)
    for i in range(5):
        for f in ("key", "value"):
            t = tensors[f"model.layers.{i}.self_attn.kv_codebooks.{f}"]
            assert t.dtype == torch.float16 and t.shape == (4, 2, 16, 4)

    # Re-packed (sharded), the checkpoint keeps its KV cache scheme and computes the same.
    pack = run_cli(["pack", out, "-o", tmp_path / "repacked", "--max-shard-size", "100KB", "--json"])
    assert pack.exit_code == 0, pack.output
    assert json.loads(pack.stdout)["layouts"] == {"vq VQ<2,4,1> tile 32x64": 35}
    again = json.loads((tmp_path / "repacked" / "config.json").read_text())["quantization_config"]
    assert again["kv_cache"] == qcfg["kv_cache"]

    ev = run_cli(
        ["eval", out, tmp_path / "repacked", "--text", TINY_SAMPLE, "--seq-len", 64, "--windows", 4, "--json"]
    )
    assert ev.exit_code == 0, ev.output
    ppl, ppl_repacked = (m["perplexity"] for m in json.loads(ev.stdout)["models"])
    assert ppl_repacked == ppl
    assert math.isfinite(ppl) and 1 < ppl < 512
    # The loaded checkpoint (codes, codebooks, the KV cache's codebooks) computes what the pipeline's model did.
    assert ppl == pytest.approx(summary["eval"]["quantized"]["perplexity"], rel=1e-4)
    assert ppl > summary["eval"]["original"]["perplexity"]


def _vq(text: str) -> str:
    return RECIPE.replace("    preset: gptvq-2\n", "    preset: gptvq-2\n" + text)


def _kv(text: str) -> str:
    return RECIPE.replace("    preset: cq-2\n", "    preset: cq-2\n" + text)


@pytest.mark.parametrize(
    "text, words",
    [
        (
            _vq("    entries: 300\n").replace("    entries: 16\n    tile_rows", "    tile_rows"),
            ["stages[1].entries: found 300", "power of two"],
        ),
        (
            _vq("    vector_size: 8\n").replace("    vector_size: 2\n", ""),
            [
                "stages[1].vector_size: found 8",
                "targeted linear model.layers.0.mlp.down_proj has in_features 172",
                "divisor",
            ],
        ),
        (_vq("    residuals: 0\n"), ["stages[1].residuals: found 0", "1..8"]),
        (
            RECIPE.replace(
                "    preset: gptvq-2\n    vector_size: 2\n    entries: 16\n    tile_rows: 32\n    tile_cols: 64\n",
                "    preset: aqlm-3\n",
            ),
            [
                "stages[1].entries: found 4096",
                "q_proj has only 512 vectors of 8 in its tensor",
                "too few",
                "at most 512",
            ],
        ),
        (
            _vq("    tile_rows: 1\n    tile_cols: 16\n").replace(
                "    tile_rows: 32\n    tile_cols: 64\n", ""
            ),
            ["stages[1].entries: found 16", "smallest tile (1x16)", "only 8 vectors of 2"],
        ),
        (
            _vq("    residuals: 2\n")
            .replace("entries: 16\n    tile_rows", "entries: 65536\n    tile_rows")
            .replace("vector_size: 2", "vector_size: 4"),
            [
                "stages[1].entries: found 65536 with vector_size 4 and residuals 2",
                "1024 KiB",
                "227 KiB",
                "H100",
            ],
        ),
        (
            _vq("    tile_cols: 31\n").replace("    tile_cols: 64\n", ""),
            ["stages[1].tile_cols: found 31", "multiple of vector_size 2"],
        ),
        (_vq("    scope: tensor\n"), ["stages[1].scope: found 'tensor' with tile_rows/tile_cols"]),
        (
            _vq("    preset: null\n").replace("    preset: gptvq-2\n", ""),
            ["stages[1].residuals: missing", "preset"],
        ),
        (_kv("    vector_size: 3\n"), ["stages[0].vector_size: found 3", "head_dim is 8"]),
        (
            _kv("    entries: 24\n").replace("    entries: 16\n    kmeans", "    kmeans"),
            ["stages[0].entries: found 24", "power of two"],
        ),
        (
            _kv("    entries: 512\n").replace("    entries: 16\n    kmeans", "    kmeans"),
            ["stages[0].entries: found 512", "2..256"],
        ),
        (
            RECIPE.replace("num_samples: 4", "num_samples: 1").replace(
                "    entries: 16\n    kmeans_iters: 8\n  - stage: vq\n", "    entries: 128\n  - stage: vq\n"
            ),
            [
                "stages[0].entries: found 128",
                "calibration holds 64 tokens",
                "num_samples 1 x seq_len 64",
                "at least 128",
            ],
        ),
        (_kv("    preset: cq-8\n").replace("    preset: cq-2\n", ""), ["stages[0].preset: found 'cq-8'"]),
        (
            RECIPE.replace("stages:\n", "stages:\n  - stage: kv_cache\n    bits: 4\n"),
            ["stages[1]: vq_kv sets the model's kv_cache scheme, as stages[0] (kv_cache) does"],
        ),
    ],
)
def test_bad_recipes(tmp_path, no_work, text, words):
    r = write_recipe(tmp_path / "r.yaml", text)
    assert_one_line_error(
        run_cli(["quantize", r], cwd=tmp_path), 3, "r.yaml", *words, output=tmp_path / "out"
    )


@pytest.mark.parametrize("name", ["vq-gptvq-2bit", "vq-aqlm-3bit", "vq-aqlm-3bit-small", "vq-kv-cq2"])
def test_shipped_recipes_validate_against_smollm2_config(name):
    """The shipped recipes parse and pass every stage's check of SmolLM2-135M's config (no weight is read)."""
    from qtool.models.loading import load_config
    from qtool.pipeline import check_stages
    from qtool.recipe import load_recipe

    if not (SMOLLM2_CACHE / "config.json").is_file():
        pytest.skip("SmolLM2-135M is not converted in .cache/")

    recipe = load_recipe(ROOT / "recipes" / f"{name}.yaml", {"model": str(SMOLLM2_CACHE)})
    check_stages(recipe, load_config(str(SMOLLM2_CACHE)))
