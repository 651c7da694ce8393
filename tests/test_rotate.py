"""The `rotate` transform: outputs before and after agree on SmolLM2-135M, stories260K and a tiny Llama; the
rotated model quantizes, saves and reloads untied; activation outliers at the input linears shrink; models and
sizes it cannot rotate are refused with one line before any weight is loaded.

Relative error is max |logits_after − logits_before| / max |logits_before| over all positions and vocabulary.
"""

from __future__ import annotations

import json
from contextlib import contextmanager

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from qtool.errors import RecipeError
from qtool.models.loading import load_model
from qtool.stages.base import Targets
from qtool.stages.rotate import RotateOptions, RotateStage

from conftest import STORIES, TINY_SAMPLE, WIKITEXT, _save_tiny, write_recipe


def _stage(**opts) -> RotateStage:
    return RotateStage(RotateOptions(**opts), Targets(), 0)


def _windows(tokenizer, n: int, length: int) -> torch.Tensor:
    text = WIKITEXT.read_text(encoding="utf-8")[:4_000]
    ids = tokenizer(text, return_tensors="pt").input_ids[0]
    return torch.stack([ids[i * length : (i + 1) * length] for i in range(n)])


def _rel(after: torch.Tensor, before: torch.Tensor) -> float:
    return ((after.double() - before.double()).abs().max() / before.double().abs().max()).item()


@torch.no_grad()
def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model(ids).logits


@contextmanager
def _outliers(model, linears: tuple[str, ...]):
    """Records max |x| / rms(x) of the inputs of each named linear in every block (x over all tokens and
    channels) during the forwards run inside the `with`."""
    got: dict[str, list[float]] = {n: [] for n in linears}

    def make_hook(name: str):
        def hook(module, args, output):
            x = args[0].double()
            got[name].append((x.abs().max() / x.pow(2).mean().sqrt()).item())

        return hook

    handles = [
        layer.get_submodule(n).register_forward_hook(make_hook(n))
        for layer in model.model.layers
        for n in linears
    ]
    try:
        yield got
    finally:
        for h in handles:
            h.remove()


LINEARS = ("self_attn.q_proj", "mlp.gate_proj")


@pytest.fixture(scope="module")
def smollm2_rotated(smollm2):
    """SmolLM2-135M on WikiText windows, before and after rotate: float64 logits, the input outliers of q_proj
    and gate_proj, and logits with the rotated weights rounded back to the checkpoint's float16."""
    # Loaded in its own float16 and widened: the float64 weights are exactly the checkpoint's values.
    model, tok, adapter, _ = load_model(str(smollm2), torch.float16)
    model.double()
    ids = _windows(tok, 2, 16)
    with _outliers(model, LINEARS) as out_before:
        before = _logits(model, ids)
    info = _stage().apply_model(model, adapter)
    with _outliers(model, LINEARS) as out_after:
        after = _logits(model, ids)
    untied = model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    final_norm = model.model.norm.weight.clone()
    # float16: the rotated weights as the checkpoint stores them, computed in float32 (the pipeline's CPU dtype;
    # CPU float16 matmuls are several times slower). stories260K runs a true float16 forward below.
    model.half().float()
    half = _logits(model, ids)
    return dict(
        info=info,
        before=before,
        after=after,
        half=half,
        out_before=out_before,
        out_after=out_after,
        untied=untied,
        tie_flag=model.config.tie_word_embeddings,
        final_norm=final_norm,
    )


@pytest.mark.slow
def test_smollm2_float64_outputs_agree(smollm2_rotated):
    r = smollm2_rotated
    assert r["info"] == {"hidden_size": 576, "matrix": "hadamard 36x16 (paley2 q=17)", "untied_head": True}
    # HF's RMSNorm normalizes in float32 even in a float64 model, so agreement stops near 1e-7, not 1e-15.
    rel = _rel(r["after"], r["before"])
    print(f"SmolLM2 float64: max relative error {rel:.2e}")
    assert rel <= 1e-4
    assert r["untied"] and r["tie_flag"] is False
    assert torch.equal(r["final_norm"], torch.ones_like(r["final_norm"]))


@pytest.mark.slow
def test_smollm2_float16_weights_agree(smollm2_rotated):
    rel = _rel(smollm2_rotated["half"], smollm2_rotated["before"])
    print(f"SmolLM2 float16 weights: max relative error {rel:.2e}")
    assert rel <= 1e-2


@pytest.mark.slow
def test_smollm2_rotation_flattens_input_outliers(smollm2_rotated):
    out_before, out_after = smollm2_rotated["out_before"], smollm2_rotated["out_after"]
    for name in LINEARS:
        b, a = torch.tensor(out_before[name]), torch.tensor(out_after[name])
        print(
            f"{name} inputs, max|x|/rms over 30 blocks: median {b.median():.1f} -> {a.median():.1f}, "
            f"worst {b.max():.1f} -> {a.max():.1f}"
        )
        assert a.median() < 0.5 * b.median()
        assert a.max() < 0.5 * b.max()


@pytest.mark.parametrize("opts", [{}, {"random_signs": True, "seed": 5}])
def test_stories260k_float64_and_float16(opts):
    for dtype, bound in ((torch.float64, 1e-4), (torch.float16, 1e-2)):
        model, tok, adapter, _ = load_model(str(STORIES), dtype)
        ids = _windows(tok, 2, 64)
        before = _logits(model, ids)
        info = _stage(**opts).apply_model(model, adapter)
        assert info["matrix"].startswith("hadamard 64 (sylvester)")
        assert ("random signs" in info["matrix"]) == bool(opts)
        after = _logits(model, ids)
        assert after.dtype == dtype and bool(after.isfinite().all())
        assert _rel(after, before) <= bound, dtype


def test_tiny_llama_hidden_96(tiny_llama):
    model, tok, adapter, _ = load_model(str(tiny_llama), torch.float64)
    ids = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(0))
    # Random norm scales, so folding them is exercised (a fresh model's are all ones).
    with torch.no_grad():
        for m in model.modules():
            if type(m).__name__ == "LlamaRMSNorm":
                m.weight.uniform_(0.5, 2.0)
    before = _logits(model, ids)
    info = _stage().apply_model(model, adapter)
    assert info["matrix"] == "hadamard 12x8 (paley1 q=11)" and info["untied_head"]
    assert _rel(_logits(model, ids), before) <= 1e-4


def _llama_without_hadamard(tmp_path):
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=52,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    return _save_tiny(LlamaForCausalLM(cfg).eval(), tmp_path / "llama52")


def test_random_fallback_for_hidden_size_without_hadamard(tmp_path):
    path = _llama_without_hadamard(tmp_path)
    model, _, adapter, _ = load_model(str(path), torch.float64)
    ids = torch.randint(0, 512, (1, 30), generator=torch.Generator().manual_seed(0))
    before = _logits(model, ids)
    stage = _stage(fallback="random", seed=1)
    stage.check_config(model.config, "r.yaml:stages[0]")
    info = stage.apply_model(model, adapter)
    assert info["matrix"].startswith("random orthogonal 52 (seed 1")
    assert _rel(_logits(model, ids), before) <= 1e-4


ROTATE_RTN = """
model: {model}
stages:
  - stage: rotate
{rotate}  - stage: rtn
    bits: 4
    group_size: 32
    symmetric: false
eval:
  text: {text}
  seq_len: 64
  max_windows: 4
output: {out}
"""


def _recipe(tmp_path, model, rotate: str = "", out: str = "ckpt"):
    return write_recipe(
        tmp_path / "r.yaml", ROTATE_RTN.format(model=model, rotate=rotate, text=TINY_SAMPLE, out=out)
    )


def test_rotate_then_rtn_checkpoint_reloads_and_matches(cli, tmp_path):
    from qtool.checkpoint.loader import load_checkpoint
    from qtool.console import Reporter
    from qtool.pipeline import quantize_model
    from qtool.recipe import load_recipe

    recipe = _recipe(tmp_path, STORIES)
    res = cli("quantize", recipe, "--json")
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    ckpt = tmp_path / "ckpt"
    config = json.loads((ckpt / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    manifest = json.loads((ckpt / "qtool-manifest.json").read_text())
    assert manifest["transforms"] == [
        {"stage": "rotate", "hidden_size": 64, "matrix": "hadamard 64 (sylvester)", "untied_head": True}
    ]

    loaded = load_checkpoint(ckpt)
    assert loaded.lm_head.weight.data_ptr() != loaded.model.embed_tokens.weight.data_ptr()
    memory = quantize_model(load_recipe(recipe), Reporter(quiet=True)).model
    ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))
    assert torch.allclose(_logits(loaded, ids), _logits(memory, ids), rtol=0, atol=1e-5)
    # 4-bit weights on a rotated model stay close to the original (a wrong rotation or lost head would not).
    ev = summary["eval"]
    assert ev["quantized"]["perplexity"] < 1.5 * ev["original"]["perplexity"]


def _one_line_error(result, *fragments: str) -> str:
    assert result.exit_code == 3, result.output
    # stdout holds the same error as a JSON object (--json); the line is on stderr.
    assert json.loads(result.stdout)["error"]["kind"] == "recipe", result.stdout
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("qtool: error: "), result.output
    for f in fragments:
        assert f in lines[0], (f, lines[0])
    return lines[0]


def test_hidden_size_without_hadamard_is_refused(cli, tmp_path):
    path = _llama_without_hadamard(tmp_path)
    res = cli("quantize", _recipe(tmp_path, path), "--json")
    _one_line_error(res, "r.yaml:stages[0]", "hidden size 52", "fallback: random")
    assert not (tmp_path / "ckpt").exists()


def test_opt_is_refused_naming_its_layernorm(cli, tiny_opt, tmp_path):
    res = cli("quantize", _recipe(tmp_path, tiny_opt), "--json")
    _one_line_error(
        res,
        "r.yaml:stages[0]",
        "model.decoder.layers.0.self_attn_layer_norm",
        "LayerNorm",
        "OPTForCausalLM",
        "RMSNorm",
    )
    assert not (tmp_path / "ckpt").exists()


def test_targets_are_refused(cli, tiny_llama, tmp_path):
    res = cli("quantize", _recipe(tmp_path, tiny_llama, "    targets: {exclude: ['*.q_proj']}\n"), "--json")
    _one_line_error(res, "r.yaml:stages[0].targets", "expected no targets")


def test_unknown_fallback_is_refused(cli, tiny_llama, tmp_path):
    res = cli("quantize", _recipe(tmp_path, tiny_llama, "    fallback: identity\n"), "--json")
    _one_line_error(res, "r.yaml:stages[0].fallback", "'identity'", "'error', 'random'")


def test_unknown_architecture_is_refused():
    cfg = LlamaConfig(hidden_size=64)
    cfg.architectures = ["GPT2LMHeadModel"]
    with pytest.raises(
        RecipeError, match=r"^w: architecture GPT2LMHeadModel is not known to rotate; expected"
    ):
        _stage().check_config(cfg, "w")


def test_fold_layernorm_keeps_opt_outputs(tiny_opt):
    from qtool.models.fold import fold_norm_scale

    model, _, adapter, _ = load_model(str(tiny_opt), torch.float64)
    ids = torch.randint(0, 512, (1, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.LayerNorm):
                m.weight.uniform_(0.5, 2.0)
                m.bias.uniform_(-0.5, 0.5)
    before = _logits(model, ids)
    for block in adapter.blocks(model):
        for norm, feeds in adapter.norm_feeds.items():
            fold_norm_scale(block.get_submodule(norm), [block.get_submodule(f) for f in feeds])
    assert _rel(_logits(model, ids), before) <= 1e-10
