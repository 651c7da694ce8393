"""examples/ci/quantize-and-gate.sh end to end on stories260K: a gate it passes (exit 0) and one it cannot pass
(exit 8, the gate's code), each leaving the full artifact folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, STORIES, TINY_SAMPLE, write_recipe

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not STORIES.is_dir(), reason="stories260K assets not found"),
]

SCRIPT = ROOT / "examples" / "ci" / "quantize-and-gate.sh"


def run_script(tmp: Path, artifact: str, max_ppl_increase: str) -> subprocess.CompletedProcess:
    recipe = write_recipe(
        tmp / "recipe.yaml",
        f"model: {STORIES}\nstages:\n  - stage: rtn\n    bits: 4\n    group_size: 32\noutput: unused\n",
    )
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "RECIPE": str(recipe),
        "ARTIFACT": str(tmp / artifact),
        "EVAL_TEXT": str(TINY_SAMPLE),
        "EVAL_SEQ_LEN": "128",
        "EVAL_WINDOWS": "4",
        "MAX_PPL_INCREASE": max_ppl_increase,
    }
    env.pop("INSTALL", None)
    return subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=600)


def check_artifact(folder: Path) -> dict:
    assert sorted(p.name for p in folder.iterdir()) == [
        "checkpoint",
        "eval.json",
        "pack.json",
        "quantize.json",
    ]
    ckpt = folder / "checkpoint"
    assert {"qtool-manifest.json", "recipe.yaml", "config.json", "model.safetensors"} <= {
        p.name for p in ckpt.iterdir()
    }
    assert json.loads((folder / "pack.json").read_text())["verified"] is True
    assert json.loads((folder / "quantize.json").read_text())["quantized_linears"] == 35
    return json.loads((folder / "eval.json").read_text())


def test_ci_script_passes_and_fails_its_gate(tmp_path):
    ok = run_script(tmp_path, "pass", "50%")
    assert ok.returncode == 0, ok.stderr
    ev = check_artifact(tmp_path / "pass")
    assert ev["gate"]["passed"] is True and [c["metric"] for c in ev["gate"]["checks"]] == ["perplexity"]
    change = ev["gate"]["checks"][0]["change"]
    assert 0 < change < 50  # 4-bit RTN costs some perplexity, far from 50%

    bad = run_script(tmp_path, "fail", "0.001%")
    assert bad.returncode == 8, bad.stderr
    lines = [ln for ln in bad.stderr.splitlines() if ln.startswith("qtool: error:")]
    assert (
        len(lines) == 1 and "quality gate failed: text perplexity" in lines[0] and "limit +0.001%" in lines[0]
    )
    ev = check_artifact(tmp_path / "fail")
    assert ev["gate"]["passed"] is False and ev["gate"]["failed"][0]["change"] == change
