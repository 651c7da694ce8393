"""QoQ's transforms other than rotate (smooth_attention, smooth, reorder) and the kv_cache scheme.

Function preservation: the model's logits before and after the transform, relative error = max |after − before| /
max |before|. The pipeline runs them as it does in a recipe (block by block, on calibration windows)."""

from __future__ import annotations

import json

import pytest
import torch

from qtool.calibration.capture import block_output
from qtool.console import Reporter
from qtool.errors import CheckpointError
from qtool.kv_cache.quantized import dequantize_kv, install_kv_cache, kv_scheme, quantize_kv
from qtool.models.loading import load_model
from qtool.pipeline import quantize_model
from qtool.recipe import load_recipe

from conftest import STORIES, TINY_SAMPLE, TINYSTORIES, WIKITEXT, write_recipe

TRANSFORMS = """
  - stage: reorder
  - stage: smooth_attention
  - stage: smooth
    alpha: 0.3
"""


def _recipe(
    tmp_path, model, stages: str, dtype: str = "float32", samples: int = 2, seq: int = 64, source=TINY_SAMPLE
):
    return load_recipe(
        write_recipe(
            tmp_path / "r.yaml",
            f"""
model: {model}
calibration: {{source: {source}, num_samples: {samples}, seq_len: {seq}}}
stages:{stages}
settings: {{device: cpu, dtype: {dtype}}}
output: {tmp_path / "out"}
""",
        )
    )


def _ids(tokenizer, n: int = 48) -> torch.Tensor:
    text = WIKITEXT.read_text(encoding="utf-8")[:2_000]
    return tokenizer(text, return_tensors="pt").input_ids[:, :n]


def _rel(after: torch.Tensor, before: torch.Tensor) -> float:
    return ((after.double() - before.double()).abs().max() / before.double().abs().max()).item()


@torch.no_grad()
def _transformed(tmp_path, model_dir, stages: str, dtype: str, **kw):
    recipe = _recipe(tmp_path, model_dir, stages, dtype, **kw)
    qm = quantize_model(recipe, Reporter(quiet=True))
    ref, tok, _, _ = load_model(str(model_dir), getattr(torch, dtype))
    ids = _ids(tok)
    return _rel(qm.model(ids).logits, ref(ids).logits), qm


@pytest.mark.slow
def test_transforms_preserve_smollm2_float64(tmp_path, smollm2):
    rel, qm = _transformed(tmp_path, smollm2, TRANSFORMS, "float64", source=WIKITEXT)
    assert rel <= 1e-4, rel
    stages = {r["stage"] for r in qm.transforms}
    assert stages == {"reorder", "smooth_attention", "smooth"}
    assert all(r["channels_moved"]["mlp.down_proj"] > 0 for r in qm.transforms if r["stage"] == "reorder")


@pytest.mark.parametrize("stage", ["reorder", "smooth_attention", "smooth"])
def test_each_transform_preserves_stories260k(tmp_path, stage):
    rel, _ = _transformed(tmp_path, STORIES, f"\n  - stage: {stage}\n", "float64")
    assert rel <= 1e-10, rel


def test_transforms_preserve_tiny_llama_with_gqa_and_odd_widths(tmp_path, tiny_llama):
    # Random weights have no outlier structure, so every α and order is exercised on non-trivial values.
    rel, _ = _transformed(tmp_path, tiny_llama, TRANSFORMS, "float64")
    assert rel <= 1e-10, rel


def test_transforms_preserve_stories260k_in_float16_weights(tmp_path):
    """fp16 acceptance: the transformed weights rounded to float16 (the checkpoint's dtype) against the original
    float16 weights, both computed in float32."""
    _, qm = _transformed(tmp_path, STORIES, TRANSFORMS, "float32")
    ref, tok, _, _ = load_model(str(STORIES), torch.float32)
    ids = _ids(tok)
    with torch.no_grad():
        before = ref.half().float()(ids).logits
        after = qm.model.half().float()(ids).logits
    assert _rel(after, before) <= 1e-2


def _block_context(stage: str, index: int = 0):
    """The first block of stories260K (float64) with 4 TinyStories windows, and the recipe's transform."""
    from qtool.calibration.capture import capture_block_inputs
    from qtool.stages import STAGES
    from qtool.stages.base import BlockContext, Targets

    model, tok, adapter, _ = load_model(str(STORIES), torch.float64)
    ids = tok(TINYSTORIES.read_text(encoding="utf-8")[:20_000], return_tensors="pt").input_ids[0][:512]
    inputs, kwargs = capture_block_inputs(
        model, adapter.blocks(model), ids.reshape(4, 128), torch.device("cpu")
    )
    block = adapter.blocks(model)[index]
    ctx = BlockContext(
        block, index, adapter.block_prefix(index), adapter, model.config, inputs, kwargs[index], {}
    )
    cls = STAGES[stage]
    return ctx, cls(cls.options_cls(), Targets(), 0)


def test_smooth_attention_flattens_key_channels():
    """After SmoothAttention the largest key channel is closer to the typical one (the point of Eq. 8)."""
    from qtool.stages.smooth_attention import attention_shape, key_absmax

    ctx, stage = _block_context("smooth_attention")
    _, kv, dim = attention_shape(ctx.config)
    before = key_absmax(ctx, kv, dim)
    stage.apply_block(ctx)
    after = key_absmax(ctx, kv, dim)

    def spread(a):  # largest channel over the median channel, per KV head
        return (a.amax(dim=1) / a.median(dim=1).values).max().item()

    assert spread(after) < 0.75 * spread(before), (spread(before), spread(after))


def test_reorder_sorts_channels_by_salience():
    """After reorder, the down_proj input channels come in decreasing max|X| over the calibration tokens, and
    o_proj's within each head; the block's output is unchanged."""
    ctx, stage = _block_context("reorder")
    with torch.no_grad():
        before = [block_output(ctx.block(x, **ctx.kwargs)) for x in ctx.inputs]
    stage.apply_block(ctx)
    xs = ctx.capture(["mlp.down_proj", "self_attn.o_proj"])
    down = torch.cat(xs["mlp.down_proj"]).abs().amax(dim=0)
    assert bool((down[:-1] >= down[1:]).all())
    o = torch.cat(xs["self_attn.o_proj"]).abs().amax(dim=0).reshape(ctx.config.num_attention_heads, -1)
    heads, kv = ctx.config.num_attention_heads, ctx.config.num_key_value_heads
    per_kv = o.reshape(kv, heads // kv, -1).amax(dim=1)
    assert bool((per_kv[:, :-1] >= per_kv[:, 1:]).all())
    with torch.no_grad():
        after = [block_output(ctx.block(x, **ctx.kwargs)) for x in ctx.inputs]
    assert max(_rel(a, b) for a, b in zip(after, before, strict=True)) <= 1e-12


def test_quantize_kv_grid():
    torch.manual_seed(0)
    x = torch.randn(3, 2, 17, 64) * torch.linspace(0.1, 10, 64)
    for bits in (4, 8):
        c = quantize_kv(x, bits)
        assert c.codes.dtype == torch.uint8 and int(c.codes.max()) <= (1 << bits) - 1
        assert c.scale.dtype == torch.float16 and c.zero.dtype == torch.float16
        err = (dequantize_kv(c, torch.float32) - x).abs()
        # Half a step, plus the float16 rounding of the zero point (which moves every value by up to
        # |zero|·2^-11 steps).
        bound = c.scale.float() * (0.5 + c.zero.float().abs() * 2.0**-10)
        assert bool((err <= bound).all())
        # A vector already on its grid maps to itself: re-quantizing at each decode step changes nothing.
        again = dequantize_kv(quantize_kv(dequantize_kv(c, torch.float32), bits), torch.float32)
        assert torch.allclose(
            again, dequantize_kv(c, torch.float32), rtol=0, atol=1e-3 * float(c.scale.max())
        )
    flat = quantize_kv(torch.full((1, 8), 0.75), 4)
    assert torch.equal(dequantize_kv(flat, torch.float32), torch.full((1, 8), 0.75))


def test_kv_cache_stage_writes_scheme_and_loader_installs_it(tmp_path, cli):
    """KV8 costs nothing measurable, KV4 costs perplexity on stories260K (head_dim 8), the scheme is stored and
    the loaded checkpoint runs it; `generate` with a cache gives what a cache-less forward gives."""
    from qtool.checkpoint.loader import load_checkpoint

    common = (
        f"calibration: {{source: {TINY_SAMPLE}, num_samples: 2, seq_len: 64}}\n"
        f"eval: {{text: {TINYSTORIES}, seq_len: 256, max_windows: 6, separator: '<|endoftext|>'}}\n"
        f"model: {STORIES}\n"
    )
    ppl = {}
    for bits in (8, 4):
        path = write_recipe(
            tmp_path / f"kv{bits}.yaml",
            common
            + f"""
stages:
  - stage: kv_cache
    bits: {bits}
  - stage: rtn
    bits: 8
    group_size: null
output: {tmp_path / f"kv{bits}"}
""",
        )
        r = cli("quantize", path, "--json", "-q")
        assert r.exit_code == 0, r.output
        ev = json.loads(r.output)["eval"]
        ppl[bits] = (ev["original"]["perplexity"], ev["quantized"]["perplexity"])
    fp = ppl[8][0]
    assert ppl[8][1] < fp * 1.01
    assert ppl[4][1] > ppl[8][1] * 1.05
    cfg = json.loads((tmp_path / "kv4" / "config.json").read_text())["quantization_config"]
    assert cfg["kv_cache"] == kv_scheme(4)
    model = load_checkpoint(tmp_path / "kv4")
    assert all(
        getattr(m, "qtool_kv_bits", None) == 4
        for m in model.model.layers.modules()
        if m.__class__.__name__.endswith("Attention")
    )
    ids = torch.tensor([[1, 45, 67, 89, 200, 13, 7, 300]])
    with torch.no_grad():
        gen = model.generate(ids, max_new_tokens=6, do_sample=False)
        full = model(gen[:, :-1]).logits[0, ids.shape[1] - 1 :].argmax(-1)
    assert torch.equal(gen[0, ids.shape[1] :], full)


def test_kv_cache_scheme_errors():
    model, _, _, _ = load_model(str(STORIES), torch.float32)
    with pytest.raises(CheckpointError, match="quantization_config.kv_cache: found .*expected"):
        install_kv_cache(model, {"bits": 3}, "ckpt/config.json: quantization_config.kv_cache")


@pytest.mark.parametrize(
    "stages, message",
    [
        ("\n  - stage: rtn\n    bits: 4\n  - stage: smooth\n", "transform 'smooth' comes after quantizer"),
        ("\n  - stage: smooth\n    alpha_grid: []\n", "alpha_grid: found"),
        ("\n  - stage: smooth_attention\n    alpha: 2\n", "alpha"),
        ("\n  - stage: kv_cache\n    bits: 2\n", "bits"),
    ],
)
def test_transform_recipe_errors(tmp_path, cli, stages, message):
    path = write_recipe(
        tmp_path / "r.yaml",
        f"""
model: {STORIES}
calibration: {{source: {TINY_SAMPLE}, num_samples: 2, seq_len: 64}}
stages:{stages}
output: {tmp_path / "out"}
""",
    )
    r = cli("quantize", path)
    assert r.exit_code == 3
    assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_stats_file_with_transforms_is_refused(tmp_path, cli):
    stats = tmp_path / "stats.safetensors"
    stats.write_bytes(b"x")
    path = write_recipe(
        tmp_path / "r.yaml",
        f"""
model: {STORIES}
calibration: {{source: {TINY_SAMPLE}, num_samples: 2, seq_len: 64, stats: {stats}}}
stages:
  - stage: smooth
  - stage: rtn
    bits: 4
output: {tmp_path / "out"}
""",
    )
    r = cli("quantize", path)
    assert r.exit_code == 3 and "calibration.stats" in r.stderr and "smooth" in r.stderr


def test_smooth_searches_under_the_claiming_quantizer(tmp_path):
    """With a W4A8 quantizer claiming o_proj/down_proj, the α search scores the quantized output error (not the
    float one, which is the same for every α up to rounding), and what it picks is what the stage recorded."""
    recipe = _recipe(
        tmp_path,
        STORIES,
        """
  - stage: smooth
    alpha_grid: [0.0, 0.5]
  - stage: progressive
    bits: 4
    group_size: null
""",
        samples=2,
        seq=64,
    )
    qm = quantize_model(recipe, Reporter(quiet=True))
    records = [r for r in qm.transforms if r["stage"] == "smooth"]
    assert len(records) == 5
    for r in records:
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            assert r[name]["alpha"] in (0.0, 0.5)
            assert r[name]["error"] > 1e-8  # W4A8 rounding error, far above float error


@pytest.mark.parametrize(
    "name", ["qoq-w4a8kv4-chn", "qoq-w4a8kv4-g128", "rotate-gptq-w4a16-g128", "smooth-attention-kv4"]
)
def test_shipped_qoq_recipes_validate(name):
    from conftest import ROOT

    recipe = load_recipe(ROOT / "recipes" / f"{name}.yaml", {"model": str(STORIES)})
    assert recipe.transforms()


def test_g128_recipe_refuses_smollm2_before_loading(cli, smollm2, tmp_path):
    from conftest import ROOT

    r = cli("quantize", ROOT / "recipes" / "qoq-w4a8kv4-g128.yaml", "--model", smollm2, "-o", tmp_path / "o")
    assert r.exit_code == 3
    assert "group_size: found 128" in r.stderr and "in_features 576" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "o").exists()
