"""`qtool export --format gptq` (formats/gptq.md): the tensors, decoded as GPTQ's clients decode them, are qtool's
reference weights bit for bit (symmetric in the first GPTQ format, asymmetric in gptq_v2, zero points of 0
included); the config is one transformers' GPTQConfig accepts; what the format cannot hold is refused with one
line and nothing written."""

from __future__ import annotations

import json

import pytest
import torch

from bad_input import assert_one_line_error, run_cli
from conftest import STORIES, _save_tiny, write_recipe

pytestmark = pytest.mark.skipif(not STORIES.is_dir(), reason="stories260K assets not found")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Random Llama and OPT (biases) whose widths are multiples of 32, as GPTQ's packing needs."""
    from transformers import LlamaConfig, LlamaForCausalLM, OPTConfig, OPTForCausalLM

    root = tmp_path_factory.mktemp("gptq-models")
    torch.manual_seed(0)
    llama = LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    opt = OPTConfig(
        vocab_size=512,
        hidden_size=64,
        ffn_dim=96,
        num_hidden_layers=1,
        num_attention_heads=4,
        max_position_embeddings=256,
        word_embed_proj_dim=64,
    )
    return {
        "llama": _save_tiny(LlamaForCausalLM(llama).eval(), root / "llama"),
        "opt": _save_tiny(OPTForCausalLM(opt).eval(), root / "opt"),
    }


def quantize(tmp, model, name, stages: str):
    recipe = write_recipe(tmp / f"{name}.yaml", f"model: {model}\nstages:\n{stages}output: {tmp / name}\n")
    res = run_cli(["quantize", recipe, "-q", "--no-eval"])
    assert res.exit_code == 0, res.output
    return tmp / name


def rtn(bits, group, sym) -> str:
    return f"  - stage: rtn\n    bits: {bits}\n    group_size: {group}\n    symmetric: {sym}\n"


def gptq_weight(t: dict, name: str, bits: int, offset: int) -> torch.Tensor:
    """The weight [out, in] as AutoGPTQ's torch QuantLinear computes it (zero point = qzeros + 1 in the first
    format; GPTQModel's gptq_v2 adds nothing), written from that algorithm, not from qtool's unpacking."""
    qweight, qzeros, scales, g_idx = (t[f"{name}.{f}"] for f in ("qweight", "qzeros", "scales", "g_idx"))
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    mask = (1 << bits) - 1
    zeros = (torch.bitwise_right_shift(qzeros.unsqueeze(2), shifts.view(1, 1, -1)) & mask).reshape(
        qzeros.shape[0], -1
    ) + offset
    codes = (torch.bitwise_right_shift(qweight.unsqueeze(1), shifts.view(1, -1, 1)) & mask).reshape(
        -1, qweight.shape[1]
    )
    g = g_idx.long()
    w = scales[g].float() * (codes.float() - zeros[g].float())  # [in, out]
    return w.t()


@pytest.mark.parametrize(
    "model,bits,group,sym",
    [
        ("llama", 4, 32, "true"),
        ("llama", 4, 32, "false"),
        ("llama", 8, "null", "true"),
        ("llama", 2, 16, "false"),
        ("opt", 4, 32, "true"),
    ],
)
def test_tensors_decode_to_qtools_reference_weights(models, tmp_path, model, bits, group, sym):
    from safetensors.torch import load_file
    from transformers import GPTQConfig

    import qtool
    from qtool.layouts.grouped_int.module import GroupedIntLinear
    from qtool.models.loading import foreign_scheme

    ckpt = quantize(tmp_path, models[model], "q", rtn(bits, group, sym))
    res = run_cli(["export", ckpt, "--format", "gptq", "-o", tmp_path / "gptq", "--json"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    ref = qtool.load(ckpt)
    names = [n for n, m in ref.named_modules() if isinstance(m, GroupedIntLinear)]
    zero_points = 0  # groups whose zero point is 0: the first GPTQ format cannot store them
    assert summary["quantized_layers"] == len(names) and summary["ignored"] == ["lm_head"]
    tensors = load_file(tmp_path / "gptq" / "model.safetensors")
    for n in names:
        layer = ref.get_submodule(n)
        k, n_out = layer.in_features, layer.out_features
        groups = 1 if group == "null" else k // group
        assert tensors[f"{n}.qweight"].shape == (k * bits // 32, n_out)
        assert tensors[f"{n}.qzeros"].shape == (groups, n_out * bits // 32)
        assert (
            tensors[f"{n}.scales"].shape == (groups, n_out) and tensors[f"{n}.scales"].dtype == torch.float16
        )
        assert tensors[f"{n}.g_idx"].dtype == torch.int32
        offset = 1 if sym == "true" else 0
        assert torch.equal(gptq_weight(tensors, n, bits, offset), layer.dequantize(torch.float32)), n
        if layer.zeros is not None:
            zero_points += int((layer.zeros == 0).sum())
        if layer.bias is not None:
            assert torch.equal(tensors[f"{n}.bias"], layer.bias), n
    assert model != "opt" or any(k.endswith("fc1.bias") for k in tensors)
    assert bits != 2 or zero_points > 0  # the 2-bit asymmetric case exercises them
    config = json.loads((tmp_path / "gptq" / "config.json").read_text())
    q = config["quantization_config"]
    assert config["model_type"] == model and "qtool_model_type" not in config
    fmt = "gptq" if sym == "true" else "gptq_v2"
    assert (q["quant_method"], q["checkpoint_format"], q["bits"], q["desc_act"]) == ("gptq", fmt, bits, False)
    assert summary["compression_format"] == fmt
    assert q["group_size"] == (-1 if group == "null" else group) and q["sym"] == (sym == "true")
    assert json.loads((tmp_path / "gptq" / "quantize_config.json").read_text()) == q
    parsed = GPTQConfig.from_dict(q)
    assert (parsed.bits, parsed.group_size, parsed.sym, parsed.format) == (
        bits,
        q["group_size"],
        q["sym"],
        fmt,
    )
    from transformers import AutoConfig

    label = foreign_scheme(AutoConfig.from_pretrained(tmp_path / "gptq"))
    assert label.startswith(f"gptq W{bits}") and label.endswith("sym" if sym == "true" else "asym")


@pytest.mark.parametrize(
    "model,stages,found",
    [
        ("stories", rtn(4, 4, "true"), "in_features 64, out_features 172"),
        ("llama", rtn(3, 32, "true"), "3-bit codes"),
        (
            "llama",
            rtn(4, 32, "true").replace("rtn\n", 'rtn\n    targets: {exclude: ["*.down_proj"]}\n')
            + rtn(4, "null", "true").replace("rtn\n", 'rtn\n    targets: {include: ["*.down_proj"]}\n'),
            "W4 sym per channel, A16 where model.layers.0.self_attn.q_proj is W4 sym g32, A16",
        ),
        (
            "llama",
            rtn(4, 32, "true").replace("rtn\n", 'rtn\n    targets: {exclude: ["*.down_proj"]}\n'),
            "layer model.layers.0.mlp.down_proj: a linear of a decoder block left in floating point",
        ),
        ("llama", "  - stage: progressive\n    bits: 8\n    group_size: null\n", "qoq layout"),
        ("llama", "  - stage: kv_cache\n    bits: 4\n" + rtn(4, 32, "true"), "quantization_config.kv_cache"),
    ],
    ids=["widths", "3-bit", "two-schemes", "float-in-block", "w8a8", "kv-cache"],
)
def test_refusals_name_the_layer_and_write_nothing(models, tmp_path, model, stages, found):
    ckpt = quantize(tmp_path, STORIES if model == "stories" else models[model], "q", stages)
    res = run_cli(["export", ckpt, "--format", "gptq", "-o", tmp_path / "gptq"])
    assert_one_line_error(res, 2, found, "GPTQ expects weight-only integer layers", output=tmp_path / "gptq")
