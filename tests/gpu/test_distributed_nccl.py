"""`qtool quantize` in an NCCL process group (qtool/distributed.py) on stories260K, GPTQ with act-order: a group of
one process on one GPU writes the bytes of the plain run (every collective runs, on the GPU, and changes nothing);
two processes on two GPUs write the bytes of one process summing the statistics in the ranks' order (skipped with
fewer than two GPUs)."""

from __future__ import annotations

import json

import pytest
import torch
from test_distributed import finish, launch, recipe, summed_like_two_ranks

from tests.gpu.helpers import gpu_ready

from bad_input import run_cli
from conftest import STORIES

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(gpu_ready() is not None, reason=str(gpu_ready())),
    pytest.mark.skipif(not STORIES.is_dir(), reason="stories260K assets not found"),
]


def gpu_recipe(folder):
    r = recipe(folder, samples=6)
    r.write_text(
        r.read_text().replace(
            "group_size: 32", "group_size: 32\n    act_order: true\n    static_groups: true"
        )
        + "settings:\n  device: cuda\n"
    )
    return r


def test_nccl_group_of_one_writes_the_plain_run(tmp_path):
    r = gpu_recipe(tmp_path)
    plain = run_cli(["quantize", r, "-q", "-o", tmp_path / "plain"], cwd=tmp_path)
    assert plain.exit_code == 0, plain.output
    (proc,) = launch([["quantize", r, "-q", "--json", "-o", tmp_path / "nccl"]], tmp_path)
    res = finish(proc)
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    assert summary["world_size"] == 1 and summary["ranks"][0]["device"] == "cuda:0"
    assert (tmp_path / "plain" / "model.safetensors").read_bytes() == (
        tmp_path / "nccl" / "model.safetensors"
    ).read_bytes()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="fewer than two GPUs")
def test_two_gpus_write_the_bytes_of_one_summing_in_their_order(tmp_path, monkeypatch):
    r = gpu_recipe(tmp_path)
    res = [finish(p) for p in launch([["quantize", r, "-q", "--json", "-o", tmp_path / "two"]] * 2, tmp_path)]
    assert res[0].exit_code == 0 and res[1].exit_code == 0, res[0].output + res[1].output
    assert [x["device"] for x in json.loads(res[0].stdout)["ranks"]] == ["cuda:0", "cuda:1"]
    summed_like_two_ranks(monkeypatch)
    one = run_cli(["quantize", r, "-q", "-o", tmp_path / "one"], cwd=tmp_path)
    assert one.exit_code == 0, one.output
    assert (tmp_path / "one" / "model.safetensors").read_bytes() == (
        tmp_path / "two" / "model.safetensors"
    ).read_bytes()
