"""Acceptance: SmolLM2-135M exported to compressed-tensors loads in unmodified transformers and computes what
qtool's reference forward computes (formats/compressed-tensors.md).

W4A16: GPTQ (act-order, static groups, asymmetric, g64 as in recipes/gptq-w4a16-g64.yaml) on the first block and
RTN on the others keeps the run to seconds on CPU; both write the same `grouped_int` layer. Asymmetric, so
transformers loads it with `CompressedTensorsConfig(dequantize=True)`. W8A8: QoQ W8 per channel (RTN).
Protocol: WikiText-2 test, its first two windows of 128 tokens."""

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


def _windows(tokenizer) -> torch.Tensor:
    """The first two 128-token windows of WikiText-2 test (its head, tokenized without BOS as qtool eval does)."""
    ids = tokenizer(WIKITEXT.read_text(encoding="utf-8")[:4000], add_special_tokens=False,
                    return_tensors="pt").input_ids[0]
    return ids[:256].reshape(2, 128)


def _logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits.float()


def _ppl(logits: torch.Tensor, ids: torch.Tensor) -> float:
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    return float(torch.exp(nll))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / a.abs().max()).item()


def _hf(path, dequantize: bool):
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    kw = {"quantization_config": CompressedTensorsConfig(dequantize=True)} if dequantize else {}
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw).eval()


def test_w4_g64_export_matches_qtool_in_transformers(exported):
    import qtool
    from qtool.checkpoint.loader import load_tokenizer

    ids = _windows(load_tokenizer(exported / "w4g64"))
    with pytest.raises(RuntimeError, match="mismatch"):  # asymmetric: the upstream zero-point shape mismatch
        _hf(exported / "w4g64-ct", dequantize=False)
    ref, client = _logits(qtool.load(exported / "w4g64"), ids), _logits(_hf(exported / "w4g64-ct", True), ids)
    diff = _rel(ref, client)
    print({"w4g64": {"max_rel_logit_diff": diff, "ppl_qtool": _ppl(ref, ids), "ppl_transformers": _ppl(client, ids)}})
    assert diff < FP16_ROUNDING, diff
    assert round(_ppl(ref, ids), 3) == round(_ppl(client, ids), 3)


def test_w8a8_export_matches_qtool_weights_in_transformers(exported):
    import qtool
    from qtool.checkpoint.loader import load_tokenizer
    from qtool.runtime.qoq_linear import QoQLinear

    ids = _windows(load_tokenizer(exported / "w8a8"))
    ref = qtool.load(exported / "w8a8")
    own = _logits(ref, ids)

    def ct_rule(w):  # compressed-tensors' dynamic per-token symmetric INT8: scale max|x|/127.5, codes [-128, 127]
        def forward(x):
            s = x.abs().amax(-1, keepdim=True) / 127.5
            return torch.nn.functional.linear(torch.clamp(torch.round(x / s), -128, 127) * s, w)
        return forward

    for m in ref.modules():
        if isinstance(m, QoQLinear):
            m.forward = ct_rule(m.dequantize(torch.float32))
    emulated, client = _logits(ref, ids), _logits(_hf(exported / "w8a8-ct", False), ids)
    diff = _rel(emulated, client)
    print({"w8a8": {"max_rel_logit_diff": diff, "ppl_qtool_rule": _ppl(own, ids), "ppl_ct_rule": _ppl(emulated, ids),
                    "ppl_transformers": _ppl(client, ids), "max_rel_logit_diff_to_qtool_rule": _rel(own, client)}})
    assert diff < FP16_ROUNDING, diff
    assert round(_ppl(emulated, ids), 3) == round(_ppl(client, ids), 3)
    assert abs(_ppl(own, ids) - _ppl(client, ids)) / _ppl(own, ids) < 0.01  # two roundings of one scheme
