"""The matrix of docs/families.md: every stage on every declared family and every weight-only stage on the
generic fallback quantizes, `qtool pack` verifies it, it loads, generates, evaluates (perplexity) and exports to
compressed-tensors where that format holds the layout (else the export is refused in one line). Random-weight
models from each family's own config class (tests/families.py)."""

from __future__ import annotations

import json

import pytest
import torch

from bad_input import assert_one_line_error, run_cli
from conftest import STORIES, TINY_SAMPLE
from families import FAMILIES, GENERIC, MOE
from test_families import ALLOWED, GPTQ, _ids, _recipe

pytestmark = pytest.mark.skipif(not STORIES.is_dir(), reason="stories260K assets not found")

# The matrix: every stage on every family. The QoQ row runs the transforms the family allows before it.
STAGES = {
    "rtn": "  - stage: rtn\n    bits: 4\n    group_size: 32\n",
    "gptq": GPTQ,
    "outliers": "  - stage: outliers\n    bits: 4\n    act_bits: 4\n    outliers: 8\n",
    "progressive": "  - stage: progressive\n    bits: 4\n    group_size: 32\n    solver: gptq\n",
    "mixed": "  - stage: mixed\n    group_size: 16\n    scale_group_size: 16\n    outlier_fraction: 0.002\n",
    "vq": "  - stage: vq\n    preset: gptvq-2\n    kmeans_iters: 4\n",
    "kv_cache": "  - stage: kv_cache\n    bits: 4\n  - stage: rtn\n    bits: 4\n    group_size: 32\n",
    "vq_kv": "  - stage: vq_kv\n    preset: cq-2\n    entries: 16\n  - stage: rtn\n    bits: 4\n    group_size: 32\n",
}
EXPORTS = {"rtn", "gptq"}  # grouped-int with whole groups: what compressed-tensors holds
WEIGHT_ONLY = ("rtn", "gptq", "outliers", "progressive", "mixed", "vq")


def _stages(name: str, stage: str) -> str:
    if stage != "progressive" or name in GENERIC:
        return STAGES[stage]
    kv = "  - stage: kv_cache\n    bits: 4\n"
    return "".join(f"  - stage: {s}\n" for s in ALLOWED[name]) + kv + STAGES[stage]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "stage"),
    [(n, s) for n in {**FAMILIES, **MOE} for s in STAGES] + [(n, s) for n in GENERIC for s in WEIGHT_ONLY],
)
def test_every_stage_quantizes_verifies_loads_evaluates_exports_and_generates(tmp_path, family, name, stage):
    import qtool
    from qtool.checkpoint.loader import read_config

    model_dir = family(name)
    out = tmp_path / "ckpt"
    recipe = _recipe(tmp_path / "r.yaml", model_dir, _stages(name, stage), out)
    res = run_cli(["quantize", recipe, "-q", "--json"])
    assert res.exit_code == 0, res.output
    res = run_cli(["pack", out, "--json"])
    assert res.exit_code == 0 and json.loads(res.stdout)["verified"], res.output
    qcfg = read_config(out)["quantization_config"]  # the model's config, layers by module name
    # every linear of both blocks: 4 attention and, per expert, gate, up and down (Qwen2-MoE: a shared expert too)
    per_block = {"phi3": 4, "mixtral": 4 + 12, "qwen3_moe": 4 + 12, "qwen2_moe": 4 + 12 + 3}.get(name, 7)
    assert len(qcfg["layers"]) == 2 * per_block
    assert ("kv_cache" in qcfg) == (
        stage in ("kv_cache", "vq_kv") or (stage == "progressive" and name not in GENERIC)
    )
    if stage == "progressive" and name not in GENERIC:
        manifest = json.loads((out / "qtool-manifest.json").read_text())
        assert {t["stage"] for t in manifest["transforms"]} == set(ALLOWED[name])
    model = qtool.load(out)
    with torch.no_grad():
        logits = model(_ids()).logits
        tokens = model.generate(_ids(8), max_new_tokens=3, do_sample=False)
    assert bool(torch.isfinite(logits).all()) and tokens.shape == (1, 11)
    res = run_cli(["eval", out, "--text", TINY_SAMPLE, "--seq-len", "64", "--windows", "2", "--json"])
    assert res.exit_code == 0, res.output
    ppl = json.loads(res.stdout)["perplexity"]
    assert 1 < ppl < 1e6, ppl
    res = run_cli(["export", out, "--format", "compressed-tensors", "-o", tmp_path / "ct", "-q"])
    if stage in EXPORTS:
        assert res.exit_code == 0, res.output
    else:
        assert_one_line_error(res, 2, "compressed-tensors cannot express it")
