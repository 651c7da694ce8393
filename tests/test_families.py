"""The families qtool declares (Llama 3.x, Qwen3, Gemma 2, Gemma 3, Phi-3/4) and the generic fallback (OLMo 2,
Granite), on random-weight models built from each family's own config class (tests/families.py): every transform
the family × stage table of docs/families.md allows keeps the model's function, the others are refused in one
line, and every stage quantizes, verifies, loads, evaluates, exports where the format holds it and generates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bad_input import assert_one_line_error, run_cli
from conftest import STORIES, TINY_SAMPLE, write_recipe
from families import FAMILIES, GENERIC, MOE

pytestmark = pytest.mark.skipif(not STORIES.is_dir(), reason="stories260K assets not found")

# docs/families.md: the transforms each family takes; every other transform is refused for it.
TRANSFORMS = ("rotate", "smooth", "smooth_attention", "reorder")
ALLOWED = {
    "llama3": TRANSFORMS,
    "qwen3": TRANSFORMS,
    "gemma2": ("smooth", "smooth_attention", "reorder"),
    "gemma3": ("smooth", "smooth_attention", "reorder"),
    "phi3": ("rotate",),
    "mixtral": TRANSFORMS,
    "qwen2_moe": TRANSFORMS,
    "qwen3_moe": TRANSFORMS,
}
DECLARED = {**FAMILIES, **MOE}
REFUSAL = {
    ("gemma2", "rotate"): ["Gemma2ForCausalLM normalizes each branch's output", "post_attention_layernorm"],
    ("gemma3", "rotate"): ["Gemma3ForCausalLM normalizes each branch's output", "post_feedforward_layernorm"],
    ("phi3", "smooth"): ["row slices of fused linears", "drop smooth"],
    ("phi3", "reorder"): ["row slices of fused linears", "drop reorder"],
    ("phi3", "smooth_attention"): ["one fused qkv_proj", "drop smooth_attention"],
}
for _name in GENERIC:
    for _stage in TRANSFORMS:
        REFUSAL[(_name, _stage)] = ["has no adapter here" if _stage != "rotate" else "not known to rotate"]
GPTQ = "  - stage: gptq\n    bits: 4\n    group_size: 32\n    symmetric: false\n"
for _name in GENERIC:
    for _stage in ("kv_cache", "vq_kv"):
        REFUSAL[(_name, _stage)] = ["has no adapter here", f"{_stage} needs attention"]


def _recipe(path: Path, model: Path, stages: str, out: Path, samples: int = 4) -> Path:
    return write_recipe(
        path,
        f"model: {model}\ncalibration: {{source: {TINY_SAMPLE}, num_samples: {samples}, seq_len: 64}}\n"
        f"stages:\n{stages}settings: {{dtype: float64}}\noutput: {out}\n",
    )


def _ids(n: int = 40) -> torch.Tensor:
    return (torch.arange(n) * 37 % 500 + 3)[None]


def _rel(after: torch.Tensor, before: torch.Tensor) -> float:
    return ((after.double() - before.double()).abs().max() / before.double().abs().max()).item()


@pytest.mark.parametrize(
    ("name", "stages"),
    [(n, (s,)) for n in DECLARED for s in ALLOWED[n]]
    + [(n, ALLOWED[n]) for n in DECLARED if len(ALLOWED[n]) > 1],
)
def test_transforms_keep_the_function(tmp_path, family, name, stages):
    """With quantization off, the transformed model's logits are the float model's (float64; transformers'
    RMSNorms normalize in float32, so a rotation, which changes what they normalize, agrees to float32 rounding)."""
    from qtool.console import Reporter
    from qtool.models.loading import load_model
    from qtool.pipeline import quantize_model
    from qtool.recipe import load_recipe

    model_dir = family(name)
    text = "".join(f"  - stage: {s}\n" for s in stages)
    qm = quantize_model(
        load_recipe(_recipe(tmp_path / "r.yaml", model_dir, text, tmp_path / "o")), Reporter(quiet=True)
    )
    ref, _, _, _ = load_model(str(model_dir), torch.float64)
    with torch.no_grad():
        rel = _rel(qm.model.double()(_ids()).logits, ref(_ids()).logits)
    # Gemma's norms apply their scales in float32 too: folding into q_norm/k_norm agrees to its rounding.
    float32 = "rotate" in stages or (name == "gemma3" and "smooth_attention" in stages)
    assert rel <= (1e-5 if float32 else 1e-9), rel
    assert {r["stage"] for r in qm.transforms} <= set(stages)


@pytest.mark.parametrize(("name", "stage"), sorted(REFUSAL))
def test_inexact_transforms_are_refused_in_one_line(tmp_path, family, no_work, name, stage):
    res = run_cli(
        ["quantize", _recipe(tmp_path / "r.yaml", family(name), f"  - stage: {stage}\n", tmp_path / "o")]
    )
    assert_one_line_error(res, 3, "stages[0]", *REFUSAL[(name, stage)])


@pytest.mark.parametrize("name", list(DECLARED) + list(GENERIC))
def test_transformers_loads_each_family_as_qtool_does(tmp_path, family, name):
    """`from_pretrained` of a checkpoint of each family (qtool imported) computes qtool.load's logits."""
    from transformers import AutoModelForCausalLM

    import qtool

    out = tmp_path / "ckpt"
    res = run_cli(["quantize", _recipe(tmp_path / "r.yaml", family(name), GPTQ, out), "-q"])
    assert res.exit_code == 0, res.output
    ours = qtool.load(out)
    theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(ours(_ids()).logits, theirs(_ids()).logits)


def test_generic_fallback_finds_blocks_and_groups(family):
    """OLMo 2 (no adapter): the decoder blocks and their linears from the module tree, the groups that share an
    input from a block's forward (q/k/v, gate/up)."""
    from qtool.calibration.capture import capture_block_inputs
    from qtool.models.adapters import forward_groups, generic_adapter
    from qtool.models.loading import load_model

    model, _, adapter, _ = load_model(str(family("olmo2")), torch.float32)
    assert adapter.generic and adapter.blocks_path == "model.layers"
    assert adapter == generic_adapter(model)
    inputs, kwargs = capture_block_inputs(model, adapter.blocks(model), _ids(16), torch.device("cpu"))
    found = forward_groups(adapter, adapter.blocks(model)[0], inputs[0], kwargs[0])
    assert found.linear_groups == (
        ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        ("self_attn.o_proj",),
        ("mlp.gate_proj", "mlp.up_proj"),
        ("mlp.down_proj",),
    )


def test_gemma_blocks_get_their_own_masks(family):
    """Gemma alternates sliding-window and full attention: the capture gives each block its own mask."""
    from qtool.calibration.capture import capture_block_inputs
    from qtool.models.loading import load_model

    model, _, adapter, _ = load_model(str(family("gemma3")), torch.float32)
    _, kwargs = capture_block_inputs(model, adapter.blocks(model), _ids(40), torch.device("cpu"))
    assert kwargs[0] is not kwargs[1]
    sliding, full = kwargs[0]["attention_mask"], kwargs[1]["attention_mask"]
    # a 16-token window against the whole causal past (which SDPA takes as causal, without a mask)
    assert sliding is not None and (full is None or not torch.equal(sliding, full))
    assert not torch.equal(kwargs[0]["position_embeddings"][0], kwargs[1]["position_embeddings"][0])


@pytest.mark.parametrize("name", list(DECLARED) + list(GENERIC))
def test_dry_run_and_zero_shot_on_each_family(tmp_path, family, name):
    """`--dry-run` estimates each family's run from its config and shard headers alone (no weight read); the
    checkpoint scores a zero-shot task through lm-eval."""
    recipe = _recipe(tmp_path / "r.yaml", family(name), GPTQ, tmp_path / "ckpt")
    res = run_cli(["quantize", recipe, "--dry-run", "--json"])
    assert res.exit_code == 0, res.output
    dry = json.loads(res.stdout)["estimate"]
    assert dry["output_bytes"] > 0 and dry["peak_host_bytes"] > 0, dry
    assert not (tmp_path / "ckpt").exists()
    assert run_cli(["quantize", recipe, "-q"]).exit_code == 0
    res = run_cli(["eval", tmp_path / "ckpt", "--tasks", "piqa", "--limit", "4", "--device", "cpu", "--json"])
    assert res.exit_code == 0, res.output
    assert 0.0 <= json.loads(res.stdout)["zeroshot"]["results"]["piqa"]["acc,none"] <= 1.0
