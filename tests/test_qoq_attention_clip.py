"""QServe Eq. 10: q_proj/k_proj clip ratios scored by the attention output (qtool/quant/attention_objective.py).
The probe's per-head errors isolate the head a row feeds (a KV head's rows feed its whole query group); the
clipping it drives never does worse than no clipping on that objective, head by head; and the recipe option
selects it."""

from __future__ import annotations

import pytest
import torch

from qtool.calibration.capture import capture_block_inputs
from qtool.quant.attention_objective import AttentionProbe
from qtool.quant.clip import clip_ratios
from qtool.quant.progressive import qoq_quantize


@pytest.fixture(scope="module")
def block_and_inputs(tiny_llama):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, torch_dtype=torch.float32).eval()
    windows = torch.randint(0, 512, (3, 24), generator=torch.Generator().manual_seed(1))
    inputs, kwargs = capture_block_inputs(model, model.model.layers, windows, torch.device("cpu"))
    kwargs = kwargs[0]
    block = model.model.layers[0]
    cfg = model.config
    probe = AttentionProbe(
        block,
        block.self_attn,
        block.self_attn.o_proj,
        inputs,
        kwargs,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.hidden_size // cfg.num_attention_heads,
    )
    return block, probe


def test_probe_errors_land_on_the_heads_a_row_feeds(block_and_inputs):
    block, probe = block_and_inputs
    q, k = block.self_attn.q_proj, block.self_attn.k_proj
    d = probe.head_dim
    assert torch.equal(
        probe.head_errors(q, q.weight.data.clone()), torch.zeros(probe.heads, dtype=torch.float64)
    )
    w = q.weight.data.clone()
    w[2 * d : 3 * d] += 0.5 * torch.randn(d, w.shape[1])  # query head 2 only
    err = probe.head_errors(q, w)
    assert err[2] > 0 and float(err[[0, 1, 3]].abs().max()) == 0.0
    wk = k.weight.data.clone()
    wk[d : 2 * d] += 0.5 * torch.randn(d, wk.shape[1])  # KV head 1: query heads 2 and 3 (4 heads over 2)
    err = probe.head_errors(k, wk)
    assert float(err[:2].abs().max()) == 0.0 and bool((err[2:] > 0).all())
    rows = probe.row_score(k, "k")(wk)
    assert rows.shape == (wk.shape[0],) and float(rows[:d].abs().max()) == 0.0 and bool((rows[d:] > 0).all())
    assert torch.equal(q.weight.data, block.self_attn.q_proj.weight.data)  # the probe put the weight back


@pytest.mark.parametrize("group_size", [None, 32])
@pytest.mark.parametrize("kind", ["q", "k"])
def test_attention_clipping_is_no_worse_than_none_per_head(block_and_inputs, kind, group_size):
    block, probe = block_and_inputs
    lin = block.self_attn.q_proj if kind == "q" else block.self_attn.k_proj
    w = lin.weight.data.float()
    score = probe.row_score(lin, kind)

    def deq(out):
        from qtool.layouts.qoq.layout import QoQWeight

        return QoQWeight.from_codes(
            out.codes, out.scales, 4, group_size, out.group_scales, out.zeros
        ).dequantize(torch.float32)

    plain = deq(qoq_quantize(w, 4, group_size))
    clipped = deq(qoq_quantize(w, 4, group_size, clip_ratios=clip_ratios(12, 0.4), score=score))
    e_plain, e_clip = probe.head_errors(lin, plain), probe.head_errors(lin, clipped)
    if kind == "k":
        e_plain, e_clip = e_plain.view(probe.kv_heads, -1).sum(1), e_clip.view(probe.kv_heads, -1).sum(1)
    assert bool((e_clip <= e_plain * (1 + 1e-9)).all()), (e_clip, e_plain)
    if group_size is None:  # 4-bit per channel: clipping pays on these weights, so the search must have moved
        assert not torch.equal(plain, clipped), "the search never clipped: the test would prove nothing"


def test_recipe_option_selects_the_objective(tiny_llama, tmp_path):
    from click.testing import CliRunner

    from qtool.cli import cli
    from tests.conftest import TINY_SAMPLE, write_recipe

    outs = {}
    for objective in ("attention", "layer"):
        recipe = write_recipe(
            tmp_path / f"{objective}.yaml",
            f"""
model: {tiny_llama}
output: {tmp_path / objective}
calibration: {{source: {TINY_SAMPLE}, num_samples: 2, seq_len: 32}}
stages:
  - stage: progressive
    bits: 4
    group_size: 8
    clip: true
    clip_grid: 8
    clip_qk: {objective}
""",
        )
        r = CliRunner().invoke(cli, ["quantize", str(recipe), "--no-eval", "-q"])
        assert r.exit_code == 0, r.output
        from safetensors.torch import load_file

        tensors = {}
        for f in sorted((tmp_path / objective).glob("*.safetensors")):
            tensors.update(load_file(f))
        outs[objective] = tensors
    a, b = outs["attention"], outs["layer"]
    differs = [n for n in a if n.endswith("scales") and not torch.equal(a[n], b[n])]
    assert differs and all(".q_proj." in n or ".k_proj." in n for n in differs), differs
