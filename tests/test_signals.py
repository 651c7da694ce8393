"""SIGINT, SIGTERM and SIGHUP stop a run alike: the output never appears half-written, one line says what happened,
the exit code is 128 + the signal (130, 143, 129), and what is left beside the output is at most a work folder
that `--resume` turns into the uninterrupted run's checkpoint, byte for byte.

The many-points test is deterministic: a first run of stories260K (GPTQ, 2 windows of 32 tokens: a fraction of a
second in-process) counts the calls of the functions that mark the run's steps (each group's statistics, each file
of a block's commit, each tensor file of the checkpoint, the swap of an old output for the new one), and a run per
point sends the process a real signal there, which the handlers the command installed take as a real one would
come. A few runs in child processes send the signal from outside."""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from bad_input import (
    ROOT,
    SIGINT_AS_FROM_A_SHELL,
    Run,
    assert_nothing_at,
    assert_one_line_error,
    leftovers,
    reap,
    run_cli,
)
from conftest import FAST_RECIPE, STORIES

pytestmark = pytest.mark.skipif(not STORIES.is_dir(), reason="stories260K assets not found")

RECIPE = FAST_RECIPE


def sha256s(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())} if folder.is_dir() else {}


@pytest.fixture(autouse=True)
def dispositions_as_a_shell_starts_them():
    """A process a shell starts has Python's own SIGINT handler and the default SIGTERM and SIGHUP. A test
    runner's worker may have had them changed by what ran before in it, and qtool rightly leaves an ignored signal
    ignored: these tests start from what a user's process has."""
    names = ("SIGINT", "SIGTERM", "SIGHUP")
    saved = {name: signal.getsignal(getattr(signal, name)) for name in names}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    yield
    for name, handler in saved.items():
        signal.signal(getattr(signal, name), handler)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("reference")
    (folder / "r.yaml").write_text(RECIPE)
    res = run_cli(["quantize", folder / "r.yaml", "-q"])
    assert res.exit_code == 0, res.output
    return sha256s(folder / "out")


class Steps:
    """Wraps the functions that mark the run's steps; `fire` (when set) sends `signum` to this process at the
    `at`-th step, counted over all of them in the order they run."""

    def __init__(self, monkeypatch, signum: int = signal.SIGTERM, at: int | None = None) -> None:
        import qtool.checkpoint.partial as partial
        import qtool.checkpoint.writer as writer
        import qtool.output as output
        import qtool.pipeline as pipeline

        self.signum, self.at, self.seen = signum, at, []
        self.fired: tuple | None = None
        self.in_publish = False

        def before(name: str, fn: Callable):
            def wrapped(*a, **k):
                self.step(name)
                return fn(*a, **k)

            return wrapped

        def after(name: str, fn: Callable):
            def wrapped(*a, **k):
                out = fn(*a, **k)
                self.step(name)
                return out

            return wrapped

        monkeypatch.setattr(pipeline, "_collect", before("statistics", pipeline._collect))
        monkeypatch.setattr(partial, "_atomic_write", after("work file", partial._atomic_write))
        monkeypatch.setattr(writer, "save_file", after("checkpoint file", writer.save_file))
        real_publish, real_rename = output.Output.publish, pathlib.Path.rename

        def publish(out):
            self.step("publish")
            self.in_publish = True
            try:
                return real_publish(out)
            finally:
                self.in_publish = False

        def rename(path, target):
            result = real_rename(path, target)
            if self.in_publish:
                self.step("swap rename")
            return result

        monkeypatch.setattr(output.Output, "publish", publish)
        monkeypatch.setattr(pathlib.Path, "rename", rename)
        monkeypatch.setattr(partial.Work, "remove", before("work folder removed", partial.Work.remove))

    def step(self, name: str) -> None:
        self.seen.append(name)
        if len(self.seen) == self.at:
            # what the signal found, for a failure's message
            self.fired = (name, signal.getsignal(self.signum))
            os.kill(os.getpid(), self.signum)


def check_left(folder: Path, reference: dict[str, str], *, code: int, finished_words=()) -> str:
    """What an interrupted run may leave: nothing at the output, or (when at least one block finished) a work
    folder whose files are exactly those its state names, from which --resume writes the reference."""
    res_line = None
    partial = folder / ".out.partial"
    assert_nothing_at(folder / "out")
    assert not (folder / ".out.activations").exists()
    if partial.exists():
        state = json.loads((partial / "state.json").read_text())
        done = state["next_block"]
        assert done >= 1, state
        names = {f"block-{i:05d}.safetensors" for i in range(done)} | {"state.json"}
        if state["inputs"]:
            names.add(f"inputs-{done:05d}.bin")
        assert {p.name for p in partial.iterdir()} == names
        res = run_cli(["quantize", folder / "r.yaml", "--resume", "-q"])
        assert res.exit_code == 0, res.output
        assert sha256s(folder / "out") == reference
        assert not partial.exists() and not leftovers(folder / "out")
    return res_line


def count_steps(folder: Path, *args) -> list[str]:
    mp = pytest.MonkeyPatch()
    try:
        counter = Steps(mp)
        res = run_cli(["quantize", folder / "r.yaml", "-q", *args])
    finally:
        mp.undo()
    assert res.exit_code == 0, res.output
    return counter.seen


@pytest.fixture(scope="module")
def steps(tmp_path_factory, reference) -> list[str]:
    """The steps of one uninterrupted run."""
    folder = tmp_path_factory.mktemp("count")
    (folder / "r.yaml").write_text(RECIPE)
    seen = count_steps(folder)
    assert sha256s(folder / "out") == reference
    assert seen.count("statistics") == 5 * 4 and seen.count("work file") == 1 + 5 * 3 - 1
    assert seen[-3:] == ["publish", "swap rename", "work folder removed"], seen
    return seen


def points(steps: list[str]) -> list[int]:
    """The steps a signal is sent at: every step but the statistics after the first of each block (the same
    state, a few groups further into the block)."""
    return [
        at
        for at, name in enumerate(steps, 1)
        if name != "statistics" or at == 1 or steps[at - 2] != "statistics"
    ]


def test_signal_at_every_step_of_a_run(tmp_path, monkeypatch, reference, steps):
    """A SIGTERM at each step: until the output is renamed into place, exit 143, nothing at the output and at most
    a work folder from which --resume writes the reference; from then on, the checkpoint complete, no work folder,
    exit 143 all the same."""
    placed = steps.index("publish") + 1
    for at in points(steps):
        folder = tmp_path / f"at-{at}"
        folder.mkdir()
        (folder / "r.yaml").write_text(RECIPE)
        with monkeypatch.context() as m:
            Steps(m, signal.SIGTERM, at)
            res = run_cli(["quantize", folder / "r.yaml", "-q"])
        where = f"SIGTERM at step {at} ({steps[at - 1]})"
        if at <= placed:
            assert_one_line_error(res, 143, "interrupted")
            check_left(folder, reference, code=143)
        else:
            assert_one_line_error(res, 143, "interrupted by SIGTERM after the command's work was done")
            assert sha256s(folder / "out") == reference, where
            assert not (folder / ".out.partial").exists() and not leftovers(folder / "out"), where


def test_signal_during_the_swap_of_an_old_output(tmp_path, monkeypatch, reference):
    """--overwrite of an existing checkpoint: a signal at the swap's first check leaves the old checkpoint as it was;
    during the swap (old renamed away, new renamed in), it is reported once the new one is in place."""
    (tmp_path / "r.yaml").write_text(RECIPE.replace("bits: 4", "bits: 3"))
    assert run_cli(["quantize", tmp_path / "r.yaml", "-q"]).exit_code == 0
    (tmp_path / "r.yaml").write_text(RECIPE)
    seen = count_steps(tmp_path, "--overwrite")
    assert seen[-4:] == ["publish", "swap rename", "swap rename", "work folder removed"], seen
    for at in range(len(seen) - 3, len(seen) + 1):
        (tmp_path / "r.yaml").write_text(RECIPE.replace("bits: 4", "bits: 3"))
        assert run_cli(["quantize", tmp_path / "r.yaml", "-q", "--overwrite"]).exit_code == 0
        old = snapshot(tmp_path / "out")
        (tmp_path / "r.yaml").write_text(RECIPE)
        with monkeypatch.context() as m:
            Steps(m, signal.SIGTERM, at)
            res = run_cli(["quantize", tmp_path / "r.yaml", "-q", "--overwrite"])
        if seen[at - 1] == "publish":
            assert_one_line_error(res, 143, "interrupted while writing the checkpoint", "--resume")
            assert snapshot(tmp_path / "out") == old
            # --resume goes on as the interrupted run would have: it was started with --overwrite
            res = run_cli(["quantize", tmp_path / "r.yaml", "-q", "--resume"])
            assert res.exit_code == 0, res.output
        else:
            assert_one_line_error(res, 143, "after the command's work was done", "complete")
        assert sha256s(tmp_path / "out") == reference
        assert not leftovers(tmp_path / "out") and not (tmp_path / ".out.partial").exists()


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGHUP, 129)])
def test_sigint_and_sighup_at_a_block_commit(tmp_path, monkeypatch, reference, steps, signum, code):
    at = [i for i, s in enumerate(steps, 1) if s == "work file"][4]  # block 1's inputs
    (tmp_path / "r.yaml").write_text(RECIPE)
    with monkeypatch.context() as m:
        sent = Steps(m, signum, at)
        res = run_cli(["quantize", tmp_path / "r.yaml", "-q"])
    assert res.exit_code == code, (sent.fired, len(sent.seen), at, res.output)
    assert_one_line_error(res, code, "interrupted", "blocks 0-1 of 5", "--resume")
    check_left(tmp_path, reference, code=code)


# the point of the test: the interpreter reports the lost exception as "unraisable"
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_signal_whose_exception_a_finalizer_swallows_still_stops_the_run(tmp_path, monkeypatch, reference):
    """Python runs a signal's handler wherever the main thread is; in a `__del__` the KeyboardInterrupt is printed
    as "Exception ignored" and lost. The run must stop anyway, at the next block."""
    import qtool.checkpoint.partial as partial

    real = partial.Work.commit

    class Finalized:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGTERM)
            sum(range(1000))  # bytecode after the signal: the handler runs here, inside the finalizer

    def commit(self, i, *a, **k):
        real(self, i, *a, **k)
        if i == 2:
            Finalized()  # dropped at once: its __del__ runs here, between two steps of the run

    monkeypatch.setattr(partial.Work, "commit", commit)
    (tmp_path / "r.yaml").write_text(RECIPE)
    res = run_cli(["quantize", tmp_path / "r.yaml", "-q"])
    assert res.exit_code == 143, res.output
    assert res.stderr.splitlines()[-1].startswith("qtool: error: interrupted; blocks 0-2 of 5"), res.stderr
    check_left(tmp_path, reference, code=143)


def test_handlers_are_restored_after_a_command(tmp_path):
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    assert run_cli(["quantize", tmp_path / "missing.yaml"]).exit_code == 3
    assert {s: signal.getsignal(s) for s in before} == before


# ---- real signals from outside -----------------------------------------------------------------------------------

HOLD = (
    SIGINT_AS_FROM_A_SHELL
    + """
import pathlib, sys, time
import qtool.pipeline as p
AT, MARKER = int(sys.argv.pop(1)), pathlib.Path(sys.argv.pop(1))
real, calls = p._collect, [0]
def held(*a, **k):
    calls[0] += 1
    if calls[0] == AT:
        MARKER.touch()
        time.sleep(900)
    return real(*a, **k)
p._collect = held
from qtool.cli import main
main()
"""
)


def run_and_signal(recipe: Path, marker: Path, at: int, signum: int | None) -> Run:
    """Run quantize in a child held at its `at`-th statistics step, send `signum` there (None: let it go on)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(at), str(marker), "quantize", str(recipe), "-q"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 600
        while not marker.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the run never reached the step"
            time.sleep(0.05)
        if signum is not None:
            proc.send_signal(signum)
        out, err = proc.communicate(timeout=60 if signum is not None else 900)
    finally:
        reap(proc)
    return Run(proc.returncode, out, err)


@pytest.mark.parametrize("signum, code, at", [(signal.SIGTERM, 143, 9), (signal.SIGHUP, 129, 1)])
def test_real_signal_in_a_child_process(tmp_path, reference, signum, code, at):
    (tmp_path / "r.yaml").write_text(RECIPE)
    res = run_and_signal(tmp_path / "r.yaml", tmp_path / "marker", at, signum)
    if at == 1:  # before any block finished: nothing is kept
        assert_one_line_error(res, code, "interrupted")
        assert not (tmp_path / ".out.partial").exists()
    else:  # held in block 2's statistics
        assert_one_line_error(res, code, "interrupted", "blocks 0-1 of 5", "--resume")
    check_left(tmp_path, reference, code=code)


def test_a_signal_the_parent_ignores_stays_ignored(tmp_path, reference):
    """`nohup` (SIGHUP) and background jobs of a shell (SIGINT) start a process with the signal ignored: qtool
    keeps it ignored and the run completes."""
    (tmp_path / "r.yaml").write_text(RECIPE)
    marker = tmp_path / "marker"
    proc = subprocess.Popen(
        ["nohup", sys.executable, "-c", HOLD.replace("time.sleep(900)", "time.sleep(2)"), "1", str(marker)]
        + ["quantize", str(tmp_path / "r.yaml"), "-q"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 600
        while not marker.exists() and proc.poll() is None:
            assert time.monotonic() < deadline, "the run never reached the step"
            time.sleep(0.05)
        proc.send_signal(signal.SIGHUP)
        out, err = proc.communicate(timeout=600)
    finally:
        reap(proc)
    assert proc.returncode == 0, err
    assert sha256s(tmp_path / "out") == reference
