"""Block onloading on a GPU: the weights are read into page-locked memory and, without transforms, checked finite
on the device after the copy. A NaN in the first block (read before the loop) or a later one (read ahead by the
thread) still stops the run with one line naming the tensor and its file, and leaves no output behind."""

from __future__ import annotations

import json

import pytest
from test_bad_input_loading import INPUT, WEIGHTS, copy_model, edit_tensors, poison
from test_resume import RECIPE, write_recipe

from tests.gpu.helpers import gpu_ready

from bad_input import assert_one_line_error, run_cli

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(gpu_ready() is not None, reason=str(gpu_ready()))]

CUDA_RECIPE = RECIPE.replace("stages:", "settings:\n  device: cuda\nstages:")


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.3.mlp.down_proj.weight",
        "model.layers.2.post_attention_layernorm.weight",
    ],
)
def test_a_nan_read_onto_the_gpu_is_refused_naming_the_tensor(tmp_path, name):
    model = copy_model(tmp_path)
    edit_tensors(model, poison(name, float("nan"), (0,) if "norm" in name else (1, 2)))
    recipe = write_recipe(tmp_path / "run", model, CUDA_RECIPE)
    res = run_cli(["quantize", recipe, "-q"])
    assert_one_line_error(res, INPUT, name, WEIGHTS, "NaN or Inf", output=recipe.parent / "out")


def test_the_onloaded_gpu_run_writes_the_bytes_of_the_whole_model_run(tmp_path):
    recipe = write_recipe(tmp_path / "run", text=CUDA_RECIPE)
    res = run_cli(["quantize", recipe, "-q", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["mode"] == "blocks"
    res = run_cli(["quantize", recipe, "-o", tmp_path / "whole", "--whole-model", "-q"])
    assert res.exit_code == 0, res.output
    blocks, whole = (
        sorted((p.name, p.read_bytes()) for p in f.iterdir())
        for f in (recipe.parent / "out", tmp_path / "whole")
    )
    assert blocks == whole
