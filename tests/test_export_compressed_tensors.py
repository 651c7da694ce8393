"""`qtool export --format compressed-tensors` on stories260K: the export is what the compressed-tensors library
defines, unmodified transformers loads it and computes qtool's logits, and what the format cannot hold is refused
with one line and nothing written (formats/compressed-tensors.md)."""

from __future__ import annotations

import errno
import json
import os
import pathlib
import shutil

import pytest
import torch

from bad_input import assert_nothing_at, assert_one_line_error, run_cli
from conftest import ROOT, STORIES, TINY_SAMPLE, write_recipe

pytestmark = pytest.mark.skipif(not STORIES.is_dir(), reason="stories260K assets not found")

# Half an ulp of float16 at 1: the largest relative rounding error of one float16 rounding.
FP16_ROUNDING = 2.0**-11


def rtn_recipe(out, *, bits=4, group="4", sym="true", extra="", stage="rtn") -> str:
    return (
        f"model: {STORIES}\n{extra}stages:\n  - stage: {stage}\n    bits: {bits}\n    group_size: {group}\n"
        + (f"    symmetric: {sym}\n" if stage == "rtn" else "")
        + f"output: {out}\n"
    )


@pytest.fixture(scope="module")
def stories(tmp_path_factory):
    """RTN W4 g4 symmetric and asymmetric, QoQ W8A8 per channel, RTN W4 g32 (partial groups: 172 columns) and
    RTN with a KV4 cache, each quantized and (where the format holds it) exported."""
    tmp = tmp_path_factory.mktemp("export")
    recipes = {
        "sym": rtn_recipe(tmp / "sym"),
        "asym": rtn_recipe(tmp / "asym", sym="false"),
        "asym-channel": rtn_recipe(tmp / "asym-channel", group="null", sym="false"),
        "w8a8": rtn_recipe(tmp / "w8a8", bits=8, group="null", stage="progressive"),
        "g32": rtn_recipe(tmp / "g32", group="32"),
        "kv4": rtn_recipe(tmp / "kv4").replace("stages:\n", "stages:\n  - stage: kv_cache\n    bits: 4\n"),
    }
    for name, text in recipes.items():
        res = run_cli(["quantize", write_recipe(tmp / f"{name}.yaml", text), "-q"])
        assert res.exit_code == 0, res.output
    for name in ("sym", "asym", "asym-channel", "w8a8"):
        res = run_cli(
            ["export", tmp / name, "--format", "compressed-tensors", "-o", tmp / f"{name}-ct", "--json"]
        )
        assert res.exit_code == 0, res.output
    return tmp


IDS = torch.randint(3, 500, (2, 96), generator=torch.Generator().manual_seed(0))


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / a.abs().max()).item()


def hf(path, dequantize: bool = False):
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    kw = {"quantization_config": CompressedTensorsConfig(dequantize=True)} if dequantize else {}
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw).eval()


def test_the_files_are_what_compressed_tensors_defines(stories):
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file

    for name in ("sym", "asym"):
        cfg = json.loads((stories / f"{name}-ct" / "config.json").read_text())["quantization_config"]
        qc = QuantizationConfig.model_validate(cfg)
        assert qc.quant_method == "compressed-tensors" and qc.format == "pack-quantized"
        assert qc.quantization_status == "compressed" and qc.ignore == ["lm_head"]
        (group,) = qc.config_groups.values()
        w = group.weights
        assert (w.num_bits, w.strategy, w.group_size, w.symmetric) == (4, "group", 4, name == "sym")
        ours = load_file(stories / name / "model.safetensors")
        theirs = load_file(stories / f"{name}-ct" / "model.safetensors")
        m = "model.layers.2.mlp.down_proj"
        # The library's packing of the signed codes is qtool's unsigned bit stream, word for word.
        assert torch.equal(theirs[f"{m}.weight_packed"], ours[f"{m}.qweight"])
        assert torch.equal(theirs[f"{m}.weight_scale"].to(torch.float16), ours[f"{m}.scales"])
        assert theirs[f"{m}.weight_shape"].tolist() == [64, 172]
        assert (f"{m}.weight_zero_point" in theirs) == (name == "asym")
    record = json.loads((stories / "sym-ct" / "qtool-export.json").read_text())
    assert record["source"]["checkpoint"] == "sym" and "compressed-tensors" in record["packages"]
    assert set(record["files"]) == {
        "README.md",
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    }


def test_symmetric_export_loads_in_transformers_with_qtools_logits(stories):
    import qtool

    ref = logits(qtool.load(stories / "sym"))
    for dequantize in (False, True):
        model = hf(stories / "sym-ct", dequantize)
        assert type(model.model.layers[0].mlp.down_proj) is torch.nn.Linear  # no qtool module anywhere
        assert rel(ref, logits(model)) < FP16_ROUNDING


@pytest.mark.parametrize("name", ["asym", "asym-channel"])
def test_asymmetric_export_loads_with_dequantize_only(stories, name):
    """The upstream zero-point mismatch (formats/compressed-tensors.md): the compressed load is refused loudly,
    never with random zero points; `CompressedTensorsConfig(dequantize=True)` loads qtool's weights. Per channel,
    the library packs each zero point into a view of a larger buffer, which the export copies out to save it."""
    import qtool

    with pytest.raises(RuntimeError, match="mismatch"):
        hf(stories / f"{name}-ct")
    assert (
        rel(logits(qtool.load(stories / name)), logits(hf(stories / f"{name}-ct", dequantize=True)))
        < FP16_ROUNDING
    )


def test_w8a8_export_has_qtools_weights_and_compressed_tensors_activation_rounding(stories):
    import qtool
    from qtool.layouts.qoq.module import QoQLinear

    ref = qtool.load(stories / "w8a8")
    dense = hf(stories / "w8a8-ct", dequantize=True)
    names = [n for n, m in ref.named_modules() if isinstance(m, QoQLinear)]
    assert len(names) == 35
    for n in names:
        assert torch.equal(dense.get_submodule(n).weight, ref.get_submodule(n).dequantize(torch.float32)), n
    own = logits(ref)

    def ct_rule(
        w,
    ):  # compressed-tensors' dynamic per-token symmetric INT8: scale max|x|/127.5, codes [-128, 127]
        def forward(x):
            s = x.abs().amax(-1, keepdim=True) / 127.5
            return torch.nn.functional.linear(torch.clamp(torch.round(x / s), -128, 127) * s, w)

        return forward

    for n in names:
        ref.get_submodule(n).forward = ct_rule(ref.get_submodule(n).dequantize(torch.float32))
    emulated, client = logits(ref), logits(hf(stories / "w8a8-ct"))
    assert rel(emulated, client) < FP16_ROUNDING
    gap = rel(
        own, client
    )  # qtool's rule (max|x|/127, ±127) against the client's: the activation rounding only
    assert 0 < gap < 0.05, gap


def test_export_refuses_what_the_format_cannot_hold(stories, tmp_path):
    res = run_cli(["export", stories / "g32", "--format", "compressed-tensors", "-o", tmp_path / "o"])
    assert_one_line_error(
        res,
        2,
        "layer model.layers.0.mlp.down_proj",
        "in_features 172",
        "group_size 32",
        output=tmp_path / "o",
    )
    res = run_cli(
        ["export", stories / "kv4", "--format", "compressed-tensors", "-o", tmp_path / "o", "--json"]
    )
    assert_one_line_error(
        res, 2, "quantization_config.kv_cache", "4-bit KV cache", output=tmp_path / "o", json_error=True
    )


@pytest.mark.parametrize(
    ("cfg", "words"),
    [
        (
            {
                "format": "quik",
                "bits": 4,
                "act_bits": 4,
                "group_size": None,
                "num_outliers": 128,
                "in_features": 576,
            },
            ["128 float16 outlier input columns"],
        ),
        (
            {
                "format": "quik",
                "bits": 8,
                "act_bits": 8,
                "group_size": None,
                "num_outliers": 0,
                "sparsity": "2:4",
                "in_features": 576,
            },
            ["2:4 sparse"],
        ),
        ({"format": "mixed", "group_size": 16, "in_features": 576}, ["mixed layout"]),
        (
            {"format": "qoq", "bits": 4, "act_bits": 8, "group_size": 64, "in_features": 576},
            ["progressive groups"],
        ),
        (
            {"format": "grouped_int", "bits": 4, "group_size": 128, "symmetric": True, "in_features": 576},
            ["in_features 576 is not a multiple of group_size 128"],
        ),
    ],
)
def test_unexpressible_layers_are_named(cfg, words):
    from qtool.errors import UsageError
    from qtool.export.compressed_tensors import layer_scheme

    with pytest.raises(UsageError) as e:
        layer_scheme("model.layers.7.mlp.down_proj", cfg, "ckpt/config.json")
    for w in ["ckpt/config.json: layer model.layers.7.mlp.down_proj", *words]:
        assert w in str(e.value)


def test_export_bad_input(stories, tmp_path, monkeypatch):
    broken = tmp_path / "broken"
    shutil.copytree(stories / "sym", broken)
    data = bytearray((broken / "model.safetensors").read_bytes())
    data[-1] ^= 1
    (broken / "model.safetensors").write_bytes(bytes(data))
    res = run_cli(["export", broken, "--format", "compressed-tensors", "-o", tmp_path / "o"])
    assert_one_line_error(res, 5, "model.safetensors", "sha256", output=tmp_path / "o")

    res = run_cli(["export", stories / "sym", "--format", "compressed-tensors", "-o", stories / "sym-ct"])
    assert_one_line_error(res, 2, "already exists", "--overwrite")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    res = run_cli(["export", stories / "sym", "--format", "compressed-tensors", "-o", mine, "--overwrite"])
    assert_one_line_error(res, 2, "not a qtool checkpoint")
    assert (mine / "notes.txt").read_text() == "keep"

    real = pathlib.Path.mkdir

    def mkdir(self, *a, **k):
        if str(self).startswith(str(tmp_path / "mnt")):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
        return real(self, *a, **k)

    monkeypatch.setattr(pathlib.Path, "mkdir", mkdir)
    res = run_cli(["export", stories / "sym", "--format", "compressed-tensors", "-o", tmp_path / "mnt" / "o"])
    assert_one_line_error(res, 6, "Read-only file system", "expected a writable location")
    assert_nothing_at(tmp_path / "mnt")


def test_overwrite_replaces_an_earlier_export(stories, tmp_path):
    out = tmp_path / "again"
    for _ in range(2):
        res = run_cli(
            ["export", stories / "sym", "--format", "compressed-tensors", "-o", out, "--overwrite", "-q"]
        )
        assert res.exit_code == 0, res.output
    assert (out / "qtool-export.json").read_bytes() == (stories / "sym-ct" / "qtool-export.json").read_bytes()


@pytest.mark.parametrize(
    ("text", "words"),
    [
        (
            rtn_recipe("o", group="32", extra="target: compressed-tensors\n"),
            [
                "target: compressed-tensors",
                "stages[0] (rtn) group_size 32",
                "model.layers.0.mlp.down_proj",
                "in_features 172",
            ],
        ),
        (
            rtn_recipe("o", extra="target: vllm\n").replace(
                "stages:\n", "stages:\n  - stage: kv_cache\n    bits: 4\n"
            ),
            ["target: vllm", "stages[0] (kv_cache)"],
        ),
        (
            rtn_recipe(
                "o", extra=f"target: compressed-tensors\ncalibration: {{source: {TINY_SAMPLE}}}\n"
            ).replace("stages:\n", "stages:\n  - stage: vq_kv\n"),
            [
                "target: compressed-tensors",
                "stages[0] (vq_kv)",
                "KV cache with codebooks",
                "expected no vq_kv",
            ],
        ),
        (
            f"model: {STORIES}\ntarget: compressed-tensors\ncalibration: {{source: {TINY_SAMPLE}}}\n"
            "stages:\n  - stage: mixed\n    targets:\n      include: ['*q_proj']\noutput: o\n",
            ["target: compressed-tensors", "stages[0] (mixed)", "layout 'mixed-2-4-16'"],
        ),
        (rtn_recipe("o", extra="target: tensorrt\n"), ["target: found 'tensorrt'", "compressed-tensors"]),
    ],
)
def test_recipe_target_refuses_before_loading(tmp_path, no_work, text, words):
    res = run_cli(["quantize", write_recipe(tmp_path / "r.yaml", text)])
    assert_one_line_error(res, 3, *words)


def test_checkpoints_carry_a_model_card(stories):
    card = (stories / "sym" / "README.md").read_text()
    manifest = json.loads((stories / "sym" / "qtool-manifest.json").read_text())
    assert "README.md" in manifest["files"]  # hashed like every other file
    # A local source folder has no hub id: the card names it and writes no base_model metadata.
    assert "| base model | `stories260K` |" in card and "base_model:" not in card
    assert "pipeline_tag: text-generation" in card and "library_name: qtool" in card
    assert "`rtn` (bits 4, group_size 4, symmetric True)" in card and "## Recipe" in card
    assert "35 x grouped_int W4 g4 sym" in card
    assert f"{manifest['bits_per_weight']['quantized_linears']} (quantized linears)" in card
    assert "| calibration | none" in card and "Not measured" in card
    assert 'qtool.load("CHECKPOINT")' in card and str(STORIES.parent) not in card  # no path of the machine
    assert "w8a8" not in (stories / "w8a8" / "README.md").read_text()  # nor the folder's name (copies are
    # byte-identical wherever they are written)


def test_model_card_lists_the_measured_quality():
    from qtool.checkpoint.card import model_card

    ev = {
        "protocol": {"text": "/data/wiki.txt", "seq_len": 512},
        "original": {"perplexity": 10.0, "tasks": {"piqa": {"acc": {"value": 0.7, "stderr": 0.01}}}},
        "quantized": {
            "perplexity": 10.5,
            "windows": 40,
            "tasks": {"piqa": {"acc": {"value": 0.69, "stderr": 0.01}}},
        },
        "tasks_protocol": {
            "limit": 200,
            "num_fewshot": 0,
            "lm_eval_version": "0.4.13",
            "runtime": "reference",
            "device": "cpu",
        },
    }
    manifest = {
        "source": {"base_model": "meta-llama/Llama-2-7b-hf", "license": "llama2"},
        "eval": ev,
        "stages": ["gptq"],
        "calibration": {
            "source": "/data/c4.jsonl",
            "num_samples": 128,
            "seq_len": 2048,
            "seed": 0,
            "data_sha256": "ab" * 32,
        },
    }
    card = model_card(
        manifest,
        {"quantization_config": {"layers": {}}},
        {"model": "meta-llama/Llama-2-7b-hf", "stages": [{"stage": "gptq", "bits": 4}]},
    )
    from huggingface_hub import ModelCard

    data = ModelCard(card).data
    assert data.base_model == "meta-llama/Llama-2-7b-hf" and data.license == "llama2"
    assert data.pipeline_tag == "text-generation" and data.base_model_relation == "quantized"
    assert "| perplexity (wiki.txt, 40 windows x 512 tokens) | 10.0000 | 10.5000 |" in card
    assert "| piqa acc | 0.7000 | 0.6900 |" in card and "limit 200, 0-shot, lm-eval 0.4.13" in card
    assert "c4.jsonl: 128 windows x 2048 tokens, seed 0" in card and "/data" not in card


def test_every_shipped_recipe_exports_or_says_why_not():
    """A shipped recipe either refuses at quantize time what compressed-tensors cannot hold (`target:`) or says in
    an `# Export:` comment whether and where its checkpoint exports; the quickstart's does."""
    for recipe in sorted((ROOT / "recipes").glob("*.yaml")):
        text = recipe.read_text()
        assert "\ntarget: compressed-tensors\n" in text or "\n# Export: " in f"\n{text}", recipe.name
    assert "\ntarget: compressed-tensors\n" in (ROOT / "recipes" / "quickstart-stories260k.yaml").read_text()


def test_quantize_warns_once_when_the_checkpoint_will_not_export(tmp_path, cli):
    recipe = write_recipe(
        tmp_path / "r.yaml",
        f"model: {STORIES}\nstages:\n  - stage: rtn\n    bits: 4\n    group_size: 32\noutput: {tmp_path / 'o'}\n",
    )
    res = cli("quantize", str(recipe), "--dry-run")
    assert res.exit_code == 0, res.output
    warnings = [ln for ln in res.stderr.splitlines() if "will not export to compressed-tensors" in ln]
    assert (
        len(warnings) == 1
        and "partial group" in warnings[0]
        and "model.layers.0.mlp.down_proj" in warnings[0]
    )
    fine = write_recipe(
        tmp_path / "fine.yaml",
        f"model: {STORIES}\nstages:\n  - stage: rtn\n    bits: 4\n    group_size: 4\noutput: {tmp_path / 'o'}\n",
    )
    res = cli("quantize", str(fine), "--dry-run")
    assert res.exit_code == 0 and "will not export" not in res.stderr, res.output


def test_eval_labels_a_foreign_checkpoint_by_its_scheme_and_dequantizes_what_does_not_load(stories):
    """`qtool eval` of an export names its scheme (not "original"); the asymmetric export, which this
    transformers cannot load as stored, is evaluated dequantized with a note, and gives the checkpoint's
    perplexity; `--dequantize` asks for that load outright."""
    args = ["--text", TINY_SAMPLE, "--seq-len", "64", "--windows", "2", "--json"]
    native = json.loads(run_cli(["eval", stories / "asym", *args]).stdout)
    res = run_cli(["eval", stories / "asym-ct", *args])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["kind"] == "compressed-tensors W4A16 g4 asym checkpoint, dequantized", out["kind"]
    assert "did not load as stored" in res.stderr and "evaluating it dequantized" in res.stderr
    assert out["perplexity"] == pytest.approx(native["perplexity"], rel=1e-5)
    res = run_cli(["eval", stories / "sym-ct", *args, "--dequantize"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["kind"] == "compressed-tensors W4A16 g4 sym checkpoint, dequantized"
    plain = json.loads(run_cli(["eval", stories / "sym-ct", *args]).stdout)
    assert plain["kind"] == "compressed-tensors W4A16 g4 sym checkpoint"


_LOWEST = """
import json, sys, torch
import compressed_tensors
from transformers import AutoModelForCausalLM
import qtool
ckpt, out = sys.argv[1], sys.argv[2]
qtool.export(ckpt, out)
ids = torch.randint(3, 500, (1, 48), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    want = qtool.load(ckpt)(ids).logits
    got = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)(ids).logits
print(json.dumps({"version": compressed_tensors.__version__, "equal": bool(torch.equal(got, want))}))
"""


@pytest.mark.slow
def test_export_with_the_lowest_compressed_tensors_allowed(stories, tmp_path):
    """pyproject.toml allows compressed-tensors from 0.17 (vLLM's CPU build pins 0.17.0); the export written with
    it loads in transformers with qtool's logits. (The newest is what the suite itself runs with.)"""
    import os
    import subprocess
    import sys

    lowest = "0.17.0"
    pip = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--target",
            str(tmp_path / "ct"),
            f"compressed-tensors=={lowest}",
        ],
        capture_output=True,
        text=True,
    )
    if pip.returncode != 0:
        if os.environ.get("CI"):
            pytest.fail(f"pip could not install compressed-tensors {lowest}: {pip.stderr[-500:]}")
        pytest.skip(f"compressed-tensors {lowest} not installable here (no index)")
    run = subprocess.run(
        [sys.executable, "-c", _LOWEST, str(stories / "sym"), str(tmp_path / "sym-ct")],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": f"{tmp_path / 'ct'}:{ROOT}"},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout.strip().splitlines()[-1]) == {"version": lowest, "equal": True}
