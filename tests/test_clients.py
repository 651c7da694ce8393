"""Clients load qtool checkpoints through qtool's runtime, for every scheme qtool writes: `qtool.load` with
`generate` and `transformers.pipeline`, and (with qtool imported) transformers' own `from_pretrained`, `pipeline`
on the folder and lm-eval's `hf` model; a load transformers cannot do right is refused, never random weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import qtool

from conftest import ROOT, STORIES, TINY_SAMPLE, write_recipe

pytestmark = pytest.mark.skipif(not STORIES.is_dir(), reason="stories260K assets not found")

# Block 0 only (the runtime is the same in every block; the test budget is small), KV caches in every layer.
ONLY_0 = '    targets: {include: ["model.layers.0.*"]}\n'
STAGES = {
    "grouped-int": "  - stage: rtn\n    bits: 4\n    group_size: 32\n    symmetric: false\n",
    "quik": "  - stage: outliers\n    bits: 4\n    act_bits: 4\n    outliers: 8\n" + ONLY_0,
    "qoq-kv4": "  - stage: kv_cache\n    bits: 4\n  - stage: progressive\n    bits: 4\n    group_size: 4\n"
    "    solver: rtn\n",
    "mixed-2-4-16": "  - stage: mixed\n    scale_group_size: 4\n    outlier_fraction: 0.005\n"
    '    targets: {include: ["model.layers.0.*"], exclude: ["*.down_proj"]}\n',
    "vq-kv-vq": "  - stage: vq_kv\n    preset: cq-2\n    entries: 16\n    kmeans_iters: 2\n  - stage: vq\n"
    "    preset: gptvq-2\n    vector_size: 2\n    entries: 16\n    tile_rows: 32\n    tile_cols: 64\n"
    "    kmeans_iters: 2\n" + ONLY_0,
}
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("clients")
    out = {}
    for scheme, stages in STAGES.items():
        recipe = write_recipe(
            tmp / f"{scheme}.yaml",
            f"model: {STORIES}\ncalibration:\n  source: {TINY_SAMPLE}\n"
            f"  num_samples: 2\n  seq_len: 64\nstages:\n{stages}"
            f"output: {tmp / scheme}\n",
        )
        out[scheme], _ = qtool.quantize(recipe, run_eval=False)
    return out


def greedy(model, tokenizer, n: int = 8) -> str:
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    return tokenizer.decode(
        model.generate(ids, max_new_tokens=n, do_sample=False)[0], skip_special_tokens=True
    )


@pytest.mark.parametrize("scheme", list(STAGES))
def test_every_scheme_generates_and_loads_in_transformers(checkpoints, scheme):
    from transformers import AutoModelForCausalLM, pipeline

    from qtool.layouts.registry import LAYOUTS

    path = checkpoints[scheme]
    model, tokenizer = qtool.load(path), qtool.load_tokenizer(path)
    text = greedy(model, tokenizer)
    assert text.startswith(PROMPT) and len(text) > len(PROMPT)
    piped = pipeline("text-generation", model=model, tokenizer=tokenizer)
    assert piped(PROMPT, max_new_tokens=8, do_sample=False)[0]["generated_text"] == text

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    modules = set(LAYOUTS.values())
    assert (
        [n for n, m in model.named_modules() if type(m) in modules]
        == [n for n, m in hf.named_modules() if type(m) in modules]
        != []
    )
    ids = tokenizer("One day a little girl", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(hf(ids).logits, model(ids).logits)
    assert greedy(hf, tokenizer) == text
    by_path = pipeline("text-generation", model=str(path), dtype=torch.float32)
    assert by_path(PROMPT, max_new_tokens=8, do_sample=False)[0]["generated_text"] == text


def test_lm_eval_hf_model_loads_the_checkpoint(checkpoints):
    """`lm_eval --model hf --model_args pretrained=CHECKPOINT` scores what `qtool eval` scores."""
    from lm_eval import simple_evaluate

    from qtool.eval.zeroshot import TaskSuite, _offline_datasets, evaluate_tasks

    path = checkpoints["grouped-int"]
    with TaskSuite(["piqa"], limit=4) as suite:
        ours = evaluate_tasks(qtool.load(path), qtool.load_tokenizer(path), suite, torch.device("cpu"))
        with _offline_datasets():
            res = simple_evaluate(
                model="hf",
                model_args=f"pretrained={path},device=cpu,dtype=float32,softmax_dtype=float32",
                tasks=list(suite.load().values()),
                limit=4,
                task_manager=suite.manager,
                log_samples=False,
            )
    assert res["results"]["piqa"]["acc,none"] == ours["results"]["piqa"]["acc,none"]
    assert res["results"]["piqa"]["acc_norm,none"] == ours["results"]["piqa"]["acc_norm,none"]


def _edit(path, dst, edit) -> None:
    """A copy of checkpoint `path` with its tensors edited and its manifest made consistent again."""
    import shutil

    from qtool.checkpoint.manifest import dumps, file_sha256

    shutil.copytree(path, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    manifest = json.loads((dst / "qtool-manifest.json").read_text())
    manifest["files"]["model.safetensors"] = file_sha256(dst / "model.safetensors")
    manifest["sizes"]["model.safetensors"] = (dst / "model.safetensors").stat().st_size
    (dst / "qtool-manifest.json").write_text(dumps(manifest))


@pytest.mark.parametrize(
    "edit, words",
    [
        (
            lambda t: t.pop("model.norm.weight"),
            ["tensor model.norm.weight: missing", "initialised it randomly"],
        ),
        (lambda t: t.pop("model.layers.0.mlp.up_proj.scales"), ["model.layers.0.mlp.up_proj.scales"]),
        (lambda t: t.update({"model.extra": torch.zeros(2)}), ["tensor model.extra", "not a parameter"]),
        (lambda t: t["model.norm.weight"].fill_(float("nan")), ["tensor model.norm.weight", "NaN or Inf"]),
    ],
)
def test_from_pretrained_refuses_what_it_cannot_load(checkpoints, tmp_path, edit, words):
    from transformers import AutoModelForCausalLM

    from qtool.errors import CheckpointError

    _edit(checkpoints["grouped-int"], tmp_path / "bad", edit)
    with pytest.raises(CheckpointError) as e:
        AutoModelForCausalLM.from_pretrained(tmp_path / "bad")
    assert "\n" not in str(e.value) and all(w in str(e.value) for w in words), str(e.value)


def test_from_pretrained_refuses_offload_and_truncation(checkpoints, tmp_path):
    import shutil

    from transformers import AutoModelForCausalLM

    from qtool.errors import CheckpointError, NotImplementedYet

    path = checkpoints["grouped-int"]
    with pytest.raises(NotImplementedYet, match="device_map .*loads on one device"):
        AutoModelForCausalLM.from_pretrained(path, device_map={"model": "cpu", "lm_head": "disk"})
    shutil.copytree(path, tmp_path / "cut")
    with open(tmp_path / "cut" / "config.json", "a") as f:
        f.write(" ")
    with pytest.raises(CheckpointError, match=r"config.json: \d+ bytes, the manifest records \d+"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "cut")


def test_import_qtool_registers_when_transformers_loads_its_quantizers():
    """`import qtool` alone imports neither torch nor transformers (the command line stays fast); transformers'
    quantizer registry knows qtool as soon as it is imported."""
    import importlib

    import transformers.quantizers

    code = "import sys, qtool; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=True,
    )
    assert out.stdout.strip() == "[]"
    # The registry imported afresh (as in a process that imports qtool first) has qtool registered.
    name = "transformers.quantizers.auto"
    saved = sys.modules.pop(name)
    finder = qtool._AfterRegistryImport()
    sys.meta_path.insert(0, finder)
    try:
        fresh = importlib.import_module(name)
        assert fresh is not saved and fresh.AUTO_QUANTIZER_MAPPING["qtool"].__name__ == "QtoolHfQuantizer"
        assert finder not in sys.meta_path
    finally:
        if finder in sys.meta_path:
            sys.meta_path.remove(finder)
        sys.modules[name] = saved
        transformers.quantizers.auto = saved


def test_checkpoint_records_no_machine_paths_and_its_libraries(checkpoints):
    from conftest import ASSETS

    path = checkpoints["vq-kv-vq"]
    for f in path.iterdir():
        if f.suffix != ".safetensors":
            text = f.read_text()
            assert str(ASSETS) not in text and str(path.parent) not in text and "/" + "tmp" not in text, (
                f.name
            )
    recipe = (path / "recipe.yaml").read_text()
    assert f"model: {STORIES.name}\n" in recipe and f"source: {TINY_SAMPLE.name}\n" in recipe
    manifest = json.loads((path / "qtool-manifest.json").read_text())
    assert (
        manifest["calibration"]["source"] == TINY_SAMPLE.name
        and len(manifest["calibration"]["data_sha256"]) == 64
    )
    assert {"qtool", "torch", "transformers", "tokenizers", "safetensors", "numpy"} <= set(
        manifest["packages"]
    )
    assert manifest["sizes"] == {n: (path / n).stat().st_size for n in manifest["files"]}
