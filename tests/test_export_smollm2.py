"""Acceptance: SmolLM2-135M exported to compressed-tensors loads in unmodified transformers and computes what
qtool's reference forward computes (formats/compressed-tensors.md).

W4A16: GPTQ (act-order, static groups, asymmetric, g64 as in recipes/gptq-w4a16-g64.yaml) on the first block and
RTN on the others keeps the run to seconds on CPU; both write the same `grouped_int` layer. Asymmetric, so
transformers loads it with `CompressedTensorsConfig(dequantize=True)`. W8A8: QoQ W8 per channel (RTN).
Protocol: WikiText-2 test, the first 4 windows of 256 tokens."""

from __future__ import annotations

import pytest
import torch

from bad_input import run_cli
from conftest import C4, WIKITEXT, write_recipe

pytestmark = pytest.mark.slow

FP16_ROUNDING = 2.0 ** -11

W4 = """model: {model}
target: compressed-tensors
calibration: {{source: {c4}, num_samples: 2, seq_len: 128, seed: 0}}
stages:
  - stage: gptq
    bits: 4
    group_size: 64
    symmetric: false
    act_order: true
    static_groups: true
    targets: {{include: ["model.layers.0.*"]}}
  - stage: rtn
    bits: 4
    group_size: 64
    symmetric: false
    targets: {{exclude: ["model.layers.0.*"]}}
output: {out}
"""

W8A8 = """model: {model}
target: compressed-tensors
stages:
  - stage: progressive
    bits: 8
    group_size: null
output: {out}
"""


@pytest.fixture(scope="module")
def exported(tmp_path_factory, smollm2):
    tmp = tmp_path_factory.mktemp("smollm2-export")
    for name, text in (("w4g64", W4), ("w8a8", W8A8)):
        recipe = write_recipe(tmp / f"{name}.yaml", text.format(model=smollm2, c4=C4, out=tmp / name))
        res = run_cli(["quantize", recipe, "-q"])
        assert res.exit_code == 0, res.output
        res = run_cli(["export", tmp / name, "--format", "compressed-tensors", "-o", tmp / f"{name}-ct", "-q"])
        assert res.exit_code == 0, res.output
    return tmp


def _ppl(model, tokenizer) -> float:
    from qtool.eval.perplexity import perplexity
    from qtool.recipe import EvalSpec

    spec = EvalSpec(text=str(WIKITEXT), seq_len=256, max_windows=4)
    with torch.no_grad():
        return perplexity(model, tokenizer, spec, "cpu")["perplexity"]


def _logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def _hf(path, dequantize: bool):
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    kw = {"quantization_config": CompressedTensorsConfig(dequantize=True)} if dequantize else {}
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw).eval()


def _window(tokenizer) -> torch.Tensor:
    ids = tokenizer(WIKITEXT.read_text()[:20000], return_tensors="pt").input_ids
    return ids[:, :256]


def test_w4_g64_export_matches_qtool_in_transformers(exported):
    import qtool
    from qtool.checkpoint.loader import load_tokenizer

    tok = load_tokenizer(exported / "w4g64")
    ref, ids = qtool.load(exported / "w4g64"), _window(tok)
    with pytest.raises(RuntimeError, match="mismatch"):  # asymmetric: the upstream zero-point shape mismatch
        _hf(exported / "w4g64-ct", dequantize=False)
    client = _hf(exported / "w4g64-ct", dequantize=True)
    a, b = _logits(ref, ids), _logits(client, ids)
    diff = ((a - b).abs().max() / a.abs().max()).item()
    assert diff < FP16_ROUNDING, diff
    p_ref, p_client = _ppl(ref, tok), _ppl(client, tok)
    print({"w4g64": {"max_rel_logit_diff": diff, "ppl_qtool": p_ref, "ppl_transformers": p_client}})
    assert round(p_ref, 3) == round(p_client, 3)


def test_w8a8_export_matches_qtool_weights_in_transformers(exported):
    import qtool
    from qtool.checkpoint.loader import load_tokenizer
    from qtool.runtime.qoq_linear import QoQLinear

    tok = load_tokenizer(exported / "w8a8")
    ref, ids = qtool.load(exported / "w8a8"), _window(tok)
    own_ppl = _ppl(ref, tok)
    client = _hf(exported / "w8a8-ct", dequantize=False)

    def ct_rule(w):  # compressed-tensors' dynamic per-token symmetric INT8: scale max|x|/127.5, codes [-128, 127]
        def forward(x):
            s = x.abs().amax(-1, keepdim=True) / 127.5
            return torch.nn.functional.linear(torch.clamp(torch.round(x / s), -128, 127) * s, w)
        return forward

    for _, m in ref.named_modules():
        if isinstance(m, QoQLinear):
            m.forward = ct_rule(m.dequantize(torch.float32))
    a, b = _logits(ref, ids), _logits(client, ids)
    diff = ((a - b).abs().max() / a.abs().max()).item()
    assert diff < FP16_ROUNDING, diff
    p_emulated, p_client = _ppl(ref, tok), _ppl(client, tok)
    print({"w8a8": {"max_rel_logit_diff": diff, "ppl_qtool_rule": own_ppl, "ppl_ct_rule": p_emulated,
                    "ppl_transformers": p_client}})
    assert round(p_emulated, 3) == round(p_client, 3)
    assert abs(own_ppl - p_client) / own_ppl < 0.01  # the two activation roundings: the same scheme
