"""--resume verifies what it resumes. A work folder (`.out.partial`) left by a run interrupted after block 1 is
broken one way per case: a garbled or hand-edited state.json, a finished block's file changed (a NaN written into
it, truncated, replaced, deleted), the activations changed. Each is refused in one line naming the file and the
key, before any model or text is read, with nothing written at the output and the work folder left byte for byte
as it was; the intact folder resumes to the uninterrupted run's checkpoint, byte for byte, and `--overwrite` is
the way out of a broken one.

Exit codes: 2 usage, 5 checkpoint (the work folder is a checkpoint in the making)."""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from bad_input import assert_one_line_error, leftovers, run_cli
from conftest import FAST_RECIPE, STORIES

pytestmark = pytest.mark.skipif(not STORIES.is_dir(), reason="stories260K assets not found")

USAGE, CHECKPOINT = 2, 5
STATE = "state.json"
BLOCK1 = "block-00001.safetensors"
INPUTS = "inputs-00002.bin"

RECIPE = FAST_RECIPE


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """(a folder holding the recipe and the work folder of a run interrupted after block 1, the uninterrupted
    run's file hashes)."""
    import qtool.checkpoint.partial as partial

    folder = tmp_path_factory.mktemp("interrupted")
    (folder / "r.yaml").write_text(RECIPE)
    res = run_cli(["quantize", folder / "r.yaml", "-q"])
    assert res.exit_code == 0, res.output
    reference = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (folder / "out").iterdir()}
    shutil.rmtree(folder / "out")

    mp = pytest.MonkeyPatch()
    real = partial.Work.commit

    def commit_then_ctrl_c(self, i, *a, **k):
        real(self, i, *a, **k)
        if i == 1:
            raise KeyboardInterrupt

    mp.setattr(partial.Work, "commit", commit_then_ctrl_c)
    try:
        res = run_cli(["quantize", folder / "r.yaml", "-q"])
    finally:
        mp.undo()
    assert res.exit_code == 130, res.output
    work = folder / ".out.partial"
    assert sorted(p.name for p in work.iterdir()) == ["block-00000.safetensors", BLOCK1, INPUTS, STATE]
    return folder, reference


def copy_run(interrupted, tmp: Path) -> Path:
    src, _ = interrupted
    shutil.copy(src / "r.yaml", tmp / "r.yaml")
    shutil.copytree(src / ".out.partial", tmp / ".out.partial")
    return tmp / ".out.partial"


def edit_state(edit: Callable[[dict], object]):
    def breaker(work: Path) -> None:
        state = json.loads((work / STATE).read_text())
        edit(state)
        (work / STATE).write_text(json.dumps(state))

    return breaker


def write(name: str, data: bytes):
    return lambda work: (work / name).write_bytes(data)


def nan_in_block(work: Path) -> None:
    """A NaN written into a finished block's scales, the file re-saved as safetensors (valid, same size)."""
    t = load_file(str(work / BLOCK1))
    name = next(n for n in sorted(t) if n.endswith(".scales"))
    t[name] = t[name].clone()
    t[name].view(-1)[0] = float("nan")
    size = (work / BLOCK1).stat().st_size
    save_file(t, str(work / BLOCK1), metadata={"format": "pt"})
    assert (work / BLOCK1).stat().st_size == size


def garble_header(work: Path) -> None:
    data = bytearray((work / BLOCK1).read_bytes())
    data[8:24] = b"\x00garbage-header!"
    (work / BLOCK1).write_bytes(bytes(data))


def other_block(work: Path) -> None:
    """Block 0's file in block 1's place: a valid safetensors file of another block."""
    shutil.copy(work / "block-00000.safetensors", work / BLOCK1)


def nan_in_inputs(work: Path) -> None:
    data = bytearray((work / INPUTS).read_bytes())
    data[0:4] = struct.pack("<f", float("nan"))
    (work / INPUTS).write_bytes(bytes(data))


def set_linear_bits(state: dict) -> None:
    summary = next(iter(state["blocks"][1]["linears"].values()))
    summary["stored_bits"] //= 2


CASES = {
    "state-truncated": (
        CHECKPOINT,
        [STATE, "not readable JSON"],
        lambda w: (w / STATE).write_text('{"identity": {'),
    ),
    "state-empty": (CHECKPOINT, [STATE, "not readable JSON"], write(STATE, b"")),
    "state-a-list": (CHECKPOINT, [STATE, "found a JSON list"], write(STATE, b"[1, 2]")),
    "state-not-utf8": (CHECKPOINT, [STATE, "not readable JSON"], write(STATE, b"\xff\xfe{}")),
    "state-missing": (
        CHECKPOINT,
        ["no state.json", "block-00000.safetensors"],
        lambda w: (w / STATE).unlink(),
    ),
    "identity-missing-key": (
        CHECKPOINT,
        ["identity: found"],
        edit_state(lambda s: s["identity"].pop("seed")),
    ),
    "next-block-a-string": (
        CHECKPOINT,
        ["next_block: found '2'"],
        edit_state(lambda s: s.update(next_block="2")),
    ),
    "next-block-beyond-the-model": (
        CHECKPOINT,
        ["next_block: found 9", "expected an integer in 0..5"],
        edit_state(lambda s: s.update(next_block=9)),
    ),
    "next-block-ahead-of-the-blocks": (
        CHECKPOINT,
        ["blocks: found", "the 3 finished blocks"],
        edit_state(lambda s: s.update(next_block=3)),
    ),
    "next-block-zero-with-blocks": (
        CHECKPOINT,
        ["blocks: found"],
        edit_state(lambda s: s.update(next_block=0)),
    ),
    "overwrite-not-a-boolean": (
        CHECKPOINT,
        ["overwrite: found 'yes'"],
        edit_state(lambda s: s.update(overwrite="yes")),
    ),
    "block-without-its-file-record": (
        CHECKPOINT,
        ["blocks[1]: found"],
        edit_state(lambda s: s["blocks"][1].pop("file")),
    ),
    "block-hash-not-hex": (
        CHECKPOINT,
        ["blocks[0]: found"],
        edit_state(lambda s: s["blocks"][0]["file"].update(sha256="xyz")),
    ),
    "block-record-edited": (
        CHECKPOINT,
        [STATE, "block 1's record", "record_sha256"],
        edit_state(set_linear_bits),
    ),
    "inputs-dtype-unknown": (
        CHECKPOINT,
        ["inputs.dtype: found 'float8'", "float32"],
        edit_state(lambda s: s["inputs"].update(dtype="float8")),
    ),
    "inputs-dtype-integer": (
        CHECKPOINT,
        ["inputs.dtype: found 'int64'"],
        edit_state(lambda s: s["inputs"].update(dtype="int64")),
    ),
    "inputs-dtype-a-number": (
        CHECKPOINT,
        ["inputs.dtype: found 32"],
        edit_state(lambda s: s["inputs"].update(dtype=32)),
    ),
    "inputs-negative-shape": (
        CHECKPOINT,
        ["inputs.shapes: found"],
        edit_state(lambda s: s["inputs"]["shapes"][0].__setitem__(0, -1)),
    ),
    "inputs-parts-do-not-add-up": (
        CHECKPOINT,
        ["inputs.parts: found [3]", "2 in all"],
        edit_state(lambda s: s["inputs"].update(parts=[3])),
    ),
    "inputs-hash-missing": (
        CHECKPOINT,
        ["inputs.sha256: found None"],
        edit_state(lambda s: s["inputs"].pop("sha256")),
    ),
    "inputs-a-list": (CHECKPOINT, ["inputs: found [1]"], edit_state(lambda s: s.update(inputs=[1]))),
    "nan-in-a-finished-block": (CHECKPOINT, [BLOCK1, "sha256 does not match"], nan_in_block),
    "finished-block-truncated": (
        CHECKPOINT,
        [BLOCK1, "bytes, state.json records"],
        lambda w: (w / BLOCK1).write_bytes((w / BLOCK1).read_bytes()[:1000]),
    ),
    "finished-block-garbled-header": (CHECKPOINT, [BLOCK1, "garbled safetensors header"], garble_header),
    "finished-block-of-another-block": (CHECKPOINT, [BLOCK1], other_block),
    "finished-block-deleted": (CHECKPOINT, [BLOCK1, "missing"], lambda w: (w / BLOCK1).unlink()),
    "nan-in-the-activations": (CHECKPOINT, [INPUTS, "sha256 does not match"], nan_in_inputs),
    "activations-truncated": (
        CHECKPOINT,
        [INPUTS, "bytes, its state.json says"],
        lambda w: (w / INPUTS).write_bytes((w / INPUTS).read_bytes()[:100]),
    ),
    "activations-deleted": (CHECKPOINT, [INPUTS, "missing"], lambda w: (w / INPUTS).unlink()),
}


@pytest.mark.parametrize("name", list(CASES))
def test_broken_work_folder_is_refused_byte_for_byte(name, interrupted, tmp_path, no_work):
    code, words, breaker = CASES[name]
    work = copy_run(interrupted, tmp_path)
    breaker(work)
    before = snapshot(work)
    res = run_cli(["quantize", tmp_path / "r.yaml", "--resume", "-q"])
    line = assert_one_line_error(res, code, "--resume", *words, "--overwrite", output=tmp_path / "out")
    assert str(work) in line or work.name in line
    assert snapshot(work) == before  # nothing written, nothing removed


def test_resume_with_overwrite_is_refused_before_anything(interrupted, tmp_path, no_work):
    work = copy_run(interrupted, tmp_path)
    before = snapshot(work)
    res = run_cli(["quantize", tmp_path / "r.yaml", "--resume", "--overwrite", "-q"])
    assert_one_line_error(
        res, USAGE, "--resume with --overwrite", "one or the other", output=tmp_path / "out"
    )
    assert snapshot(work) == before


def test_intact_work_folder_resumes_to_the_reference(interrupted, tmp_path):
    _, reference = interrupted
    copy_run(interrupted, tmp_path)
    res = run_cli(["quantize", tmp_path / "r.yaml", "--resume", "-q", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["resumed_at_block"] == 2
    got = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (tmp_path / "out").iterdir()}
    assert got == reference
    assert not (tmp_path / ".out.partial").exists() and not leftovers(tmp_path / "out")


def test_overwrite_discards_a_broken_work_folder_and_starts_over(interrupted, tmp_path):
    _, reference = interrupted
    work = copy_run(interrupted, tmp_path)
    (work / STATE).write_text("{garbled")
    res = run_cli(["quantize", tmp_path / "r.yaml", "-q"])  # neither flag: the folder is named, not touched
    assert_one_line_error(res, USAGE, ".out.partial", "a state.json this version cannot read", "--overwrite")
    assert (work / STATE).read_text() == "{garbled"
    res = run_cli(["quantize", tmp_path / "r.yaml", "--overwrite", "-q"])
    assert res.exit_code == 0, res.output
    got = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (tmp_path / "out").iterdir()}
    assert got == reference and not work.exists()


def test_nan_in_a_block_whose_record_was_rewritten_to_match_is_still_refused(interrupted, tmp_path):
    """Hashes recomputed by hand into state.json: the file passes the hash, and the NaN is refused as the
    checkpoint is written from it, naming the tensor; nothing appears at the output."""
    from qtool.checkpoint.manifest import file_sha256

    work = copy_run(interrupted, tmp_path)
    nan_in_block(work)
    state = json.loads((work / STATE).read_text())
    state["blocks"][1]["file"]["sha256"] = file_sha256(work / BLOCK1)
    (work / STATE).write_text(json.dumps(state))
    res = run_cli(["quantize", tmp_path / "r.yaml", "--resume", "-q"])
    assert_one_line_error(res, CHECKPOINT, ".scales", BLOCK1, "NaN or Inf", output=tmp_path / "out")
    assert torch.isnan(
        load_file(str(work / BLOCK1))[next(n for n in load_file(str(work / BLOCK1)) if n.endswith(".scales"))]
    ).any()
