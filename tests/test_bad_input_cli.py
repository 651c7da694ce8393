"""Malformed command lines, recipes and output paths: each fails with its class's exit code and one line, before
any model is loaded where it can be known then, and leaves nothing at the output (no folder, no `.tmp-`/`.old-`
sibling). Also Ctrl-C (exit 130) and a bug (exit 70) mid-run, and the `--json` error object.

Exit codes: 2 usage, 3 recipe, 4 input, 5 checkpoint, 6 resource, 70 internal, 130 interrupted."""

from __future__ import annotations

import errno
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time
from collections import namedtuple
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
from conftest import FAST_RECIPE, STORIES, TINY_SAMPLE

RECIPE = FAST_RECIPE


@pytest.fixture
def recipe(tmp_path) -> Path:
    p = tmp_path / "r.yaml"
    p.write_text(RECIPE)
    return p


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


# ---- click's own usage errors: exit 2, click's block, nothing written --------------------------------------------


@pytest.mark.parametrize(
    "args, words",
    [
        (["quantize", "--frobnicate", "{recipe}"], ["--frobnicate"]),
        (["quantize"], ["Missing argument", "RECIPE"]),
        (
            ["quantize", "{recipe}", "--num-samples", "many"],
            ["--num-samples", "'many' is not a valid integer"],
        ),
        (["quantize", "{recipe}", "--max-windows", "1.5"], ["--max-windows"]),
        (["quantize", "{recipe}", "-o"], ["-o", "requires an argument"]),
        (["quantize", "{tmp}"], ["RECIPE", "is a directory"]),
        (["calibrate", "--model", str(STORIES)], ["Missing option", "--output"]),
        (["calibrate", "--model", str(STORIES), "-o", "{tmp}"], ["--output", "is a directory"]),
        (["eval"], ["Missing argument", "MODEL"]),
        (["eval", str(STORIES), "--seq-len", "x"], ["--seq-len"]),
        (["eval", str(STORIES), "a", "b"], ["unexpected extra argument"]),
        (["pack"], ["Missing argument", "CHECKPOINT"]),
        (["frobnicate"], ["No such command", "frobnicate"]),
        (["bench", "kernels", "--iters", "3"], ["--iters", "3"]),
        (["bench", "e2e", "--bits", "3"], ["--bits", "'3' is not one of"]),
        (["bench", "nope"], ["No such command", "nope"]),
    ],
)
def test_click_usage_errors(tmp_path, recipe, args, words):
    args = [a.format(recipe=recipe, tmp=tmp_path) for a in args]
    assert_one_line_error(run_cli(args), 2, *words, output=tmp_path / "out")


def test_click_usage_error_with_json_is_also_a_json_object(recipe, tmp_path):
    res = run_cli(["quantize", recipe, "--json", "--frobnicate"])
    assert_one_line_error(res, 2, "--frobnicate", output=tmp_path / "out", json_error=True)


# ---- qtool's usage errors: options that contradict or a value a command cannot take --------------------------


@pytest.mark.parametrize(
    "args, words",
    [
        (["calibrate", "-o", "{tmp}/s.safetensors"], ["expected a RECIPE or both --model and --calibration"]),
        (["calibrate", "--model", str(STORIES), "-o", "{tmp}/s.safetensors"], ["--calibration"]),
        (["eval", str(STORIES), "--device", "cpu"], ["nothing to measure"]),
        (
            ["eval", str(STORIES), "--text", str(TINY_SAMPLE), "--windows", "0", "--device", "cpu"],
            ["--max-windows: found 0"],
        ),
        (
            ["eval", str(STORIES), "--text", str(TINY_SAMPLE), "--stride", "-4", "--device", "cpu"],
            ["--stride: found -4"],
        ),
        (
            ["eval", str(STORIES), "--text", str(TINY_SAMPLE), "--batch-size", "0", "--device", "cpu"],
            ["--batch-size: found '0'"],
        ),
        (["eval", str(STORIES), "--tasks", ",", "--device", "cpu"], ["--tasks: found no task names"]),
        (
            ["pack", "{tmp}/missing", "-o", "{tmp}/out", "--max-shard-size", "5 XB"],
            ["--max-shard-size: found '5 XB'"],
        ),
        (["bench", "kernels", "--shapes", "64by64"], ["--shapes: found '64by64'"]),
        (["bench", "kernels", "--group-size", "0"], ["--group-size: found '0'"]),
        (["bench", "e2e", "--model-config", "nope"], ["--model-config: found 'nope'"]),
        (["bench", "e2e", "--group-size", "32,64"], ["--group-size", "one value for e2e"]),
        (["bench", "quik", "--outliers", "0,x"], ["--outliers: found 'x'"]),
    ],
)
def test_qtool_usage_errors(tmp_path, args, words):
    args = [a.format(tmp=tmp_path) for a in args]
    assert_one_line_error(run_cli(args), 2, *words, output=[tmp_path / "out", tmp_path / "s.safetensors"])


def test_bench_model_config_file_that_is_not_a_config(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text('{"hidden_size": "wide", "intermediate_size": 8}')
    assert_one_line_error(
        run_cli(["bench", "kernels", "--model-config", bad]),
        2,
        "--model-config",
        "expected a Hugging Face config.json",
    )


# ---- recipes: exit 3, naming the file (and key), before any model is loaded -----------------------------------


@pytest.mark.parametrize(
    "text, words",
    [
        ("", ["is empty"]),
        ("# only a comment\n\n", ["is empty"]),
        ("- model: x\n- stages: []\n", ["found list", "expected a mapping"]),
        ("just a string\n", ["found str", "expected a mapping"]),
        ("model: x\n\tstages: []\n", ["malformed YAML", "line 2"]),
        ("model: !!python/object/apply:os.system ['true']\n", ["malformed YAML"]),
        ("model: x\x00\n", ["malformed YAML"]),
        (
            RECIPE.replace(
                "stages:\n  - stage: gptq\n    bits: 4\n    group_size: 32\n", "stages: {stage: gptq}\n"
            ),
            ["stages: found", "expected a non-empty list"],
        ),
        (
            RECIPE.replace("stages:\n  - stage: gptq\n    bits: 4\n    group_size: 32\n", "stages: []\n"),
            ["stages: found []"],
        ),
        (
            RECIPE.replace("  - stage: gptq\n", "  - gptq\n  - stage: gptq\n"),
            ["stages[0]: found 'gptq'", "'stage' key"],
        ),
        (RECIPE.replace("stage: gptq", "stage: 5"), ["stages[0].stage", "unknown stage 5"]),
        (RECIPE.replace("stage: gptq", "stage: null"), ["stages[0].stage", "unknown stage None"]),
        (
            RECIPE.replace("output: out", "  - stage: smooth\noutput: out"),
            ["stages[1]", "transform 'smooth' comes after", "expected every transform"],
        ),
        (RECIPE.replace("num_samples: 2", "num_samples: many"), ["calibration.num_samples", "'many'"]),
        (RECIPE.replace("num_samples: 2", "num_samples: 0"), ["calibration.num_samples", "found 0"]),
        (RECIPE.replace("seq_len: 32", "seq_len: 32\n  shuffle: true"), ["calibration.shuffle", "unknown"]),
        (RECIPE + "Stages: []\n", ["Stages: unknown key", "expected one of model"]),
        (RECIPE + "settings: {device: tpu}\n", ["settings.device: found 'tpu'"]),
        (RECIPE + "settings: {max_shard_size: big}\n", ["settings.max_shard_size: found 'big'"]),
        (RECIPE + "settings: {dtype: float8}\n", ["settings.dtype", "'float8'"]),
        (RECIPE + "eval: 5\n", ["eval"]),
        (RECIPE.replace(f"model: {STORIES}", "model: [a, b]"), ["model: found ['a', 'b']"]),
        (RECIPE.replace("model:", "#model:"), ["model: missing"]),
        (RECIPE.replace("output: out", "output: 12"), ["output: found 12", "expected a directory path"]),
        (RECIPE.replace("output: out", ""), ["output: missing", "--output"]),
        (RECIPE.replace("    bits: 4", "    bits: [4]"), ["stages[0].bits"]),
        (
            RECIPE.replace("    group_size: 32", "    group_size: 32\n    targets: {include: ['*.nothing']}"),
            ["stages[0].targets", "matches no linear"],
        ),
    ],
)
def test_recipe_errors(tmp_path, no_work, text, words):
    r = tmp_path / "r.yaml"
    r.write_text(text)
    assert_one_line_error(run_cli(["quantize", r]), 3, "r.yaml", *words, output=tmp_path / "out")


def test_recipe_that_is_not_text(tmp_path, no_work):
    r = tmp_path / "r.yaml"
    r.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe")
    assert_one_line_error(
        run_cli(["quantize", r]),
        3,
        "r.yaml",
        "not UTF-8",
        "expected a YAML text file",
        output=tmp_path / "out",
    )


def test_recipe_path_that_does_not_exist(tmp_path):
    assert_one_line_error(
        run_cli(["quantize", tmp_path / "nope.yaml"]), 3, "nope.yaml", "recipe file not found"
    )


def test_calibrate_recipe_without_calibration(tmp_path, no_work):
    r = tmp_path / "r.yaml"
    r.write_text(f"model: {STORIES}\nstages: [{{stage: rtn}}]\n")
    assert_one_line_error(
        run_cli(["calibrate", r, "-o", tmp_path / "s.safetensors"]),
        3,
        "calibration: missing",
        output=tmp_path / "s.safetensors",
    )


# ---- inputs a recipe or flag names that do not exist: exit 4 ---------------------------------------------------


@pytest.mark.parametrize(
    "flag, value, words",
    [
        ("--model", "{tmp}/no-model", ["--model", "does not exist"]),
        ("--model", "{tmp}", ["--model", "has no config.json"]),
        ("--calibration", "{tmp}/missing.txt", ["--calibration", "does not exist"]),
        ("--stats", "{tmp}/missing.safetensors", ["--stats", "does not exist"]),
    ],
)
def test_missing_inputs(tmp_path, recipe, no_work, flag, value, words):
    res = run_cli(["quantize", recipe, flag, value.format(tmp=tmp_path)])
    assert_one_line_error(res, 4, *words, output=tmp_path / "out")


# ---- the output, checked before any work -----------------------------------------------------------------------


def test_output_under_a_file(tmp_path, recipe, no_work):
    (tmp_path / "file").write_text("mine")
    res = run_cli(["quantize", recipe, "-o", tmp_path / "file" / "ckpt"])
    assert_one_line_error(res, 6, "file' is a file", "expected a directory")
    assert (tmp_path / "file").read_text() == "mine"


@pytest.mark.parametrize("overwrite", [False, True])
def test_output_that_is_a_file_is_never_touched(tmp_path, recipe, no_work, overwrite):
    target = tmp_path / "ckpt"
    target.write_text("my notes")
    res = run_cli(["quantize", recipe, "-o", target, *(["--overwrite"] if overwrite else [])])
    assert_one_line_error(res, 2, str(target), "is an existing file", "never replaced")
    assert target.read_text() == "my notes" and not leftovers(target)


def test_output_that_is_a_folder_of_other_files_is_not_replaced(tmp_path, recipe, no_work):
    target = tmp_path / "work"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    res = run_cli(["quantize", recipe, "-o", target, "--overwrite"])
    assert_one_line_error(res, 2, "not a qtool checkpoint", "--overwrite replaces only a checkpoint")
    assert (target / "notes.txt").read_text() == "mine" and not leftovers(target)


def test_output_that_links_to_a_file_is_never_touched(tmp_path, recipe, no_work):
    (tmp_path / "notes").write_text("mine")
    (tmp_path / "link").symlink_to(tmp_path / "notes")
    res = run_cli(["quantize", recipe, "-o", tmp_path / "link", "--overwrite"])
    assert_one_line_error(res, 2, "is an existing file")
    assert (tmp_path / "link").is_symlink() and (tmp_path / "notes").read_text() == "mine"
    assert not leftovers(tmp_path / "link") and not leftovers(tmp_path / "notes")


def test_pack_output_that_is_a_symlink_is_not_replaced(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    res = run_cli(["pack", tmp_path / "nothing", "-o", tmp_path / "link", "--overwrite"])
    assert_one_line_error(res, 2, "symbolic link", "never replaced")
    assert (tmp_path / "link").is_symlink() and not leftovers(tmp_path / "link")


def test_existing_output_without_overwrite(tmp_path, recipe, no_work):
    (tmp_path / "out").mkdir()
    res = run_cli(["quantize", recipe])
    assert_one_line_error(res, 2, "already exists", "--overwrite")
    assert not leftovers(tmp_path / "out")


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_output_in_a_read_only_folder(tmp_path, recipe, no_work):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        res = run_cli(["quantize", recipe, "-o", ro / "ckpt"])
    finally:
        ro.chmod(0o755)
    assert_one_line_error(res, 6, str(ro), "expected a writable location", output=ro / "ckpt")


def test_output_on_a_read_only_file_system(tmp_path, recipe, no_work, monkeypatch):
    """The refusal a read-only mount gives (EROFS from mkdir), which root meets too."""
    real = pathlib.Path.mkdir

    def mkdir(self, *a, **k):
        if str(self).startswith(str(tmp_path / "mnt")):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
        return real(self, *a, **k)

    (tmp_path / "mnt").mkdir()
    monkeypatch.setattr(pathlib.Path, "mkdir", mkdir)
    res = run_cli(["quantize", recipe, "-o", tmp_path / "mnt" / "a" / "ckpt"])
    assert_one_line_error(
        res,
        6,
        "Read-only file system",
        "expected a writable location",
        output=tmp_path / "mnt" / "a" / "ckpt",
    )
    assert not (tmp_path / "mnt" / "a").exists()


def test_too_little_free_space_is_refused_before_loading(tmp_path, recipe, no_work, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 10**9 - 4096, 4096))
    res = run_cli(["quantize", recipe, "-o", tmp_path / "new" / "ckpt"])
    line = assert_one_line_error(
        res, 6, "needs at least", "has 4.1 KB free", output=tmp_path / "new" / "ckpt"
    )
    assert "KB" in line  # stories260K's 4-bit checkpoint is hundreds of KB
    assert not (tmp_path / "new").exists()  # the parent this run created is gone again


def test_stats_output_that_is_a_folder(tmp_path):
    # click refuses an existing folder; one created under the name after click's check is refused here
    from qtool.errors import UsageError
    from qtool.output import reserve_output

    (tmp_path / "s").mkdir()
    with pytest.raises(UsageError, match="is a directory; expected a file path"):
        reserve_output(tmp_path / "s", directory=False, overwrite=True)


def test_stats_output_under_a_file(tmp_path, no_work):
    (tmp_path / "f").write_text("x")
    # --seq-len within stories260K's 512-token context: the default, 2048, is refused before the output is checked.
    res = run_cli(
        [
            "calibrate",
            "--model",
            STORIES,
            "--calibration",
            TINY_SAMPLE,
            "--seq-len",
            "32",
            "-o",
            tmp_path / "f" / "s",
        ]
    )
    assert_one_line_error(res, 6, "is a file")


def test_pack_output_that_is_a_file(tmp_path):
    (tmp_path / "copy").write_text("mine")
    res = run_cli(["pack", tmp_path / "nothing", "-o", tmp_path / "copy", "--overwrite"])
    assert_one_line_error(res, 2, "--output", "is a file")
    assert (tmp_path / "copy").read_text() == "mine"


def test_pack_of_a_missing_checkpoint_leaves_no_output(tmp_path):
    res = run_cli(["pack", tmp_path / "nothing", "-o", tmp_path / "sub" / "copy"])
    assert_one_line_error(res, 5, "not a qtool checkpoint", output=tmp_path / "sub" / "copy")
    assert not (tmp_path / "sub").exists()


# ---- leftovers of killed runs ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["tmp", "old"])
def test_stale_leftover_is_refused_without_overwrite(tmp_path, recipe, no_work, kind):
    stale = tmp_path / f".out.{kind}-{_dead_pid()}"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"partial")
    res = run_cli(["quantize", recipe])
    assert_one_line_error(res, 2, "leftovers of an interrupted run", stale.name, "--overwrite removes them")
    assert (stale / "model.safetensors").read_bytes() == b"partial" and not (tmp_path / "out").exists()


def test_leftover_of_a_running_process_is_never_removed(tmp_path, recipe, no_work):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live = tmp_path / f".out.tmp-{sleeper.pid}"
        live.mkdir()
        res = run_cli(["quantize", recipe, "--overwrite"])
        assert_one_line_error(res, 6, live.name, f"process {sleeper.pid}", "running")
        assert live.is_dir()
    finally:
        sleeper.kill()
        sleeper.wait()


def test_stale_leftovers_are_removed_with_overwrite(tmp_path, recipe):
    # This process's own PID too: an in-process run before this one left it, and this run writes the same name.
    stale = [
        tmp_path / f".out.tmp-{_dead_pid()}",
        tmp_path / f".out.old-{_dead_pid()}",
        tmp_path / f".out.tmp-{os.getpid()}",
    ]
    for p in stale:
        p.mkdir()
    res = run_cli(["quantize", recipe, "--overwrite", "--json"])
    assert res.exit_code == 0, res.output
    assert sorted(json.loads(res.stdout)["removed_leftovers"]) == sorted(map(str, stale))
    assert (tmp_path / "out" / "qtool-manifest.json").is_file() and not leftovers(tmp_path / "out")
    # Without --json the removal is said on stderr; the finished checkpoint is replaced as --overwrite asks.
    again = tmp_path / f".out.old-{_dead_pid()}"
    again.mkdir()
    res = run_cli(["quantize", recipe, "--overwrite"])
    assert res.exit_code == 0, res.output
    assert f"removed '{again}', left by an interrupted run" in res.stderr
    assert (tmp_path / "out" / "qtool-manifest.json").is_file() and not leftovers(tmp_path / "out")


# ---- --json error objects ----------------------------------------------------------------------------------------


def test_json_error_object_for_a_recipe_error(tmp_path, no_work):
    r = tmp_path / "r.yaml"
    r.write_text(RECIPE.replace("bits: 4", "bits: 99"))
    assert_one_line_error(
        run_cli(["quantize", r, "--json"]), 3, "stages[0].bits", output=tmp_path / "out", json_error=True
    )


def test_json_error_object_for_an_output_error(tmp_path, recipe, no_work):
    (tmp_path / "out").write_text("x")
    assert_one_line_error(
        run_cli(["quantize", recipe, "--json", "--overwrite"]), 2, "is an existing file", json_error=True
    )


def test_json_error_object_for_a_missing_input(tmp_path):
    res = run_cli(
        [
            "calibrate",
            "--model",
            tmp_path / "none",
            "--calibration",
            TINY_SAMPLE,
            "-o",
            tmp_path / "s.safetensors",
            "--json",
        ]
    )
    assert_one_line_error(
        res, 4, "--model", "does not exist", output=tmp_path / "s.safetensors", json_error=True
    )


def test_json_error_object_for_a_bad_checkpoint(tmp_path):
    assert_one_line_error(run_cli(["pack", tmp_path, "--json"]), 5, "not a qtool checkpoint", json_error=True)


# ---- no GPU for the bench --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ["kernels", "--shapes", "64x64", "--m", "1"],
        ["e2e", "--model-config", "tiny"],
        ["quik", "--shapes", "256x256", "--m", "64"],
    ],
    ids=["kernels", "e2e", "quik"],
)
def test_bench_without_gpu(monkeypatch, tmp_path, args):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    outputs = [tmp_path / "report.json", tmp_path / "report.png"]
    res = run_cli(["bench", *args, "--json-out", outputs[0], "--plot", outputs[1]])
    assert_one_line_error(res, 6, "bench: found no CUDA GPU", output=outputs)
    assert_one_line_error(run_cli(["bench", *args, "--json"]), 6, "bench: found no CUDA GPU", json_error=True)


# ---- failures mid-run: Ctrl-C, a bug, a full disk ---------------------------------------------------------------


def _raise_in_pipeline(monkeypatch, exc: BaseException) -> None:
    import qtool.pipeline

    def boom(*a, **k):
        raise exc

    monkeypatch.setattr(qtool.pipeline, "quantize_model", boom)
    monkeypatch.setattr("qtool.onloaded.quantize_onloaded", boom)


@pytest.mark.parametrize("json_mode", [False, True])
def test_ctrl_c_in_the_pipeline(tmp_path, recipe, monkeypatch, json_mode):
    _raise_in_pipeline(monkeypatch, KeyboardInterrupt())
    out = tmp_path / "deep" / "er" / "ckpt"
    res = run_cli(["quantize", recipe, "-o", out, *(["--json"] if json_mode else [])])
    line = assert_one_line_error(res, 130, output=out, json_error=json_mode)
    assert line == "qtool: error: interrupted"
    assert not (tmp_path / "deep").exists()


def test_ctrl_c_while_writing_the_checkpoint(tmp_path, recipe, monkeypatch):
    import qtool.checkpoint.writer as writer

    real = writer.save_file
    calls = []

    def save_then_interrupt(*a, **k):
        real(*a, **k)  # a partial file exists in the temporary folder when Ctrl-C comes
        calls.append(a[1])
        raise KeyboardInterrupt

    monkeypatch.setattr(writer, "save_file", save_then_interrupt)
    res = run_cli(["quantize", recipe, "-q"])
    assert calls and ".out.tmp-" in calls[0]
    assert_one_line_error(res, 130, "interrupted", output=tmp_path / "out")


def test_full_disk_while_writing(tmp_path, recipe, monkeypatch):
    import qtool.checkpoint.writer as writer

    def no_space(tensors, filename, **k):
        Path(filename).write_bytes(b"half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), filename)

    monkeypatch.setattr(writer, "save_file", no_space)
    res = run_cli(["quantize", recipe, "-q"])
    assert_one_line_error(res, 6, "No space left on device", ".out.tmp-", output=tmp_path / "out")


@pytest.mark.parametrize("json_mode", [False, True])
def test_internal_error_is_one_line(tmp_path, recipe, monkeypatch, json_mode):
    _raise_in_pipeline(monkeypatch, RuntimeError("boom\nsecond line"))
    res = run_cli(["quantize", recipe, "-o", tmp_path / "new" / "ckpt", *(["--json"] if json_mode else [])])
    line = assert_one_line_error(
        res,
        70,
        "internal error: RuntimeError: boom second line",
        "set QTOOL_TRACEBACK=1 for the traceback",
        output=tmp_path / "new" / "ckpt",
        json_error=json_mode,
    )
    assert line.endswith("(set QTOOL_TRACEBACK=1 for the traceback)")
    assert not (tmp_path / "new").exists()


def test_internal_error_with_qtool_traceback_shows_it(tmp_path, recipe, monkeypatch):
    _raise_in_pipeline(monkeypatch, RuntimeError("boom"))
    with pytest.raises(RuntimeError, match="boom"):
        run_cli(["quantize", recipe], env={"QTOOL_TRACEBACK": "1"})
    assert_nothing_at(tmp_path / "out")


def test_sigint_mid_quantization_in_a_real_process(tmp_path, recipe):
    """A real SIGINT into a real run: the block loop is held at its first block (after the model loaded and the
    checkpoint's temporary folder was created) until the signal arrives."""
    marker = tmp_path / "in-block-loop"
    code = (
        SIGINT_AS_FROM_A_SHELL
        + f"""
import time, pathlib
import qtool.pipeline as p
real = p._collect
def held(*a, **k):
    pathlib.Path({str(marker)!r}).touch()
    time.sleep(900)
    return real(*a, **k)
p._collect = held
from qtool.cli import main
main()
"""
    )
    out = tmp_path / "a" / "ckpt"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "quantize", str(recipe), "-o", str(out), "-q"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # generous: on a loaded 2-core machine, importing torch and loading the model can take minutes
        deadline = time.monotonic() + 600
        while not marker.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the run never reached the block loop"
            time.sleep(0.05)
        assert leftovers(out)  # the temporary folder exists while the run works
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        reap(proc)
    assert_one_line_error(Run(proc.returncode, stdout, stderr), 130, "interrupted", output=out)
    assert not (tmp_path / "a").exists()
