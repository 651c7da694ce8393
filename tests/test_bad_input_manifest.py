"""Manifests and shard indexes are untrusted input. A file entry is a plain name inside the checkpoint folder (no
separator, no `..`, nothing hidden), with a sha256 digest and a size in bytes; the figures the manifest derives
from the tensors (bits per weight) are recomputed by `qtool pack --verify` and compared; a shard index names
shards of its own folder. Each break is refused in one line naming the entry, before any file outside the folder
is opened and without a byte written (the checkpoint stays as it was, the re-pack output never appears).

Exit codes: 4 input (an original model's index), 5 checkpoint."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from bad_input import assert_nothing_at, assert_one_line_error, run_cli
from conftest import STORIES, TINY_SAMPLE, write_recipe

pytestmark = pytest.mark.skipif(not STORIES.is_dir(), reason="stories260K assets not found")

INPUT, CHECKPOINT = 4, 5
MANIFEST = "qtool-manifest.json"
INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("good")
    recipe = write_recipe(
        tmp / "r.yaml", f"model: {STORIES}\nstages: [{{stage: rtn, bits: 4, group_size: 32}}]\n"
    )
    res = run_cli(["quantize", recipe, "-o", tmp / "ckpt", "-q"])
    assert res.exit_code == 0, res.output
    return tmp / "ckpt"


@pytest.fixture(scope="module")
def sharded(tmp_path_factory, ckpt) -> Path:
    """The same checkpoint re-packed into shards with an index."""
    out = tmp_path_factory.mktemp("sharded") / "ckpt"
    res = run_cli(["pack", ckpt, "-o", out, "--max-shard-size", "100KB", "-q"])
    assert res.exit_code == 0, res.output
    assert (out / INDEX).is_file()
    return out


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def edit_manifest(edit: Callable[[dict], object]):
    def breaker(c: Path) -> None:
        m = json.loads((c / MANIFEST).read_text())
        edit(m)
        (c / MANIFEST).write_text(json.dumps(m))

    return breaker


def outside_entry(name: str):
    """A manifest entry `name` for a file outside the folder, with that file's true hash and size: only the name
    can tell it apart."""

    def breaker(c: Path) -> None:
        target = (c / name) if not name.startswith("/") else Path(name)
        if not name.startswith("/"):
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text("a file that is not the checkpoint's\n")
        data = target.read_bytes()
        m = json.loads((c / MANIFEST).read_text())
        m["files"][name] = hashlib.sha256(data).hexdigest()
        m["sizes"][name] = len(data)
        (c / MANIFEST).write_text(json.dumps(m))

    return breaker


def set_bits(key: str, value):
    return edit_manifest(lambda m: m["bits_per_weight"].__setitem__(key, value))


def edit_index(entry: str):
    def breaker(c: Path) -> None:
        ix = json.loads((c / INDEX).read_text())
        name = sorted(ix["weight_map"])[0]
        ix["weight_map"][name] = entry
        (c / INDEX).write_text(json.dumps(ix))
        m = json.loads((c / MANIFEST).read_text())
        data = (c / INDEX).read_bytes()
        m["files"][INDEX], m["sizes"][INDEX] = hashlib.sha256(data).hexdigest(), len(data)
        (c / MANIFEST).write_text(json.dumps(m))

    return breaker


# name -> (which checkpoint, command, breaker, words)
CASES = {
    "entry-climbs-out": (
        "ckpt",
        "pack",
        outside_entry("../outside.txt"),
        ["files: found the entry '../outside.txt'"],
    ),
    "entry-climbs-out-quick": (
        "ckpt",
        "quick",
        outside_entry("../outside.txt"),
        ["'../outside.txt'", "no '..'"],
    ),
    "entry-climbs-out-at-eval": ("ckpt", "eval", outside_entry("../../outside.txt"), ["'../../outside.txt'"]),
    "entry-climbs-out-at-export": ("ckpt", "export", outside_entry("../outside.txt"), ["'../outside.txt'"]),
    "entry-absolute": (
        "ckpt",
        "pack",
        outside_entry("/etc/hostname"),
        ["files: found the entry '/etc/hostname'"],
    ),
    "entry-in-a-subfolder": ("ckpt", "pack", outside_entry("sub/notes.txt"), ["'sub/notes.txt'"]),
    "entry-dot-dot": (
        "ckpt",
        "pack",
        edit_manifest(lambda m: m["files"].update({"..": "0" * 64})),
        ["entry '..'"],
    ),
    "entry-hidden": ("ckpt", "pack", outside_entry(".hidden"), ["entry '.hidden'"]),
    "entry-backslash": (
        "ckpt",
        "pack",
        edit_manifest(lambda m: m["files"].update({"..\\x": "0" * 64})),
        ["entry '..\\\\x'"],
    ),
    "entry-the-manifest-itself": (
        "ckpt",
        "pack",
        edit_manifest(lambda m: m["files"].update({MANIFEST: "0" * 64})),
        [f"entry '{MANIFEST}'"],
    ),
    "digest-not-hex": (
        "ckpt",
        "pack",
        edit_manifest(lambda m: m["files"].update({"config.json": "sha256:abc"})),
        ["files['config.json']: found 'sha256:abc'", "sha256 hex digest"],
    ),
    "digest-a-number": (
        "ckpt",
        "eval",
        edit_manifest(lambda m: m["files"].update({"config.json": 7})),
        ["files['config.json']: found 7"],
    ),
    "size-negative": (
        "ckpt",
        "pack",
        edit_manifest(lambda m: m["sizes"].update({"config.json": -1})),
        ["sizes['config.json']: found -1", "number of bytes"],
    ),
    "size-a-float": (
        "ckpt",
        "quick",
        edit_manifest(lambda m: m["sizes"].update({"config.json": 12.5})),
        ["sizes['config.json']: found 12.5"],
    ),
    "size-of-an-unlisted-file": (
        "ckpt",
        "pack",
        edit_manifest(lambda m: m["sizes"].update({"other.bin": 3})),
        ["sizes: found the entry 'other.bin'", "files does not list"],
    ),
    "bits-per-weight-edited": (
        "ckpt",
        "pack",
        set_bits("quantized_linears", 1.5),
        ["bits_per_weight.quantized_linears: found 1.5", "tensors give 4.", "edited"],
    ),
    "bits-all-parameters-edited": (
        "ckpt",
        "pack",
        set_bits("all_parameters", 16.0),
        ["bits_per_weight.all_parameters: found 16.0"],
    ),
    "bits-extra-figure": (
        "ckpt",
        "pack",
        set_bits("paper", 2.0),
        ["bits_per_weight.paper: found 2.0", "give None"],
    ),
    "bits-missing": (
        "ckpt",
        "pack",
        edit_manifest(lambda m: m.pop("bits_per_weight")),
        ["bits_per_weight: found None"],
    ),
    "index-entry-climbs-out": (
        "sharded",
        "pack",
        edit_index("../model-00001-of-00002.safetensors"),
        [INDEX, "weight_map['", "found '../model-00001-of-00002.safetensors'", "no path"],
    ),
    "index-entry-absolute": (
        "sharded",
        "eval",
        edit_index("/tmp/model.safetensors"),
        ["weight_map['", "'/tmp/model.safetensors'"],
    ),
    "index-entry-not-a-shard": (
        "sharded",
        "pack",
        edit_index("config.json"),
        ["found 'config.json'", ".safetensors"],
    ),
    "index-entry-not-a-string": ("sharded", "quick", edit_index(None), ["found None"]),
}


def command(kind: str, c: Path, out: Path) -> list:
    return {
        "pack": ["pack", c, "-o", out],
        "quick": ["pack", c, "--quick"],
        "eval": ["eval", c, "--text", TINY_SAMPLE, "--seq-len", "32", "--windows", "1"],
        "export": ["export", c, "--format", "compressed-tensors", "-o", out],
    }[kind]


@pytest.mark.parametrize("name", list(CASES))
def test_bad_manifest_or_index_is_refused_byte_for_byte(name, ckpt, sharded, tmp_path):
    which, kind, breaker, words = CASES[name]
    c = tmp_path / "ckpt"
    shutil.copytree({"ckpt": ckpt, "sharded": sharded}[which], c)
    breaker(c)
    before = snapshot(c)
    res = run_cli([*command(kind, c, tmp_path / "out"), "-q"])
    assert_one_line_error(res, CHECKPOINT, *words, output=tmp_path / "out")
    assert snapshot(c) == before


def test_python_load_refuses_an_entry_outside_the_folder(ckpt, tmp_path):
    from qtool import load
    from qtool.errors import CheckpointError

    c = tmp_path / "ckpt"
    shutil.copytree(ckpt, c)
    outside_entry("../outside.txt")(c)
    with pytest.raises(CheckpointError, match=r"files: found the entry '\.\./outside\.txt'"):
        load(c, verify=True)


@pytest.mark.parametrize(
    "entry, words",
    [
        ("../model-00001-of-00002.safetensors", ["weight_map['", "'../model-00001-of-00002.safetensors'"]),
        ("/etc/hostname", ["'/etc/hostname'"]),
        ("tokenizer.json", ["'tokenizer.json'", ".safetensors"]),
    ],
)
def test_original_model_index_pointing_outside_is_refused(tmp_path, entry, words):
    from safetensors.torch import load_file, save_file

    model = tmp_path / "model"
    shutil.copytree(STORIES, model)
    for p in model.iterdir():
        p.chmod(0o644)
    t = load_file(str(model / "model.safetensors"))
    save_file(t, str(model / "model-00001-of-00001.safetensors"), metadata={"format": "pt"})
    (model / "model.safetensors").unlink()
    weight_map = dict.fromkeys(t, "model-00001-of-00001.safetensors")
    weight_map[sorted(t)[0]] = entry
    (model / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    before = snapshot(model)
    recipe = write_recipe(tmp_path / "r.yaml", f"model: {model}\nstages: [{{stage: rtn, group_size: 32}}]\n")
    res = run_cli(["quantize", recipe, "-o", tmp_path / "out", "-q"])
    assert_one_line_error(res, INPUT, INDEX, *words, output=tmp_path / "out")
    assert snapshot(model) == before
    assert_nothing_at(tmp_path / "out")


def test_intact_checkpoint_verifies_with_the_recomputed_figures(ckpt):
    res = run_cli(["pack", ckpt, "--json"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    assert summary["verified"] is True
    assert summary["bits_per_weight"] == json.loads((ckpt / MANIFEST).read_text())["bits_per_weight"]
