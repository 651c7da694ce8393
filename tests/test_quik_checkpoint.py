"""Stage `outliers` end to end: quantize → checkpoint → load on tiny random models, broken `quik` tensors, recipe
errors, and stories260K perplexity.

stories260K protocol (kept small for CPU): calibration 32 random 256-token windows of the 2 MiB TinyStories head
(seed 0); perplexity on its first 16 windows of 256 tokens, BOS per story (split at <|endoftext|>).
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

from conftest import ROOT, STORIES, TINY_SAMPLE, TINYSTORIES, write_recipe

RECIPE = """
model: {model}
calibration:
  source: {text}
  num_samples: {samples}
  seq_len: {seq}
  seed: 0
stages:
  - stage: outliers
    bits: {bits}
    act_bits: {act_bits}
    outliers: {outliers}
    sparsity_24: {sparse}
    overrides:
      - {{pattern: "*.down_proj", bits: 8, act_bits: 8, outlier_multiplier: 3.5}}
      - {{pattern: "*.fc2", bits: 8, act_bits: 8, outlier_multiplier: 3.5}}
eval:
  text: {text}
  seq_len: {seq}
  max_windows: {windows}
  {separator}
output: {out}
"""


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These models are tiny: on a busy machine, a second intra-op thread costs far more in waiting than it saves."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def recipe_text(
    model: Path,
    out: Path,
    *,
    bits: int = 4,
    act_bits: int = 4,
    outliers: int | float = 8,
    sparse: bool = False,
    text: Path = TINY_SAMPLE,
    samples: int = 8,
    seq: int = 64,
    windows: int = 4,
    separator: str = "",
) -> str:
    return RECIPE.format(
        model=model,
        text=text,
        samples=samples,
        seq=seq,
        bits=bits,
        act_bits=act_bits,
        outliers=outliers,
        sparse=str(sparse).lower(),
        windows=windows,
        separator=separator,
        out=out,
    )


def quantize(cli, recipe: Path) -> dict:
    res = cli("quantize", recipe, "--json", "--overwrite")
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


@pytest.fixture(scope="module")
def llama_quik(tmp_path_factory, tiny_llama):
    from click.testing import CliRunner

    from qtool.cli import cli as group

    tmp = tmp_path_factory.mktemp("quik-llama")
    recipe = write_recipe(tmp / "r.yaml", recipe_text(tiny_llama, tmp / "ckpt"))
    res = CliRunner().invoke(group, ["quantize", str(recipe), "--json"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return tmp / "ckpt", json.loads(res.stdout), recipe


def test_llama_round_trip_same_logits_as_in_memory(llama_quik):
    import qtool
    from qtool.console import Reporter
    from qtool.layouts.quik.module import QuikLinear
    from qtool.pipeline import quantize_model
    from qtool.recipe import load_recipe

    ckpt, summary, recipe = llama_quik
    loaded = qtool.load(ckpt)
    in_memory = quantize_model(load_recipe(recipe), Reporter(quiet=True)).model.eval()
    x = torch.randint(0, 512, (2, 24))
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, in_memory(x).logits)

    layers = read_config(ckpt)["quantization_config"]["layers"]
    assert len(layers) == 2 * 7
    assert layers["model.layers.0.self_attn.q_proj"] == {
        "format": "quik",
        "bits": 4,
        "act_bits": 4,
        "group_size": None,
        "symmetric": True,
        "num_outliers": 8,
        "sparsity": None,
        "in_features": 96,
        "out_features": 96,
        "bias": False,
    }
    down = layers["model.layers.1.mlp.down_proj"]
    assert (down["bits"], down["act_bits"], down["num_outliers"]) == (8, 8, 28)
    q = loaded.get_submodule("model.layers.0.self_attn.q_proj")
    assert isinstance(q, QuikLinear) and q.outlier_weight.dtype == torch.float16
    assert q.dequantize().shape == (96, 96)
    assert summary["eval"]["quantized"]["perplexity"] < 2 * summary["eval"]["original"]["perplexity"]


def test_zero_outlier_checkpoint_keeps_every_empty_tensor(cli, tiny_llama, tmp_path):
    """Layers without outliers store empty `outlier_idx` / `outlier_weight` tensors; all of them share one (null)
    address, which once made the writer drop all but the first as 'tied' and the loader refuse the checkpoint."""
    import qtool
    from qtool.layouts.quik.module import QuikLinear

    recipe = write_recipe(tmp_path / "r.yaml", recipe_text(tiny_llama, tmp_path / "ckpt", outliers=0))
    quantize(cli, recipe)
    loaded = qtool.load(tmp_path / "ckpt")
    layers = [m for m in loaded.modules() if isinstance(m, QuikLinear)]
    assert len(layers) == 2 * 7 and all(m.outlier_idx.numel() == 0 for m in layers)
    with torch.no_grad():
        assert torch.isfinite(loaded(torch.randint(0, 512, (1, 16))).logits).all()


def test_opt_fc2_rule_and_biases(cli, tiny_opt, tmp_path):
    import qtool

    summary = quantize(
        cli, write_recipe(tmp_path / "r.yaml", recipe_text(tiny_opt, tmp_path / "ckpt", sparse=True))
    )
    assert summary["quantized_linears"] == 2 * 6
    model = qtool.load(tmp_path / "ckpt")
    fc2 = model.get_submodule("model.decoder.layers.0.fc2")
    fc1 = model.get_submodule("model.decoder.layers.0.fc1")
    assert (fc2.bits, fc2.act_bits, fc2.outlier_idx.numel()) == (8, 8, 28)
    assert fc1.bias is not None and fc1.bits == 4 and fc1.sparsity_24
    assert torch.isfinite(model(torch.randint(0, 512, (1, 16))).logits).all()
    res = cli("pack", tmp_path / "ckpt", "--json")
    assert res.exit_code == 0, res.output
    layouts = json.loads(res.stdout)["layouts"]
    assert layouts == {
        "quik w4 gchannel sym a4 outliers=8 2:4": 10,
        "quik w8 gchannel sym a8 outliers=28 2:4": 2,
    }


# ---- broken checkpoints -------------------------------------------------------------------------------

LAYER = "model.layers.0.self_attn.k_proj"


@pytest.fixture
def broken(llama_quik, tmp_path):
    ckpt, _, _ = llama_quik
    dst = tmp_path / "broken"
    shutil.copytree(ckpt, dst)
    return dst


def _edit(ckpt: Path, edit) -> None:
    t = load_file(str(ckpt / "model.safetensors"))
    edit(t)
    save_file(t, str(ckpt / "model.safetensors"))
    m = json.loads((ckpt / "qtool-manifest.json").read_text())
    m["files"]["model.safetensors"] = file_sha256(ckpt / "model.safetensors")
    m["sizes"]["model.safetensors"] = (ckpt / "model.safetensors").stat().st_size
    (ckpt / "qtool-manifest.json").write_text(json.dumps(m))


def _error(cli, ckpt: Path) -> str:
    res = cli("eval", ckpt, "--text", TINY_SAMPLE, "--seq-len", "32", "--windows", "1", "--quiet")
    assert res.exit_code == 5, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("qtool: error: "), res.output
    return lines[0]


def _set(name: str, fn):
    return lambda t: t.update({f"{LAYER}.{name}": fn(t[f"{LAYER}.{name}"])})


@pytest.mark.parametrize(
    "field,fn,fragments",
    [
        (
            "outlier_idx",
            lambda v: v[:-1].contiguous(),
            ["outlier_idx: found torch.int32 [7], expected torch.int32 [8]"],
        ),
        (
            "outlier_idx",
            lambda v: torch.cat([v[:-1], torch.tensor([500], dtype=torch.int32)]),
            ["outlier_idx: found values in", "expected column indices in 0..95"],
        ),
        (
            "outlier_idx",
            lambda v: v.flip(0).contiguous(),
            ["outlier_idx: found indices not strictly increasing"],
        ),
        ("wreduced", lambda v: v * 1.5 + 1.0, ["wreduced: row", "expected", "sum of the signed base codes"]),
        ("scales", lambda v: -v, ["scales: found non-positive"]),
        ("outlier_weight", lambda v: v.to(torch.float32), ["outlier_weight: found torch.float32"]),
    ],
)
def test_broken_quik_tensors_are_named(cli, broken, field, fn, fragments):
    _edit(broken, _set(field, fn))
    msg = _error(cli, broken)
    assert f"tensor {LAYER}." in msg
    for f in fragments:
        assert f in msg, (f, msg)


def test_broken_layer_config_and_24_pattern(cli, broken):
    cfg_path = broken / "config.json"
    cfg = read_config(broken)  # written back in the per-layer form (format version 1), which qtool reads
    cfg["quantization_config"]["format_version"] = 1
    cfg["quantization_config"]["layers"][LAYER]["sparsity"] = "2:4"
    cfg_path.write_text(json.dumps(cfg))
    m = json.loads((broken / "qtool-manifest.json").read_text())
    m["files"]["config.json"] = file_sha256(cfg_path)
    m["sizes"]["config.json"] = cfg_path.stat().st_size
    (broken / "qtool-manifest.json").write_text(json.dumps(m))
    assert "expected at most 2 (sparsity 2:4)" in _error(cli, broken)
    cfg["quantization_config"]["layers"][LAYER]["act_bits"] = 6
    cfg_path.write_text(json.dumps(cfg))
    m["files"]["config.json"] = file_sha256(cfg_path)
    m["sizes"]["config.json"] = cfg_path.stat().st_size
    (broken / "qtool-manifest.json").write_text(json.dumps(m))
    msg = _error(cli, broken)
    assert f"layer {LAYER}" in msg and "'act_bits' found 6, expected 4 or 8" in msg


# ---- recipe errors ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "old,new,fragments",
    [
        ("bits: 4", "bits: 6", ["stages[0].bits", "found 6", "one of 4, 8"]),
        ("act_bits: 4", "act_bits: 16", ["stages[0].act_bits", "found 16", "one of 4, 8"]),
        (
            "outliers: 8",
            "outliers: 1.5",
            ["stages[0].outliers", "found 1.5", "fraction of in_features in [0, 1)"],
        ),
        ("outliers: 8", "outliers: -3", ["stages[0].outliers", "found -3"]),
        ("sparsity_24: false", "sparsity_24: 2", ["stages[0].sparsity_24", "found 2", "boolean"]),
        (
            '"*.down_proj", bits: 8',
            '"*.down_proj", bits: 3',
            ["stages[0].overrides[0].bits", "found 3", "one of 4, 8 or null"],
        ),
        ('{pattern: "*.fc2", ', "{", ["stages[0].overrides[1].pattern", "missing"]),
        (
            "act_bits: 8, outlier_multiplier",
            "act_bits: 8, multiplier",
            ["stages[0].overrides[0].multiplier", "unknown option"],
        ),
    ],
)
def test_recipe_errors_name_file_and_key(cli, tmp_path, old, new, fragments):
    text = recipe_text(STORIES, tmp_path / "o")
    assert old in text, old
    text = text.replace(old, new, 1)
    res = cli("quantize", write_recipe(tmp_path / "r.yaml", text))
    assert res.exit_code == 3, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("qtool: error: ") and "r.yaml:" in lines[0], res.output
    for f in fragments:
        assert f in lines[0], (f, lines[0])


# ---- stories260K ----------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(not STORIES.is_dir(), reason="stories260K assets not found")
def test_stories260k_w8a8_close_to_fp_and_outliers_help_w4a4(cli, tmp_path):
    sep = 'separator: "<|endoftext|>"'
    ppl = {}
    for label, bits, outliers in (("w8a8", 8, 8), ("w4a4", 4, 8), ("w4a4-0", 4, 0)):
        text = recipe_text(
            STORIES,
            tmp_path / label,
            bits=bits,
            act_bits=bits,
            outliers=outliers,
            text=TINYSTORIES,
            samples=32,
            seq=256,
            windows=16,
            separator=sep,
        )
        ev = quantize(cli, write_recipe(tmp_path / f"{label}.yaml", text))["eval"]
        ppl["fp"] = ev["original"]["perplexity"]
        ppl[label] = ev["quantized"]["perplexity"]
    assert 3.5 < ppl["fp"] < 5.0
    assert ppl["w8a8"] < 1.05 * ppl["fp"]
    assert ppl["w4a4"] < ppl["w4a4-0"]
    assert ppl["w4a4"] < 1.25 * ppl["fp"]


@pytest.mark.parametrize("name,bits,down_bits", [("quik-w4a4.yaml", 4, 8), ("quik-w8a8.yaml", 8, 8)])
def test_shipped_quik_recipes_validate(name, bits, down_bits):
    from qtool.recipe import load_recipe

    r = load_recipe(ROOT / "recipes" / name, {"model": str(STORIES)})
    stage = r.stages[0].stage
    assert stage.name == "outliers" and stage.options.outliers == 256 and stage.options.clip
    assert stage.plan("model.layers.0.self_attn.q_proj", 576, None) == (bits, bits, 256)
    assert stage.plan("model.layers.0.mlp.down_proj", 1536, None) == (down_bits, down_bits, 896)
    assert stage.plan("model.decoder.layers.0.fc2", 3072, None) == (down_bits, down_bits, 896)
