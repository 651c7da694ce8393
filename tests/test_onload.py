"""Block onloading on SmolLM2: the block-by-block run (one block read from the weight file at a time) writes the
byte-identical checkpoint of the whole-model run with clearly less peak memory, and `--dry-run` estimates that
peak within 30% without reading a weight; a run the machine cannot hold is refused before any work.

The two runs are child processes, each reporting its own peak resident set (the whole run including the
checkpoint write). RTN keeps them to seconds: GPTQ's path through the block loop, the calibration activations
and resume are tested on stories260K (tests/test_resume.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bad_input import ROOT, assert_one_line_error, run_cli
from conftest import STORIES

pytestmark = pytest.mark.skipif(not STORIES.is_dir(), reason="assets not found")

# The MLP linears only: every block is still read, quantized, stored and dropped, at half the quantizing time.
RECIPE = """
model: {model}
stages:
  - stage: rtn
    bits: 4
    group_size: 64
    targets: {{include: ["*.mlp.*"]}}
output: {out}
"""


# The child writes its own peak resident set (VmHWM of its address space) when it exits. The rusage a parent reads
# with wait4 is no use here: Linux carries the forking process's high-water mark over the exec, so a child of a
# large test worker would report the worker's size.
CHILD = """
import atexit, os, re
def peak():
    status = open("/proc/self/status").read()
    with open(os.environ["QTOOL_TEST_PEAK"], "w") as f:
        f.write(re.search(r"VmHWM:\\s+(\\d+) kB", status).group(1))
atexit.register(peak)
from qtool.cli import main
main()
"""


def run_measured(args: list, tmp: Path, name: str) -> tuple[int, str, int]:
    """Run `qtool ARGS` in a child; return (exit code, stdout, peak RSS in bytes of that child alone)."""
    peak = tmp / f"{name}.peak"
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, *map(str, args)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "QTOOL_TEST_PEAK": str(peak)},
    )
    assert proc.returncode == 0, proc.stderr
    return proc.returncode, proc.stdout, int(peak.read_text()) * 1024


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_onloaded_run_is_byte_identical_with_less_memory_and_dry_run_estimates_it(smollm2, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(RECIPE.format(model=smollm2, out=tmp_path / "blocks"))
    _, dry, _ = run_measured(["quantize", recipe, "--dry-run", "--json"], tmp_path, "dry")
    _, summary, onloaded = run_measured(["quantize", recipe, "--json"], tmp_path, "blocks")
    _, _, whole = run_measured(
        ["quantize", recipe, "-o", tmp_path / "whole", "--whole-model", "-q"], tmp_path, "whole"
    )
    assert json.loads(summary)["mode"] == "blocks"
    blocks, full = folder_bytes(tmp_path / "blocks"), folder_bytes(tmp_path / "whole")
    assert blocks.keys() == full.keys() and all(blocks[k] == full[k] for k in full), [
        k for k in full if blocks.get(k) != full[k]
    ]
    # The whole model in float32 is 538 MB; onloading holds one 14 MB block of it (plus the embedding).
    assert onloaded < whole - 250e6, (onloaded / 1e6, whole / 1e6)
    est = json.loads(dry)["estimate"]["peak_host_bytes"]
    assert abs(est - onloaded) <= 0.3 * onloaded, (est / 1e6, onloaded / 1e6)
    assert not list(tmp_path.glob(".*partial"))  # the work folder goes once the checkpoint is written


def test_dry_run_refuses_a_run_this_machine_cannot_hold(smollm2, tmp_path, no_work):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        RECIPE.format(model=smollm2, out=tmp_path / "out")
        .replace(
            "stages:",
            f"calibration: {{source: {ROOT / 'README.md'}, num_samples: 100000, seq_len: 8192}}\nstages:",
        )
        .replace("rtn", "gptq")
    )
    for extra in (["--dry-run"], []):  # a real run checks the same before starting
        res = run_cli(["quantize", recipe, *extra])
        assert_one_line_error(
            res,
            6,
            "host memory",
            "activations",
            "100000 x 8192",
            "lower --num-samples",
            output=tmp_path / "out",
        )


def _make_test_model():
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_test_model", ROOT / "scripts" / "make_test_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_make_test_model_shapes_and_a_sharded_model_that_passes_the_pre_flight(tmp_path):
    import torch

    mk = _make_test_model()
    # Llama-2-7B and Llama-2-70B, parameter for parameter
    counts = {
        k: sum(torch.Size(s).numel() for s in mk.tensor_shapes(mk.SHAPES[k]).values()) for k in ("7b", "70b")
    }
    assert counts == {"7b": 6_738_415_616, "70b": 68_976_648_192}
    info = mk.make(tmp_path / "m", "tiny", 3, 200_000, seed=0)
    assert info["layers"] == 3 and info["shards"] > 1
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"model: {tmp_path / 'm'}\ncalibration: {{source: {ROOT / 'README.md'}, num_samples: 2, "
        f"seq_len: 32}}\nstages:\n  - stage: gptq\n    bits: 4\noutput: {tmp_path / 'out'}\n"
    )
    res = run_cli(["quantize", recipe, "--dry-run", "--json"])
    assert res.exit_code == 0, res.output
    est = json.loads(res.stdout)
    assert (
        est["mode"] == "blocks"
        and est["estimate"]["num_blocks"] == 3
        and est["estimate"]["seconds"] is not None
    )
    assert not (tmp_path / "out").exists()
