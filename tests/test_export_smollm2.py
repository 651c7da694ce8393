"""Acceptance: SmolLM2-135M exported to compressed-tensors loads in unmodified transformers and computes what
qtool's reference forward computes (formats/compressed-tensors.md).

One checkpoint holds both schemes, so one quantization, one export and one load cover them in seconds on CPU:
block 0 is GPTQ W4 g64 (act-order, static groups, symmetric, as recipes/gptq-w4a16-g64.yaml but symmetric, which
transformers loads without `dequantize=True`; the asymmetric case is tested on stories260K), block 1 is W8A8 (QoQ
W8 per channel, per-token INT8 activations), the other blocks stay float16 (the export's ignore list).
Protocol: WikiText-2 test, its first two windows of 128 tokens."""

from __future__ import annotations

import pytest
import torch

from bad_input import run_cli
from conftest import C4, WIKITEXT, write_recipe

pytestmark = pytest.mark.slow

FP16_ROUNDING = 2.0**-11

RECIPE = """model: {model}
target: compressed-tensors
calibration: {{source: {c4}, num_samples: 2, seq_len: 128, seed: 0}}
stages:
  - stage: gptq
    bits: 4
    group_size: 64
    symmetric: true
    act_order: true
    static_groups: true
    targets: {{include: ["model.layers.0.*"]}}
  - stage: progressive
    bits: 8
    group_size: null
    targets: {{include: ["model.layers.1.*"]}}
output: {out}
"""


@pytest.fixture(scope="module")
def exported(tmp_path_factory, smollm2):
    tmp = tmp_path_factory.mktemp("smollm2-export")
    recipe = write_recipe(tmp / "mixed.yaml", RECIPE.format(model=smollm2, c4=C4, out=tmp / "q"))
    res = run_cli(["quantize", recipe, "-q"])
    assert res.exit_code == 0, res.output
    res = run_cli(["export", tmp / "q", "--format", "compressed-tensors", "-o", tmp / "q-ct", "-q"])
    assert res.exit_code == 0, res.output
    return tmp


def _windows(tokenizer) -> torch.Tensor:
    """The first two 128-token windows of WikiText-2 test (its head, tokenized without BOS as qtool eval does)."""
    ids = tokenizer(
        WIKITEXT.read_text(encoding="utf-8")[:4000], add_special_tokens=False, return_tensors="pt"
    ).input_ids[0]
    return ids[:256].reshape(2, 128)


def _logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits.float()


def _ppl(logits: torch.Tensor, ids: torch.Tensor) -> float:
    nll = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)
    )
    return float(torch.exp(nll))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / a.abs().max()).item()


def test_gptq_w4_g64_and_w8a8_export_matches_qtool_in_transformers(exported):
    from transformers import AutoModelForCausalLM

    import qtool
    from qtool.layouts.grouped_int.module import GroupedIntLinear
    from qtool.layouts.qoq.module import QoQLinear

    ids = _windows(qtool.load_tokenizer(exported / "q"))
    ref = qtool.load(exported / "q")
    kinds = [type(ref.get_submodule(f"model.layers.{i}.mlp.down_proj")) for i in range(3)]
    assert kinds == [GroupedIntLinear, QoQLinear, torch.nn.Linear]
    own = _logits(ref, ids)

    def ct_rule(
        w,
    ):  # compressed-tensors' dynamic per-token symmetric INT8: scale max|x|/127.5, codes [-128, 127]
        def forward(x):
            s = x.abs().amax(-1, keepdim=True) / 127.5
            return torch.nn.functional.linear(torch.clamp(torch.round(x / s), -128, 127) * s, w)

        return forward

    for m in ref.modules():
        if isinstance(m, QoQLinear):
            m.forward = ct_rule(m.dequantize(torch.float32))
    emulated = _logits(ref, ids)
    client = _logits(AutoModelForCausalLM.from_pretrained(exported / "q-ct", dtype=torch.float32).eval(), ids)
    diff = _rel(emulated, client)
    print(
        {
            "max_rel_logit_diff": diff,
            "ppl_qtool_ct_rule": _ppl(emulated, ids),
            "ppl_transformers": _ppl(client, ids),
            "ppl_qtool_own_rule": _ppl(own, ids),
            "max_rel_logit_diff_to_qtool_own_rule": _rel(own, client),
        }
    )
    assert diff < FP16_ROUNDING, diff
    assert round(_ppl(emulated, ids), 3) == round(_ppl(client, ids), 3)
    # qtool's own activation rounding (max|x|/127, ±127) against the client's: one scheme, two rounding rules.
    assert abs(_ppl(own, ids) - _ppl(client, ids)) / _ppl(own, ids) < 0.01


def test_smollm2_checkpoint_generates_and_loads_in_transformers(exported):
    """`qtool.load` + `generate` on SmolLM2, and (qtool imported) transformers' `from_pretrained` of the same
    checkpoint: qtool's modules, the same logits and the same greedy tokens."""
    from transformers import AutoModelForCausalLM

    import qtool

    tokenizer = qtool.load_tokenizer(exported / "q")
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    ref = qtool.load(exported / "q")
    hf = AutoModelForCausalLM.from_pretrained(exported / "q", dtype=torch.float32)
    assert [type(m) for m in ref.modules()] == [type(m) for m in hf.modules()]
    assert torch.equal(_logits(hf, ids), _logits(ref, ids))
    out = ref.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 4 and torch.equal(
        hf.generate(ids, max_new_tokens=4, do_sample=False), out
    )
