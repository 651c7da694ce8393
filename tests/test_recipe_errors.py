"""Every recipe problem is one line naming file:key, what was found and what was expected, exit code 3 (4 for a
file the recipe names that does not exist), before any model is loaded."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import STORIES, TINY_SAMPLE, write_recipe

GOOD = f"""
model: {STORIES}
calibration:
  source: {TINY_SAMPLE}
  num_samples: 4
  seq_len: 64
stages:
  - stage: gptq
    bits: 4
    group_size: 32
output: out
"""


def _run(cli, tmp_path: Path, text: str, *extra: str):
    recipe = write_recipe(tmp_path / "r.yaml", text)
    return cli("quantize", recipe, *extra)


def _one_line_error(result, *fragments: str, code: int = 3) -> str:
    assert result.exit_code == code, result.output
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("qtool: error: "), result.output
    assert "Traceback" not in result.output
    for f in fragments:
        assert f in lines[0], (f, lines[0])
    return lines[0]


def test_malformed_yaml(cli, tmp_path):
    res = _run(cli, tmp_path, "model: x\nstages: [\n  - stage: gptq\n")
    _one_line_error(res, "r.yaml", "malformed YAML", "line")


def test_unknown_stage(cli, tmp_path):
    res = _run(cli, tmp_path, GOOD.replace("stage: gptq", "stage: gptqq"))
    _one_line_error(res, "r.yaml:stages[0].stage", "'gptqq'", "expected one of", "gptq", "rtn")


@pytest.mark.parametrize(
    "line,key,found",
    [
        ("bits: 9", "stages[0].bits", "9"),
        ("bits: 1", "stages[0].bits", "1"),
        ("group_size: 0", "stages[0].group_size", "0"),
    ],
)
def test_option_out_of_range(cli, tmp_path, line, key, found):
    res = _run(
        cli,
        tmp_path,
        GOOD.replace("bits: 4", line) if "bits" in line else GOOD.replace("group_size: 32", line),
    )
    msg = _one_line_error(res, f"r.yaml:{key}", f"found {found}")
    assert "expected an integer" in msg


def test_wrong_type(cli, tmp_path):
    res = _run(cli, tmp_path, GOOD.replace("bits: 4", "bits: four"))
    _one_line_error(res, "r.yaml:stages[0].bits", "found 'four'", "expected an integer in 2..8")


def test_unknown_option_and_top_level_key(cli, tmp_path):
    _one_line_error(
        _run(cli, tmp_path, GOOD.replace("bits: 4", "bitz: 4")), "stages[0].bitz", "unknown option"
    )
    _one_line_error(_run(cli, tmp_path, GOOD + "modle: x\n"), "r.yaml:modle", "unknown key")


def test_missing_model_path(cli, tmp_path):
    res = _run(cli, tmp_path, GOOD.replace(str(STORIES), "./no/such/model"))
    _one_line_error(res, "r.yaml:model", "does not exist", "expected a model directory or a hub id", code=4)


def test_missing_model_path_from_flag_names_the_flag(cli, tmp_path):
    res = _run(cli, tmp_path, GOOD, "--model", str(tmp_path / "nothing"))
    _one_line_error(res, "--model", "does not exist", code=4)


def test_missing_calibration_file(cli, tmp_path):
    res = _run(cli, tmp_path, GOOD.replace(str(TINY_SAMPLE), "./missing.txt"))
    _one_line_error(res, "r.yaml:calibration.source", "does not exist", code=4)


def test_gptq_without_calibration(cli, tmp_path):
    text = "\n".join(
        ln
        for ln in GOOD.splitlines()
        if "calibration" not in ln and "source" not in ln and "num_samples" not in ln and "seq_len" not in ln
    )
    _one_line_error(_run(cli, tmp_path, text), "r.yaml:calibration", "missing", "gptq")


def test_act_order_needs_static_groups(cli, tmp_path):
    res = _run(cli, tmp_path, GOOD.replace("bits: 4", "bits: 4\n    act_order: true"))
    _one_line_error(res, "stages[0].static_groups", "act_order")


def test_overlapping_targets_are_refused(cli, tmp_path):
    text = GOOD + "  - stage: rtn\n    bits: 8\n    targets:\n      include: ['*.down_proj']\n"
    text = text.replace("output: out\n", "") + "output: out\n"
    res = _run(cli, tmp_path, text)
    assert res.exit_code == 3
    assert "targeted by stages[0] (gptq) and stages[1] (rtn)" in res.output


def test_valid_recipe_fills_defaults(tmp_path):
    from qtool.recipe import load_recipe

    r = load_recipe(write_recipe(tmp_path / "r.yaml", GOOD), {"calibration.num_samples": 8})
    assert r.calibration.num_samples == 8
    stage = r.as_run["stages"][0]
    assert stage["damp"] == 0.01 and stage["symmetric"] is True and stage["targets"]["include"] == ["*"]
    assert r.output == str((tmp_path / "out").resolve())
