"""The Python API's errors are qtool errors naming the argument: `device`, `dtype`, path types, the overrides of
`qtool.quantize` (by their keyword, not the recipe key they replace). Each raises the QtoolError subclass of its
exit code class with a one-line message, writes nothing, and never sends a path to the hub; a hub id on a machine
without network fails at once, in one line, instead of retrying for a minute."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

import qtool
from qtool.errors import CheckpointError, InputError, QtoolError, RecipeError, ResourceError, UsageError

from conftest import STORIES, TINY_SAMPLE, write_recipe

pytestmark = pytest.mark.skipif(not STORIES.is_dir(), reason="stories260K assets not found")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("api")
    recipe = write_recipe(
        tmp / "r.yaml", f"model: {STORIES}\nstages: [{{stage: rtn, bits: 4, group_size: 32}}]\n"
    )
    path, _ = qtool.quantize(recipe, output=tmp / "ckpt")
    return path


@pytest.fixture
def recipe(tmp_path) -> Path:
    return write_recipe(
        tmp_path / "r.yaml",
        f"model: {STORIES}\ncalibration: {{source: {TINY_SAMPLE}, num_samples: 2, seq_len: 32}}\n"
        f"stages: [{{stage: gptq, bits: 4, group_size: 32}}]\noutput: out\n",
    )


@pytest.fixture
def no_hub(monkeypatch):
    """Fail the test if anything opens a connection (the hub's reachability probe included)."""
    import socket

    def refuse(*a, **k):
        raise AssertionError(f"a connection was opened: {a}")

    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)


def raises(cls: type[QtoolError], call, *words: str) -> str:
    with pytest.raises(QtoolError) as info:
        call()
    e = info.value
    assert type(e) is cls, (type(e), str(e))
    message = str(e)
    assert "\n" not in message and message.strip() == message
    for w in words:
        assert w in message, (w, message)
    return message


LOAD = {
    "device-tpu": (UsageError, {"device": "tpu"}, ["load(device): found 'tpu'", "'cpu', 'cuda' or 'cuda:N'"]),
    "device-a-number": (UsageError, {"device": 3}, ["load(device): found 3"]),
    "device-cuda-index-garbled": (UsageError, {"device": "cuda:x"}, ["load(device): found 'cuda:x'"]),
    "device-cuda-99": (
        ResourceError,
        {"device": "cuda:99"},
        ["load(device): found 'cuda:99'", "expected 'cpu'"],
    ),
    "dtype-float8": (UsageError, {"dtype": "float8"}, ["load(dtype): found 'float8'", "bfloat16"]),
    "dtype-int8": (UsageError, {"dtype": torch.int8}, ["load(dtype): found torch.int8"]),
    "dtype-a-class": (UsageError, {"dtype": float}, ["load(dtype): found <class 'float'>"]),
    "verify-a-string": (UsageError, {"verify": "yes"}, ["load(verify): found 'yes'", "True or False"]),
}


@pytest.mark.parametrize("name", list(LOAD))
def test_load_argument_errors_name_the_argument(name, ckpt, no_hub):
    cls, kwargs, words = LOAD[name]
    raises(cls, lambda: qtool.load(ckpt, **kwargs), *words)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is there")
def test_load_on_cuda_without_a_gpu(ckpt):
    raises(
        ResourceError, lambda: qtool.load(ckpt, device="cuda"), "load(device): found 'cuda'", "no CUDA device"
    )


@pytest.mark.parametrize(
    "call, cls, words",
    [
        (lambda: qtool.load(123), UsageError, ["load(path): found 123", "os.PathLike"]),
        (lambda: qtool.load(None), UsageError, ["load(path): found None"]),
        (lambda: qtool.load(""), UsageError, ["load(path): found ''"]),
        (lambda: qtool.load("no/such"), CheckpointError, ["no/such: not a directory"]),
        (lambda: qtool.load(Path("./missing")), CheckpointError, ["missing: not a directory"]),
        (lambda: qtool.load_tokenizer(123), UsageError, ["load_tokenizer(path): found 123"]),
        (lambda: qtool.load_tokenizer("no/such"), CheckpointError, ["no/such: not a directory"]),
        (lambda: qtool.quantize(None), UsageError, ["quantize(recipe): found None", "a recipe file"]),
        (lambda: qtool.quantize(3.5), UsageError, ["quantize(recipe): found 3.5"]),
    ],
)
def test_path_arguments(call, cls, words, no_hub):
    raises(cls, call, *words)


QUANTIZE = {
    "num-samples-a-string": (
        UsageError,
        {"num_samples": "many"},
        ["quantize(num_samples): found 'many'", "an integer"],
    ),
    "num-samples-a-bool": (UsageError, {"num_samples": True}, ["quantize(num_samples): found True"]),
    "num-samples-zero": (UsageError, {"num_samples": 0}, ["quantize(num_samples): found 0", "1..100000"]),
    "num-samples-beyond-the-text": (
        UsageError,
        {"num_samples": 5000},
        ["quantize(num_samples): found 5000 windows"],
    ),
    "seq-len-a-float": (UsageError, {"seq_len": 32.0}, ["quantize(seq_len): found 32.0"]),
    "seq-len-beyond-the-context": (
        UsageError,
        {"seq_len": 4096},
        ["quantize(seq_len): found 4096 tokens", "512"],
    ),
    "seed-negative": (UsageError, {"seed": -1}, ["quantize(seed): found -1"]),
    "seed-past-int64": (UsageError, {"seed": 2**64}, ["quantize(seed): found 18446744073709551616"]),
    "eval-windows-zero": (UsageError, {"eval_windows": 0}, ["quantize(eval_windows): found 0"]),
    "output-a-number": (UsageError, {"output": 5}, ["quantize(output): found 5", "a path"]),
    "model-a-list": (UsageError, {"model": ["a"]}, ["quantize(model): found ['a']"]),
    "model-missing-path": (InputError, {"model": "./no-model"}, ["quantize(model): path", "does not exist"]),
    "calibration-missing-file": (
        InputError,
        {"calibration": "./none.txt"},
        ["quantize(calibration): file", "does not exist"],
    ),
    "stats-missing": (InputError, {"stats": "./none.safetensors"}, ["quantize(stats)", "does not exist"]),
    "run-eval-a-string": (UsageError, {"run_eval": "no"}, ["quantize(run_eval): found 'no'"]),
    "overwrite-a-number": (UsageError, {"overwrite": 1}, ["quantize(overwrite): found 1"]),
    "quiet-none": (UsageError, {"quiet": None}, ["quantize(quiet): found None"]),
    "unknown-override": (UsageError, {"samples": 8}, ["unknown override 'samples'"]),
}


@pytest.mark.parametrize("name", list(QUANTIZE))
def test_quantize_argument_errors_name_the_keyword(name, recipe, tmp_path, no_work, no_hub):
    cls, kwargs, words = QUANTIZE[name]
    cwd = os.getcwd()
    os.chdir(tmp_path)  # the relative paths above are the caller's, from its working directory
    try:
        raises(cls, lambda: qtool.quantize(recipe, **kwargs), *words)
    finally:
        os.chdir(cwd)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


def test_a_recipe_error_still_names_the_recipe_key(tmp_path, no_work):
    r = write_recipe(
        tmp_path / "r.yaml", f"model: {STORIES}\nstages: [{{stage: rtn, bits: 99}}]\noutput: o\n"
    )
    raises(RecipeError, lambda: qtool.quantize(r), "r.yaml:stages[0].bits: found 99")


def test_good_arguments_still_load(ckpt):
    model = qtool.load(str(ckpt), device=torch.device("cpu"), dtype="bfloat16", verify=True)
    assert model.model.norm.weight.dtype == torch.bfloat16
    assert qtool.load_tokenizer(ckpt)("Once upon a time").input_ids == [1, 403, 407, 261, 378]


# ---- the hub, offline ---------------------------------------------------------------------------------------------


@pytest.fixture
def unreachable_hub(monkeypatch):
    """The hub cannot be reached (the probe fails); offline mode, which the probe then turns on, is undone after."""
    import huggingface_hub.constants

    from qtool import hub

    monkeypatch.setattr(hub, "_decided", None)
    monkeypatch.setattr(hub, "_reachable", lambda host, port: False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)


def test_hub_id_offline_fails_at_once_in_one_line(unreachable_hub, capfd):
    import time

    from bad_input import assert_one_line_error, run_cli

    t = time.perf_counter()
    res = run_cli(["eval", "nobody-here/no-such-model", "--text", TINY_SAMPLE, "--seq-len", "32"])
    assert time.perf_counter() - t < 20
    assert_one_line_error(res, 4, "model 'nobody-here/no-such-model'", "the hub cannot be reached")
    assert "Retrying" not in capfd.readouterr().err


@pytest.mark.parametrize("ref", ["/no/such/model", "./no-such", "~/no-such-model"])
def test_a_path_that_does_not_exist_is_never_sent_to_the_hub(ref, no_hub):
    from bad_input import assert_one_line_error, run_cli

    res = run_cli(["eval", ref, "--text", TINY_SAMPLE, "--seq-len", "32"])
    assert_one_line_error(res, 4, f"model '{ref}': no such folder")


def test_api_tokenizer_of_a_model_folder(tmp_path):
    shutil.copytree(STORIES, tmp_path / "m")
    assert qtool.load_tokenizer(tmp_path / "m")("Once").input_ids[0] == 1
