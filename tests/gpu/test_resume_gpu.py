"""Resume of a GPU run (stories260K, GPTQ on CUDA): the activations entering the next block are written by a thread
from pinned host memory while the next block is quantized, and a block counts as finished only once they are on
disk. A run killed while block 3 is quantized (block 2's activations then just written, not yet named in the
state) resumes at block 2 and writes the uninterrupted run's checkpoint byte for byte."""

from __future__ import annotations

import json
import signal

import pytest
from test_resume import RECIPE, kill_at, sha256s, state, write_recipe

from tests.gpu.helpers import gpu_ready

from bad_input import run_cli

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(gpu_ready() is not None, reason=str(gpu_ready()))]

CUDA_RECIPE = RECIPE.replace("stages:", "settings:\n  device: cuda\nstages:")


def test_killed_gpu_run_resumes_to_the_same_checkpoint(tmp_path):
    ref = write_recipe(tmp_path / "ref", text=CUDA_RECIPE)
    res = run_cli(["quantize", ref, "-q", "--json"])
    assert res.exit_code == 0, res.output
    ranks = json.loads(res.stdout)["ranks"]
    assert ranks[0]["commit_s"] > 0 and ranks[0]["onload_s"] > 0, ranks

    recipe = write_recipe(tmp_path / "kill", text=CUDA_RECIPE)
    proc = kill_at(recipe, 3, "quantizing", 1)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert state(recipe.parent)["next_block"] == 2
    res = run_cli(["quantize", recipe, "--resume", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout).get("resumed_at_block") == 2
    assert sha256s(recipe.parent / "out") == sha256s(ref.parent / "out")
