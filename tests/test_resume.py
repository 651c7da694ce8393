"""Resume after a kill, on stories260K (GPTQ, so the activations entering the next block are part of the state):
a run killed with SIGKILL at a random block and moment, then `--resume`d, writes the checkpoint of the
uninterrupted run byte for byte; a resume with another recipe, data or model is refused in one line; a stale work
folder is reported, never reused silently; Ctrl-C stops at a block boundary and says how to resume; a full disk
mid-run and a weight file truncated mid-run stop in one line with the work folder left consistent."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from bad_input import ROOT, assert_one_line_error, run_cli
from conftest import STORIES, TINY_SAMPLE

pytestmark = pytest.mark.skipif(not STORIES.is_dir(), reason="stories260K assets not found")

BLOCKS = 5  # stories260K's decoder blocks

RECIPE = f"""
model: {{model}}
calibration:
  source: {TINY_SAMPLE}
  num_samples: 2
  seq_len: 32
stages:
  - stage: gptq
    bits: 4
    group_size: 32
output: out
"""


def sha256s(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def write_recipe(folder: Path, model: Path = STORIES, text: str = RECIPE) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    r = folder / "r.yaml"
    r.write_text(text.format(model=model))
    return r


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, str]:
    """The uninterrupted run's file hashes."""
    recipe = write_recipe(tmp_path_factory.mktemp("reference"))
    res = run_cli(["quantize", recipe, "-q"])
    assert res.exit_code == 0, res.output
    return sha256s(recipe.parent / "out")


def test_whole_model_run_writes_the_same_checkpoint(tmp_path, reference):
    recipe = write_recipe(tmp_path)
    res = run_cli(["quantize", recipe, "--whole-model", "-q", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["mode"] == "whole"
    assert sha256s(tmp_path / "out") == reference


def test_activations_kept_on_disk_write_the_same_checkpoint(tmp_path, reference, monkeypatch):
    from qtool.calibration import store

    folders: list[Path] = []
    real_keep = store.ActivationStore._keep

    def keep(self, i, t):
        if self.place == "disk":
            folders.append(self.folder)
        return real_keep(self, i, t)

    monkeypatch.setattr(store.ActivationStore, "_keep", keep)
    monkeypatch.setenv("QTOOL_ACTIVATION_BUDGET", "0")  # no memory for them: the estimate sends them to disk
    recipe = write_recipe(tmp_path)
    res = run_cli(["quantize", recipe, "-q", "--json"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    assert summary["activations"] == "disk" and summary["mode"] == "blocks"
    assert summary["timings"]["write_s"] > 0 and summary["timings"]["startup_s"] > 0
    assert "join_s" not in summary["timings"]  # one process: no group to join
    assert folders and {f.parent for f in folders} == {tmp_path}  # beside the output
    assert sha256s(tmp_path / "out") == reference
    assert folders[0] == tmp_path / ".out.activations" and not folders[0].exists()


def partial_of(folder: Path) -> Path:
    return folder / ".out.partial"


def state(folder: Path) -> dict:
    return json.loads((partial_of(folder) / "state.json").read_text())


# The child kills itself at block B: while quantizing it (the n-th group's statistics), after the n-th file of its
# commit (block tensors, next inputs, state), or while the checkpoint is written after the last block.
KILLER = """
import os, signal, sys
import qtool.pipeline as pipeline, qtool.checkpoint.partial as partial, qtool.checkpoint.writer as writer
B, PHASE, N = int(sys.argv.pop(1)), sys.argv.pop(1), int(sys.argv.pop(1))
current, committing, calls = [0], [None], [0]
real_commit, real_collect, real_atomic, real_save = (partial.Work.commit, pipeline._collect, partial._atomic_write,
                                                     writer.save_file)
def count(phase):
    if PHASE == phase:
        calls[0] += 1
        if calls[0] == N:
            os.kill(os.getpid(), signal.SIGKILL)
def commit(self, i, *a, **k):
    committing[0] = i
    real_commit(self, i, *a, **k)
    committing[0], current[0] = None, i + 1
def collect(*a, **k):
    if current[0] == B:
        count("quantizing")
    return real_collect(*a, **k)
def atomic(path, write):
    written = real_atomic(path, write)  # the sha256 of the activations, which the state records
    if committing[0] == B:
        count("commit")
    return written
def save(*a, **k):
    count("writing")
    return real_save(*a, **k)
partial.Work.commit, pipeline._collect, partial._atomic_write, writer.save_file = commit, collect, atomic, save
from qtool.cli import main
main()
"""


def kill_at(recipe: Path, block: int, phase: str, n: int) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", KILLER, str(block), phase, str(n), "quantize", str(recipe), "-q"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_sigkill_at_a_random_block_then_resume_gives_the_same_checkpoint(tmp_path, reference):
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    phase = rng.choice(["quantizing", "commit", "writing"])
    block = rng.randrange(BLOCKS)
    n = {"quantizing": rng.randint(1, 4), "commit": rng.randint(1, 3), "writing": 1}[phase]
    if phase == "commit" and block == BLOCKS - 1:
        n = min(n, 2)  # the last block writes no next inputs
    where = f"seed {seed}: killed at block {block}, {phase} #{n}"
    recipe = write_recipe(tmp_path)
    proc = kill_at(recipe, block, phase, n)
    assert proc.returncode == -signal.SIGKILL, (where, proc.stderr)
    assert not (tmp_path / "out").exists(), where
    finished = state(tmp_path)["next_block"]
    expected = {
        "quantizing": block,
        "commit": block + (n == (3 if block < BLOCKS - 1 else 2)),
        "writing": BLOCKS,
    }[phase]
    assert finished == expected, where

    # Without --resume the work folder is reported, not reused.
    res = run_cli(["quantize", recipe, "-q"])
    assert_one_line_error(
        res, 2, ".out.partial", f"holds {finished} of {BLOCKS} finished blocks", "--resume", "--overwrite"
    )
    # Another calibration seed, or another recipe: refused, the work folder untouched.
    res = run_cli(["quantize", recipe, "--resume", "--seed", "7", "-q"])
    assert_one_line_error(res, 2, "--resume", "calibration data", "--overwrite")
    (tmp_path / "r3.yaml").write_text(recipe.read_text().replace("bits: 4", "bits: 3"))
    res = run_cli(["quantize", tmp_path / "r3.yaml", "--resume", "-q"])
    assert_one_line_error(res, 2, "--resume", "another recipe")
    assert state(tmp_path)["next_block"] == finished

    res = run_cli(["quantize", recipe, "--resume", "--json"])
    assert res.exit_code == 0, (where, res.output)
    assert json.loads(res.stdout).get("resumed_at_block", 0) == finished, where
    assert sha256s(tmp_path / "out") == reference, where
    assert not partial_of(tmp_path).exists() and not list(tmp_path.glob(".out.tmp-*"))


def test_resume_with_nothing_to_resume(tmp_path, no_work):
    recipe = write_recipe(tmp_path)
    assert_one_line_error(
        run_cli(["quantize", recipe, "--resume"]),
        2,
        "--resume",
        "nothing to resume",
        ".out.partial",
        output=tmp_path / "out",
    )


def test_ctrl_c_a_full_disk_and_ctrl_c_while_writing_then_resume(tmp_path, reference, monkeypatch):
    """Ctrl-C stops at a block boundary and says how to go on; the resumed run meets a full disk at block 3 and
    stops in one line; the next is interrupted while writing the checkpoint; the work folder is consistent after
    each, and the last resume writes the reference."""
    import qtool.checkpoint.partial as partial

    real_commit, real_save = partial.Work.commit, partial.save_file

    def commit_then_ctrl_c(self, i, *a, **k):
        real_commit(self, i, *a, **k)
        if i == 1:
            raise KeyboardInterrupt

    def full_at_block_3(tensors, filename, **k):
        if "block-00003" in filename:
            Path(filename).write_bytes(b"half")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), filename)
        return real_save(tensors, filename, **k)

    recipe = write_recipe(tmp_path)
    monkeypatch.setattr(partial.Work, "commit", commit_then_ctrl_c)
    assert_one_line_error(
        run_cli(["quantize", recipe, "-q"]),
        130,
        "interrupted",
        "blocks 0-1 of 5",
        ".out.partial",
        "--resume",
        "from block 2",
        output=tmp_path / "out",
    )
    assert state(tmp_path)["next_block"] == 2
    monkeypatch.setattr(partial.Work, "commit", real_commit)
    monkeypatch.setattr(partial, "save_file", full_at_block_3)
    assert_one_line_error(
        run_cli(["quantize", recipe, "--resume", "-q"]),
        6,
        "No space left on device",
        "block-00003",
        output=tmp_path / "out",
    )
    assert state(tmp_path)["next_block"] == 3
    monkeypatch.setattr(partial, "save_file", real_save)
    # Ctrl-C while the checkpoint is written: every block is kept, and the line says how to write it.
    import qtool.checkpoint.writer as writer

    def ctrl_c(*a, **k):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(writer, "save_file", ctrl_c)
        assert_one_line_error(
            run_cli(["quantize", recipe, "--resume", "-q"]),
            130,
            "while writing",
            "all 5 blocks",
            "--resume",
            output=tmp_path / "out",
        )
    assert state(tmp_path)["next_block"] == 5
    res = run_cli(["quantize", recipe, "--resume", "-q", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["resumed_at_block"] == 5
    assert sha256s(tmp_path / "out") == reference


def test_weight_file_truncated_mid_run(tmp_path, monkeypatch):
    import qtool.checkpoint.partial as partial

    model = tmp_path / "model"
    shutil.copytree(STORIES, model)
    real = partial.Work.commit

    def commit_then_truncate(self, i, *a, **k):
        real(self, i, *a, **k)
        if i == 1:
            # the header and the first bytes of the data stay: every tensor not read yet is cut off
            weights = model / "model.safetensors"
            data = weights.read_bytes()
            weights.write_bytes(data[: 8 + int.from_bytes(data[:8], "little") + 1000])

    monkeypatch.setattr(partial.Work, "commit", commit_then_truncate)
    recipe = write_recipe(tmp_path / "run", model)
    res = run_cli(["quantize", recipe, "-q"])
    assert_one_line_error(
        res,
        4,
        "model.layers.",
        str(model / "model.safetensors"),
        "truncated",
        output=tmp_path / "run" / "out",
    )
    # Block 2's weights may have been read ahead, before the cut: the run then stops at block 3.
    assert state(tmp_path / "run")["next_block"] in (2, 3)
    # The model changed under the work folder: a resume is refused, naming what differs.
    monkeypatch.setattr(partial.Work, "commit", real)
    shutil.copy(STORIES / "model.safetensors", model / "model.safetensors")
    assert_one_line_error(run_cli(["quantize", recipe, "--resume", "-q"]), 2, "another model files")
