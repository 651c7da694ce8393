"""Outputs never destroy inputs: an output that is, lies inside or holds what the command reads (the model, the
checkpoint it packs or exports, the calibration or evaluation text, a stats file, the recipe) is refused in one
line before anything is read or written, even with --overwrite, and the input keeps every byte. A recipe's own
`output:` must resolve inside the recipe's folder or the working directory; elsewhere it takes the command line's
-o. An output that is refused anyway (it exists) is refused before the model's tokenizer or text is read.

Exit codes: 2 usage, 3 recipe."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from bad_input import assert_nothing_at, assert_one_line_error, run_cli
from conftest import STORIES, TINY_SAMPLE, write_recipe

pytestmark = pytest.mark.skipif(not STORIES.is_dir(), reason="stories260K assets not found")

USAGE, RECIPE = 2, 3


def snapshot(folder: Path) -> dict[str, bytes]:
    if folder.is_file():
        return {folder.name: folder.read_bytes()}
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("good")
    recipe = write_recipe(
        tmp / "r.yaml", f"model: {STORIES}\nstages: [{{stage: rtn, bits: 4, group_size: 32}}]\n"
    )
    res = run_cli(["quantize", recipe, "-o", tmp / "ckpt", "-q"])
    assert res.exit_code == 0, res.output
    return tmp / "ckpt"


@pytest.fixture
def world(tmp_path, ckpt) -> dict[str, Path]:
    """Copies of what the commands read, in tmp_path."""
    model = tmp_path / "model"
    shutil.copytree(STORIES, model)
    for p in model.iterdir():
        p.chmod(0o644)
    texts = tmp_path / "texts"
    texts.mkdir()
    shutil.copy(TINY_SAMPLE, texts / "cal.txt")
    c = tmp_path / "ckpt"
    shutil.copytree(ckpt, c)
    recipe = write_recipe(
        tmp_path / "r.yaml",
        f"model: {model}\ncalibration: {{source: {texts / 'cal.txt'}, num_samples: 2, seq_len: 32}}\n"
        f"stages: [{{stage: gptq, bits: 4, group_size: 32}}]\n",
    )
    return {
        "model": model,
        "texts": texts,
        "cal": texts / "cal.txt",
        "ckpt": c,
        "recipe": recipe,
        "tmp": tmp_path,
    }


# (command built from the paths, the output, the input that must keep its bytes, words)
CASES = {
    "export-onto-its-checkpoint": (
        lambda w: ["export", w["ckpt"], "--format", "compressed-tensors", "-o", w["ckpt"], "--overwrite"],
        "ckpt",
        ["is the checkpoint", "apart from what the command reads"],
    ),
    "export-inside-its-checkpoint": (
        lambda w: ["export", w["ckpt"], "--format", "compressed-tensors", "-o", w["ckpt"] / "ct"],
        "ckpt",
        ["is inside the checkpoint"],
    ),
    "export-into-a-folder-holding-the-checkpoint": (
        lambda w: ["export", w["ckpt"], "--format", "compressed-tensors", "-o", w["tmp"], "--overwrite"],
        "ckpt",
        ["holds the checkpoint"],
    ),
    "gptq-export-onto-its-checkpoint": (
        lambda w: ["export", w["ckpt"], "--format", "gptq", "-o", w["ckpt"], "--overwrite"],
        "ckpt",
        ["is the checkpoint", "apart from what the command reads"],
    ),
    "pack-onto-its-checkpoint": (
        lambda w: ["pack", w["ckpt"], "-o", w["ckpt"], "--overwrite"],
        "ckpt",
        ["is the checkpoint"],
    ),
    "pack-inside-its-checkpoint": (
        lambda w: ["pack", w["ckpt"], "-o", w["ckpt"] / "copy"],
        "ckpt",
        ["is inside"],
    ),
    "quantize-onto-the-model": (
        lambda w: ["quantize", w["recipe"], "-o", w["model"], "--overwrite"],
        "model",
        ["is the model"],
    ),
    "quantize-inside-the-model": (
        lambda w: ["quantize", w["recipe"], "-o", w["model"] / "ckpt"],
        "model",
        ["is inside the model"],
    ),
    "quantize-onto-the-calibration-text": (
        lambda w: ["quantize", w["recipe"], "-o", w["cal"], "--overwrite"],
        "cal",
        ["is the calibration text"],
    ),
    "quantize-into-a-folder-holding-the-text": (
        lambda w: ["quantize", w["recipe"], "-o", w["texts"], "--overwrite"],
        "texts",
        ["holds the calibration text"],
    ),
    "quantize-into-a-folder-holding-the-recipe": (
        lambda w: ["quantize", w["recipe"], "-o", w["tmp"], "--overwrite"],
        "model",
        ["holds the recipe"],
    ),
    "quantize-onto-the-stats-file": (
        lambda w: ["quantize", w["recipe"], "--stats", w["cal"], "-o", w["cal"], "--overwrite"],
        "cal",
        ["is the"],
    ),
    "calibrate-onto-the-model-weights": (
        lambda w: ["calibrate", w["recipe"], "-o", w["model"] / "model.safetensors"],
        "model",
        ["is inside the model"],
    ),
    "calibrate-onto-the-calibration-text": (
        lambda w: ["calibrate", w["recipe"], "-o", w["cal"]],
        "cal",
        ["is the calibration text"],
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_output_that_would_destroy_an_input_is_refused(name, world, no_work):
    build, kept, words = CASES[name]
    before = snapshot(world[kept])
    res = run_cli([*build(world), "-q"])
    assert_one_line_error(res, USAGE, "output '", *words)
    assert snapshot(world[kept]) == before
    assert not list(world["tmp"].rglob(".*.tmp-*"))


# ---- a recipe's output ------------------------------------------------------------------------------------------


def recipe_in(folder: Path, output: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    return write_recipe(
        folder / "r.yaml", f"model: {STORIES}\nstages: [{{stage: rtn, group_size: 32}}]\noutput: {output}\n"
    )


@pytest.mark.parametrize(
    "output, words",
    [
        (
            "../../elsewhere/ckpt",
            ["r.yaml:output: resolves to", "elsewhere/ckpt", "outside the recipe's folder"],
        ),
        ("{tmp}/other/ckpt", ["r.yaml:output", "other/ckpt", "--output to write there"]),
        (
            "link/ckpt",
            ["r.yaml:output", "outside/ckpt"],
        ),  # a link in the recipe's folder that leads out of it
    ],
)
def test_recipe_output_outside_its_folder_and_the_working_directory(tmp_path, no_work, output, words):
    (tmp_path / "outside").mkdir()
    recipes = tmp_path / "a" / "b" / "recipes"
    recipe = recipe_in(recipes, output.format(tmp=tmp_path))
    (recipes / "link").symlink_to(tmp_path / "outside")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    res = run_cli(["quantize", recipe, "-q"], cwd=cwd)
    assert_one_line_error(res, RECIPE, *words)
    assert_nothing_at(
        [tmp_path / "elsewhere" / "ckpt", tmp_path / "other" / "ckpt", tmp_path / "outside" / "ckpt"]
    )
    assert not (tmp_path / "elsewhere").exists() and not (tmp_path / "other").exists()


def test_recipe_output_inside_the_working_directory_or_given_with_o_is_written(tmp_path):
    recipes = tmp_path / "recipes"
    recipe = recipe_in(recipes, "../out/ckpt")  # the shipped recipes' layout, run from the checkout
    assert run_cli(["quantize", recipe, "-q"], cwd=tmp_path).exit_code == 0
    assert (tmp_path / "out" / "ckpt" / "qtool-manifest.json").is_file()
    res = run_cli(["quantize", recipe, "-q", "-o", tmp_path / "elsewhere" / "ckpt"], cwd=recipes)
    assert res.exit_code == 0, res.output
    assert (tmp_path / "elsewhere" / "ckpt" / "qtool-manifest.json").is_file()


def test_existing_output_is_refused_before_the_tokenizer_or_text_is_read(world, monkeypatch, no_work):
    import qtool.calibration.data as data
    import qtool.models.loading as loading

    def never(*a, **k):
        raise AssertionError("read before the output was checked")

    monkeypatch.setattr(loading, "load_tokenizer", never)
    monkeypatch.setattr(data, "read_documents", never)
    (world["tmp"] / "out").mkdir()
    (world["tmp"] / "out" / "x").write_text("mine")
    res = run_cli(["quantize", world["recipe"], "-o", world["tmp"] / "out", "-q"])
    assert_one_line_error(res, USAGE, "already exists", "--overwrite")
    res = run_cli(["calibrate", world["recipe"], "-o", world["tmp"] / "out", "-q"])
    assert_one_line_error(res, USAGE, "is a directory")
    assert_nothing_at(world["tmp"] / "new")
