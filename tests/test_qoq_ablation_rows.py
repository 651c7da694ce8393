"""scripts/qoq_ablation.py: every row of both lists is a valid recipe, and the "weights only" rows really run the
quantized weights with float activations."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

from qtool.errors import RecipeError
from qtool.layouts.qoq.layout import QoQWeight
from qtool.layouts.qoq.module import QoQLinear
from qtool.quant.progressive import qoq_quantize
from qtool.recipe import validate_recipe

from conftest import C4, ROOT, STORIES


@pytest.fixture(scope="module")
def ablation():
    spec = importlib.util.spec_from_file_location("qoq_ablation", ROOT / "scripts" / "qoq_ablation.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_row_is_a_valid_recipe(ablation):
    rows = [(n, s, {}) for n, s in ablation.rungs(64, "rtn")] + ablation.quality_rows(64)
    for name, stages, extras in rows:
        cal = {"source": str(C4), "num_samples": 2, "seq_len": 32, "seed": 0, **extras.get("calibration", {})}
        recipe = validate_recipe(
            {"model": str(STORIES), "calibration": cal, "stages": stages}, name, ROOT, {}
        )
        assert [s.stage.name for s in recipe.stages] == [s["stage"] for s in stages], name
    with pytest.raises(RecipeError, match="static_groups"):
        bad = {"stage": "progressive", "bits": 4, "group_size": 64, "solver": "gptq", "act_order": True}
        validate_recipe({"model": str(STORIES), "stages": [bad]}, "bad", ROOT, {})


def test_float_weights_runs_the_dequantized_weight_in_float(ablation):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(24, 64, generator=gen)
    out = qoq_quantize(w, 4, 16)
    layout = QoQWeight.from_codes(out.codes, out.scales, 4, 16, out.group_scales, out.zeros)
    model = nn.Sequential(nn.Sequential(QoQLinear(layout, torch.randn(24, generator=gen))), nn.ReLU())
    x = torch.randn(5, 64, generator=gen)
    w8a8 = model(x)
    assert ablation.float_weights(model) == 1
    lin = model[0][0]
    assert type(lin) is nn.Linear
    expected = torch.relu(x @ layout.dequantize(torch.float32).T + lin.bias)
    torch.testing.assert_close(model(x), expected, rtol=0, atol=1e-6)
    assert not torch.equal(w8a8, model(x))  # the activations are no longer rounded to 8 bits
    assert ablation.float_weights(model) == 0
