"""QUIK acceptance on the real SmolLM2-135M (the paper's Table 4/Fig. 14 directions), CPU reference forward.

Protocol (fixed, sized for CI): calibration 8 random 256-token windows of the C4 sample, seed 0, clipping search
off; WikiText-2 test ("\\n\\n"-joined rows, no BOS), the first 4 non-overlapping 512-token windows. Runs, from
recipes/quik-w4a4.yaml and recipes/quik-w8a8.yaml (weights symmetric per channel, activations asymmetric per token,
GPTQ with the outliers last):
  W4A4 with 0, 128 and 256 outliers on every linear (no down_proj rule); the shipped W4A4 recipe (256 outliers,
  down_proj W8A8 with 3.5x outliers); the shipped W8A8 recipe.
SmolLM2's inputs are narrow (576 / 1536 columns), so 256 outliers are 44% of most inputs; the comparisons, not the
absolute levels, carry over to 7B models.

The recipes' own protocol (64 x 512 calibration windows, clipping on, 40 eval windows = 20,440 tokens), run once by
hand with `qtool quantize` (2026-11-21, CPU): FP 29.189; W4A4 k=0 26277; k=128 58.42; k=256 47.03; W4A4 recipe
(down_proj W8A8) 32.04; W8A8 recipe 29.233 (+0.15%).
"""

from __future__ import annotations

import json
import re

import pytest

from conftest import ROOT, WIKITEXT, write_recipe

pytestmark = pytest.mark.slow

ARGS = ["--num-samples", "8", "--seq-len", "256", "--no-eval", "--json"]
EVAL = ["--seq-len", "512", "--windows", "4", "--device", "cpu", "--json"]


def _no_clip(text: str) -> str:
    return text.replace("    clip: true", "    clip: false")


def _all_4bit(text: str, outliers: int) -> str:
    text = re.sub(r"outliers: 256 ", f"outliers: {outliers} ", text)
    return re.sub(r"\n    overrides:.*?(?=\neval:)", "", text, flags=re.S)


@pytest.fixture(scope="module")
def ppl(tmp_path_factory, smollm2):
    from click.testing import CliRunner

    from qtool.cli import cli

    tmp = tmp_path_factory.mktemp("smollm2-quik")
    w4 = _no_clip((ROOT / "recipes" / "quik-w4a4.yaml").read_text())
    recipes = {f"w4a4-k{k}": _all_4bit(w4, k) for k in (0, 128, 256)}
    recipes["w4a4-recipe"] = w4
    recipes["w8a8-recipe"] = _no_clip((ROOT / "recipes" / "quik-w8a8.yaml").read_text())
    run = CliRunner()

    def invoke(*args) -> dict:
        res = run.invoke(cli, [str(a) for a in args], catch_exceptions=False)
        assert res.exit_code == 0, res.output
        return json.loads(res.stdout)

    out = {"fp": invoke("eval", smollm2, "--text", WIKITEXT, *EVAL)["perplexity"]}
    for name, text in recipes.items():
        # Written beside the shipped recipes so their relative data paths resolve the same way.
        recipe = write_recipe(ROOT / "recipes" / f".test-{name}.yaml", text)
        try:
            invoke("quantize", recipe, "--model", smollm2, "-o", tmp / name, *ARGS)
        finally:
            recipe.unlink()
        ev = invoke("eval", tmp / name, "--text", WIKITEXT, *EVAL)
        assert ev["windows"] == 4 and ev["protocol"]["seq_len"] == 512
        out[name] = ev["perplexity"]
    print({k: round(v, 3) for k, v in out.items()})
    return out


def test_outliers_rescue_w4a4(ppl):
    assert ppl["w4a4-k0"] > 10 * ppl["w4a4-k128"], ppl  # 0 outliers: far worse


def test_256_outliers_no_worse_than_128(ppl):
    assert ppl["w4a4-k256"] <= ppl["w4a4-k128"] * 1.01, ppl


def test_8bit_down_proj_beats_all_4bit(ppl):
    assert ppl["w4a4-recipe"] < ppl["w4a4-k256"], ppl


def test_w8a8_within_2_percent_of_fp(ppl):
    assert ppl["w8a8-recipe"] <= ppl["fp"] * 1.02, ppl
