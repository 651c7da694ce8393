"""Evaluation's bad inputs: task items longer than the model's context, task folders whose files lm-eval cannot
read, task data that is missing or garbled, and hub ids (models and datasets) on a machine that cannot reach the
hub. Each is refused in one line naming the task, file, item or flag, before anything is scored, with no temporary
task folder left behind; an item whose context alone is too long is scored as lm-eval's Hugging Face model scores
it (the context cut from the left) and counted in the protocol.

Exit codes: 2 usage, 4 input."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import pytest

from bad_input import assert_one_line_error, run_cli
from conftest import ASSETS, STORIES

pytestmark = pytest.mark.skipif(not STORIES.is_dir(), reason="stories260K assets not found")

USAGE, INPUT = 2, 4
PIQA = ASSETS / "data" / "zeroshot" / "piqa.jsonl"
LONG_ANSWER = 314  # the PIQA item whose second answer is longer than stories260K's 512 tokens


@pytest.fixture
def own_tmp(tmp_path, monkeypatch):
    """A temporary folder of the test's own for qtool's generated task folder: empty again after every case."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    yield folder
    left = list(folder.glob("qtool-*"))  # torch keeps caches of its own there
    assert not left, left


@pytest.fixture
def unreachable_hub(monkeypatch):
    """The hub cannot be reached (the probe fails); offline mode, which the probe then turns on, is undone after."""
    import huggingface_hub.constants

    from qtool import hub

    monkeypatch.setattr(hub, "_decided", None)
    monkeypatch.setattr(hub, "_reachable", lambda host, port: False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)


def piqa_rows(*items: int) -> str:
    rows = PIQA.read_text().splitlines()
    return "".join(rows[i] + "\n" for i in items)


def evaluate(*args) -> object:
    return run_cli(["eval", STORIES, "--device", "cpu", *map(str, args), "-q"])


# ---- a task folder's files -------------------------------------------------------------------------------------

GOOD_TASK = (
    "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\noutput_type: multiple_choice\n"
    "test_split: test\ndoc_to_text: '{{{{query}}}}'\ndoc_to_target: gold\ndoc_to_choice: choices\n"
)

# (the requested task's file, words of the error line beside the file's path); the file is `mine.yaml`.
TASK_FILES = {
    "unclosed-flow-sequence": (
        "task: mine\ndoc_to_choice: [a, b\n",
        ["expected ',' or ']'", "line 3, column 1"],
    ),
    "indentation": ("task: mine\n  dataset_path: json\n test_split: x\n", ["line 2, column 15"]),
    "tab-indentation": ("task: mine\n\tdataset_path: json\n", ["found a tab character", "line 2, column 1"]),
    "a-list": ("- task: mine\n", ["Expected YAML dict", "got list"]),
    "empty": ("", ["Expected YAML dict", "got NoneType"]),
    "a-scalar": ("mine\n", ["Expected YAML dict", "got str"]),
    "missing-include": ("include: nowhere.yaml\ntask: mine\n", ["FileNotFoundError", "nowhere.yaml"]),
    "include-cycle": ("include: mine.yaml\ntask: mine\n", ["Include cycle"]),
    "not-utf8": (b"task: mine\ndoc_to_text: \xff\xfe\n", ["invalid leading UTF-8 octet at byte 24"]),
    "task-name-a-list": ("task: [mine, yours]\n", ["TypeError"]),
    "unknown-tag": (
        "task: mine\ndoc_to_text: !python/name:os.system\n",
        ["could not determine a constructor"],
    ),
}


@pytest.mark.parametrize("name", list(TASK_FILES))
def test_task_file_lm_eval_cannot_read_is_named_with_its_problem(tmp_path, own_tmp, name):
    text, words = TASK_FILES[name]
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tmp_path / "d.jsonl").write_text(piqa_rows(0, 1, 2))
    path = tasks / "mine.yaml"
    (path.write_bytes if isinstance(text, bytes) else path.write_text)(text)
    res = evaluate("--tasks", "mine", "--include-path", tasks)
    assert_one_line_error(res, INPUT, f"--include-path: {path}: lm-eval cannot read this task file", *words)


def test_broken_file_beside_the_requested_task_is_named_too(tmp_path, own_tmp):
    tasks = tmp_path / "tasks"
    (tasks / "sub").mkdir(parents=True)
    (tmp_path / "d.jsonl").write_text(piqa_rows(0, 1, 2))
    (tasks / "mine.yaml").write_text("task: mine\n" + GOOD_TASK.format(data=tmp_path / "d.jsonl"))
    (tasks / "sub" / "other.yaml").write_text("task: other\ndoc_to_text: {a: 1\n")
    res = evaluate("--tasks", "mine", "--include-path", tasks)
    assert_one_line_error(res, INPUT, str(tasks / "sub" / "other.yaml"), "line 3, column 1")


# ---- the rest of the evaluation's inputs --------------------------------------------------------------------------


def _long_answer(tmp: Path) -> list:
    (tmp / "data").mkdir()
    (tmp / "data" / "piqa.jsonl").write_text(piqa_rows(0, 1, 2, LONG_ANSWER))
    return ["--tasks", "piqa", "--data-dir", tmp / "data"]


def _long_answer_in_full(tmp: Path) -> list:
    return ["--tasks", "piqa"]


def _hub_task(tmp: Path) -> list:
    (tmp / "tasks").mkdir()
    (tmp / "tasks" / "mine.yaml").write_text(
        "task: mine\n" + GOOD_TASK.replace("json", "nobody-here/no-such-dataset").format(data="x")
    )
    return ["--tasks", "mine", "--include-path", tmp / "tasks"]


def _rows(text: str | bytes):
    def make(tmp: Path) -> list:
        (tmp / "data").mkdir()
        path = tmp / "data" / "piqa.jsonl"
        (path.write_bytes if isinstance(text, bytes) else path.write_text)(text)
        return ["--tasks", "piqa", "--data-dir", tmp / "data"]

    return make


# name -> (arguments from the test's folder, exit code, words of the error line; `{tmp}` is the folder)
CASES = {
    "answer-longer-than-the-context": (
        _long_answer,
        INPUT,
        ["task piqa ({tmp}/data/piqa.jsonl), item 3:", "longer than the model's context of 512", "--limit 3"],
    ),
    "answer-longer-than-the-context-full-task": (
        _long_answer_in_full,
        INPUT,
        [f"task piqa ({PIQA}), item {LONG_ANSWER}:", f"--limit {LONG_ANSWER}"],
    ),
    "task-naming-a-hub-dataset": (_hub_task, INPUT, ["--tasks: lm-eval cannot load mine"]),
    "include-path-missing": (
        lambda tmp: ["--tasks", "piqa", "--include-path", tmp / "nowhere"],
        INPUT,
        ["--include-path: '{tmp}/nowhere' is not a directory"],
    ),
    "include-path-a-file": (
        lambda tmp: ["--tasks", "piqa", "--include-path", PIQA],
        USAGE,
        ["--include-path", "is a file"],
    ),
    "data-dir-missing": (
        lambda tmp: ["--tasks", "piqa", "--data-dir", tmp / "nowhere"],
        INPUT,
        ["{tmp}/nowhere/piqa.jsonl: file not found"],
    ),
    "data-file-empty": (_rows(""), INPUT, ["{tmp}/data/piqa.jsonl: found no rows"]),
    "data-file-a-list-per-line": (_rows("[1, 2]\n"), INPUT, ["{tmp}/data/piqa.jsonl:1: found list"]),
    "data-file-not-utf8": (_rows(b"\xff\xfe{}\n"), INPUT, ["{tmp}/data/piqa.jsonl:1: found malformed JSON"]),
    "data-file-missing-a-key": (
        _rows('{"query": "q", "choices": ["a", "b"]}\n'),
        INPUT,
        ["{tmp}/data/piqa.jsonl:1:", "expected keys query, choices, gold"],
    ),
    "batch-size-negative": (lambda tmp: ["--tasks", "piqa", "--batch-size", "-2"], USAGE, ["--batch-size"]),
    "num-fewshot-negative": (
        lambda tmp: ["--tasks", "piqa", "--num-fewshot", "-1"],
        USAGE,
        ["--num-fewshot: found -1"],
    ),
    "task-name-blank": (lambda tmp: ["--tasks", " , "], USAGE, ["--tasks: found no task names"]),
    "task-unknown-with-a-folder": (
        lambda tmp: ["--tasks", "nope", "--include-path", tmp],
        USAGE,
        ["--tasks: unknown task 'nope'", "piqa"],
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_eval_input_errors(tmp_path, own_tmp, name):
    make, code, words = CASES[name]
    args = make(tmp_path)
    res = evaluate(*args)
    assert_one_line_error(res, code, *(w.format(tmp=tmp_path) for w in words))


@pytest.mark.parametrize(
    "args",
    [
        ["nobody-here/no-such-model", "--tasks", "piqa"],
        [STORIES, "--tasks", "piqa", "--baseline", "nobody-here/no-such-model"],
    ],
    ids=["model", "baseline"],
)
def test_hub_id_offline_fails_at_once_without_retries(unreachable_hub, own_tmp, capfd, args):
    t = time.perf_counter()
    res = run_cli(["eval", *map(str, args), "--device", "cpu", "-q"])
    assert time.perf_counter() - t < 20  # huggingface_hub alone retries for about a minute
    assert_one_line_error(res, INPUT, "model 'nobody-here/no-such-model'", "the hub cannot be reached")
    assert "Retrying" not in capfd.readouterr().err


def test_refusal_of_a_long_answer_starts_its_own_line_after_the_progress_bars(tmp_path, own_tmp):
    res = run_cli(["eval", STORIES, "--device", "cpu", *_long_answer(tmp_path)])
    assert res.exit_code == INPUT, res.output
    assert "Traceback" not in res.output
    errors = [ln for ln in res.stderr.splitlines() if "qtool: error:" in ln]
    assert len(errors) == 1 and errors[0].startswith("qtool: error: --tasks: task piqa"), res.stderr


def test_long_context_is_truncated_from_the_left_and_counted(tmp_path, own_tmp):
    (tmp_path / "data").mkdir()
    long = {"query": "Question: " + "once upon a time there was a cat. " * 120 + "\nAnswer:"}
    rows = [json.loads(r) for r in piqa_rows(0, 1, 2).splitlines()] + [
        {**long, "choices": ["yes", "no"], "gold": 0}
    ]
    (tmp_path / "data" / "piqa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = evaluate("--tasks", "piqa", "--data-dir", tmp_path / "data", "--json")
    assert res.exit_code == 0, res.output
    protocol = json.loads(res.stdout)["zeroshot"]["protocol"]
    assert protocol["truncated_from_left"] == {"piqa": 2}  # both answers of the long item
