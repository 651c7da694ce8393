"""Quantize → pack → load on tiny random Llama and OPT models: round trip, determinism, sharding, and every
way a checkpoint can be broken."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from qtool.checkpoint.loader import read_config
from qtool.checkpoint.manifest import file_sha256

from conftest import TINY_SAMPLE, write_recipe

RECIPE = """
model: {model}
calibration:
  source: {text}
  num_samples: 8
  seq_len: 64
stages:
  - stage: gptq
    bits: 4
    group_size: 32
    symmetric: false
  - stage: rtn
    bits: 8
    group_size: null
    targets:
      include: ["{last}"]
eval:
  text: {text}
  seq_len: 64
  max_windows: 4
settings:
  max_shard_size: {shard}
output: {out}
"""


def _fix_gptq_targets(text: str, last: str) -> str:
    return text.replace(
        "    symmetric: false\n", f"    symmetric: false\n    targets:\n      exclude: ['{last}']\n", 1
    )


def make_recipe(tmp: Path, model: Path, last: str, out: str = "ckpt", shard: str = "5GB") -> Path:
    text = RECIPE.format(model=model, text=TINY_SAMPLE, last=last, out=out, shard=shard)
    return write_recipe(tmp / f"{out}.yaml", _fix_gptq_targets(text, last))


def quantize(cli, recipe: Path, *extra) -> dict:
    res = cli("quantize", recipe, "--json", *extra)
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


@pytest.fixture(scope="module")
def llama_ckpt(tmp_path_factory, tiny_llama):
    from click.testing import CliRunner

    from qtool.cli import cli as group

    tmp = tmp_path_factory.mktemp("llama-ckpt")
    recipe = make_recipe(tmp, tiny_llama, "*.down_proj")
    res = CliRunner().invoke(group, ["quantize", str(recipe), "--json"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return tmp / "ckpt", json.loads(res.stdout), recipe


def test_llama_round_trip_matches_in_memory_quantization(llama_ckpt):
    import qtool
    from qtool.eval.perplexity import perplexity
    from qtool.recipe import EvalSpec

    ckpt, summary, _ = llama_ckpt
    model = qtool.load(ckpt)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpt)
    ppl = perplexity(model, tok, EvalSpec(text=str(TINY_SAMPLE), seq_len=64, max_windows=4), "cpu")
    # The loaded checkpoint computes exactly what the pipeline evaluated in memory.
    assert ppl["perplexity"] == pytest.approx(summary["eval"]["quantized"]["perplexity"], rel=1e-5)
    layers = read_config(ckpt)["quantization_config"]["layers"]
    assert len(layers) == 2 * 7
    assert layers["model.layers.0.mlp.down_proj"]["bits"] == 8
    assert layers["model.layers.0.mlp.down_proj"]["group_size"] is None
    assert layers["model.layers.1.self_attn.q_proj"] == {
        "format": "grouped_int",
        "bits": 4,
        "group_size": 32,
        "symmetric": False,
        "in_features": 96,
        "out_features": 96,
        "bias": False,
    }
    q = model.get_submodule("model.layers.1.self_attn.q_proj")
    assert q.dequantize().shape == (96, 96) and q.scales.dtype == torch.float16
    manifest = json.loads((ckpt / "qtool-manifest.json").read_text())
    assert manifest["calibration"]["num_samples"] == 8 and len(manifest["calibration"]["data_sha256"]) == 64
    assert set(manifest["files"]) >= {"model.safetensors", "config.json", "recipe.yaml", "tokenizer.json"}
    assert 4.0 < manifest["bits_per_weight"]["quantized_linears"] < 8.5


def test_same_recipe_and_seed_give_byte_identical_checkpoint(cli, llama_ckpt, tmp_path):
    ckpt, _, recipe = llama_ckpt
    out = tmp_path / "again"
    quantize(cli, recipe, "--output", out)
    names = sorted(p.name for p in ckpt.iterdir())
    assert names == sorted(p.name for p in out.iterdir())
    for name in names:
        assert (ckpt / name).read_bytes() == (out / name).read_bytes(), name


def test_existing_output_is_refused_without_overwrite(cli, llama_ckpt):
    ckpt, _, recipe = llama_ckpt
    res = cli("quantize", recipe, "--output", ckpt)
    assert res.exit_code == 2 and "already exists" in res.output and "--overwrite" in res.output


def test_opt_quantizes_loads_and_keeps_biases(cli, tiny_opt, tmp_path):
    import qtool

    summary = quantize(cli, make_recipe(tmp_path, tiny_opt, "*.fc2"))
    model = qtool.load(tmp_path / "ckpt")
    fc1 = model.get_submodule("model.decoder.layers.0.fc1")
    assert fc1.bias is not None and fc1.spec.bits == 4
    assert summary["quantized_linears"] == 2 * 6
    x = torch.randint(0, 512, (1, 16))
    assert torch.isfinite(model(x).logits).all()


def test_sharded_checkpoint_and_repack(cli, tiny_llama, tmp_path):
    import qtool

    quantize(cli, make_recipe(tmp_path, tiny_llama, "*.down_proj", shard="40KB"))
    ckpt = tmp_path / "ckpt"
    shards = sorted(p.name for p in ckpt.glob("model-*.safetensors"))
    assert len(shards) > 1 and (ckpt / "model.safetensors.index.json").is_file()
    res = cli("pack", ckpt, "-o", tmp_path / "one", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["verified"] is True
    assert (tmp_path / "one" / "model.safetensors").is_file()
    a, b = qtool.load(ckpt), qtool.load(tmp_path / "one")
    x = torch.randint(0, 512, (1, 12))
    assert torch.equal(a(x).logits, b(x).logits)


# ---- broken checkpoints -------------------------------------------------------------------------------


@pytest.fixture
def broken(llama_ckpt, tmp_path):
    import shutil

    ckpt, _, _ = llama_ckpt
    dst = tmp_path / "broken"
    shutil.copytree(ckpt, dst)
    return dst


def _rehash(ckpt: Path, name: str) -> None:
    mpath = ckpt / "qtool-manifest.json"
    m = json.loads(mpath.read_text())
    m["files"][name] = file_sha256(ckpt / name)
    m["sizes"][name] = (ckpt / name).stat().st_size
    mpath.write_text(json.dumps(m))


def _rewrite_tensors(ckpt: Path, edit) -> None:
    t = load_file(str(ckpt / "model.safetensors"))
    edit(t)
    save_file(t, str(ckpt / "model.safetensors"))
    _rehash(ckpt, "model.safetensors")


def _eval_error(cli, ckpt: Path) -> str:
    res = cli("eval", ckpt, "--text", TINY_SAMPLE, "--seq-len", "32", "--windows", "1", "--quiet")
    assert res.exit_code == 5, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("qtool: error: "), res.output
    return lines[0]


def test_load_checks_sizes_and_pack_verify_hashes(cli, broken, monkeypatch):
    import qtool
    import qtool.checkpoint.loader as loader

    # Loading and `pack --quick` check sizes and headers only: no file is hashed.
    with monkeypatch.context() as m:

        def no_hash(path):
            raise AssertionError(f"{path} hashed")

        m.setattr(loader, "file_sha256", no_hash)
        qtool.load(broken)
        res = cli("pack", broken, "--quick", "--json")
        assert res.exit_code == 0 and json.loads(res.stdout)["verified"] is False, res.output
    data = bytearray((broken / "model.safetensors").read_bytes())
    data[-10] ^= 0xFF
    (broken / "model.safetensors").write_bytes(bytes(data))
    res = cli("pack", broken, "--verify", "--json")
    assert res.exit_code == 5 and "model.safetensors: sha256 does not match" in res.output, res.output
    with open(broken / "tokenizer.json", "a") as f:
        f.write(" ")
    res = cli("pack", broken, "--quick")
    assert res.exit_code == 5 and "tokenizer.json: " in res.output and "the manifest records" in res.output
    assert cli("pack", broken, "--quick", "-o", broken.parent / "copy").exit_code == 2


def test_missing_tensor(cli, broken):
    _rewrite_tensors(broken, lambda t: t.pop("model.layers.1.mlp.up_proj.scales"))
    assert "tensor model.layers.1.mlp.up_proj.scales: missing" in _eval_error(cli, broken)


def test_misshaped_tensor(cli, broken):
    def edit(t):
        t["model.layers.0.self_attn.k_proj.qweight"] = t["model.layers.0.self_attn.k_proj.qweight"][
            :, :-1
        ].contiguous()

    _rewrite_tensors(broken, edit)
    msg = _eval_error(cli, broken)
    assert "tensor model.layers.0.self_attn.k_proj.qweight: found torch.int32" in msg and "expected" in msg


def test_misshaped_plain_tensor(cli, broken):
    _rewrite_tensors(broken, lambda t: t.update({"model.norm.weight": torch.ones(5, dtype=torch.float32)}))
    assert "tensor model.norm.weight: found shape [5], expected [96]" in _eval_error(cli, broken)


def test_unknown_format_version(cli, broken):
    m = json.loads((broken / "qtool-manifest.json").read_text())
    m["format_version"] = 99
    (broken / "qtool-manifest.json").write_text(json.dumps(m))
    assert "format_version 99 is unknown" in _eval_error(cli, broken)


def test_unknown_layer_format(cli, broken):
    cfg = read_config(broken)  # written back in the per-layer form (format version 1), which qtool reads
    cfg["quantization_config"]["format_version"] = 1
    cfg["quantization_config"]["layers"]["model.layers.0.mlp.up_proj"]["format"] = "nf4"
    (broken / "config.json").write_text(json.dumps(cfg))
    _rehash(broken, "config.json")
    assert "has format 'nf4'" in _eval_error(cli, broken)


def test_not_a_checkpoint(cli, tmp_path):
    (tmp_path / "x").mkdir()
    res = cli("pack", tmp_path / "x")
    assert res.exit_code == 5 and "not a qtool checkpoint" in res.output


def test_unsupported_architecture(cli, tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64)).save_pretrained(
        tmp_path / "gpt2"
    )
    recipe = write_recipe(
        tmp_path / "r.yaml", f"model: {tmp_path / 'gpt2'}\nstages:\n  - stage: rtn\noutput: o\n"
    )
    res = cli("quantize", recipe)
    assert res.exit_code == 4
    assert (
        "architecture GPT2LMHeadModel is not supported: GPT2LMHeadModel has no list of repeated" in res.output
    )
    assert "expected one of Gemma2ForCausalLM" in res.output and "LlamaForCausalLM" in res.output
    assert "OPTForCausalLM" in res.output and "Traceback" not in res.output


def test_checkpoint_and_export_keep_generation_config_and_the_source_license(tiny_llama, tmp_path, cli):
    """generation_config.json of the source travels into the checkpoint and its export; the model card (written
    through huggingface_hub's ModelCard) takes the license from the source's own card."""
    import shutil

    from huggingface_hub import ModelCard

    src = tmp_path / "src"
    shutil.copytree(tiny_llama, src)
    (src / "README.md").write_text("---\nlicense: apache-2.0\n---\n# a model\n")
    assert (src / "generation_config.json").is_file()
    recipe = write_recipe(
        tmp_path / "r.yaml",
        f"model: {src}\nstages:\n  - stage: rtn\n    bits: 4\n    group_size: 8\n    symmetric: true\n"
        f"output: {tmp_path / 'ckpt'}\n",
    )
    assert cli("quantize", str(recipe)).exit_code == 0
    res = cli("export", str(tmp_path / "ckpt"), "--format", "compressed-tensors", "-o", str(tmp_path / "ct"))
    assert res.exit_code == 0, res.output
    want = json.loads((src / "generation_config.json").read_text())
    for folder in (tmp_path / "ckpt", tmp_path / "ct"):
        got = json.loads((folder / "generation_config.json").read_text())
        assert {k: got.get(k) for k in ("bos_token_id", "eos_token_id")} == {
            k: want.get(k) for k in ("bos_token_id", "eos_token_id")
        }
        data = ModelCard.load(folder / "README.md").data
        assert data.license == "apache-2.0" and data.pipeline_tag == "text-generation", folder
    assert "compressed-tensors" in ModelCard.load(tmp_path / "ct" / "README.md").data.tags
