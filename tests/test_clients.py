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
    finder = qtool._AfterRegistryImport([name])
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


# Run in a process that never imports qtool: plain transformers, `pipeline` and lm-eval's command line.
_PLAIN = """
import json, sys
from transformers import AutoModelForCausalLM, pipeline

def outcome(load):
    try:
        load()
    except Exception as e:
        return "refused: " + str(e).splitlines()[0]
    return "loaded"

out = {}
for path in sys.argv[1:]:
    out[path] = [
        outcome(lambda: AutoModelForCausalLM.from_pretrained(path)),
        outcome(lambda: pipeline("text-generation", model=path)),
    ]
if sys.argv[1:2]:
    from lm_eval.__main__ import cli_evaluate
    for path in sys.argv[1:]:
        sys.argv = ["lm_eval", "--model", "hf", "--model_args", f"pretrained={path}", "--device", "cpu", "--tasks",
                    "piqa", "--limit", "1"]
        out[path].append(outcome(cli_evaluate))
print(json.dumps({"results": out, "qtool_imported": "qtool" in sys.modules}))
"""


def test_plain_clients_refuse_every_scheme_without_qtool(checkpoints):
    """Without `import qtool`, transformers' from_pretrained, `pipeline` and `lm_eval --model hf` refuse a
    checkpoint of every scheme at its config (model type `qtool`) instead of building random weights."""
    paths = [str(checkpoints[s]) for s in STAGES]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    run = subprocess.run(
        [sys.executable, "-c", _PLAIN, *paths], capture_output=True, text=True, cwd="/", env=env, check=True
    )
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["qtool_imported"] is False
    for path in paths:
        assert len(report["results"][path]) == 3
        for outcome in report["results"][path]:
            assert outcome.startswith("refused: ") and "model type `qtool`" in outcome, (path, outcome)


def test_lm_eval_command_refuses_without_qtool(checkpoints):
    """The `lm_eval` console command itself (a process without qtool) exits non-zero, naming the model type."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    lm_eval = os.path.join(os.path.dirname(sys.executable), "lm_eval")
    run = subprocess.run(
        [
            lm_eval,
            "--model",
            "hf",
            "--model_args",
            f"pretrained={checkpoints['grouped-int']}",
            "--device",
            "cpu",
            "--tasks",
            "piqa",
            "--limit",
            "1",
        ],
        capture_output=True,
        text=True,
        cwd="/",
        env=env,
    )
    assert run.returncode != 0 and "model type `qtool`" in run.stderr, run.stderr[-2000:]


def _as_version_1(path, dst) -> None:
    """A copy of checkpoint `path` in the form qtool wrote before config groups: config.json with the model's own
    model_type and a per-layer `layers` map (shapes included), format version 1."""
    import shutil

    from qtool.checkpoint.loader import read_config
    from qtool.checkpoint.manifest import dumps, file_sha256

    shutil.copytree(path, dst)
    config = read_config(path)
    config["quantization_config"]["format_version"] = 1
    (dst / "config.json").write_text(dumps(config))
    manifest = json.loads((dst / "qtool-manifest.json").read_text())
    manifest["files"]["config.json"] = file_sha256(dst / "config.json")
    manifest["sizes"]["config.json"] = (dst / "config.json").stat().st_size
    (dst / "qtool-manifest.json").write_text(dumps(manifest))


@pytest.mark.parametrize("scheme", ["grouped-int", "vq-kv-vq"])
def test_checkpoints_written_before_config_groups_still_load(checkpoints, tmp_path, scheme):
    from transformers import AutoModelForCausalLM

    path = checkpoints[scheme]
    _as_version_1(path, tmp_path / "old")
    stored = json.loads((tmp_path / "old" / "config.json").read_text())
    assert stored["model_type"] == "llama" and "layers" in stored["quantization_config"]
    assert stored["quantization_config"]["layers"]["model.layers.0.self_attn.q_proj"]["in_features"] == 64
    ids = torch.tensor([[1, 403, 407, 261, 378]])
    with torch.no_grad():
        want = qtool.load(path)(ids).logits
        assert torch.equal(qtool.load(tmp_path / "old")(ids).logits, want)
        hf = AutoModelForCausalLM.from_pretrained(tmp_path / "old", dtype=torch.float32)
        assert torch.equal(hf(ids).logits, want)


def test_config_holds_schemes_and_targets(checkpoints):
    """config.json names the model type qtool (the model's own beside it), groups the quantized layers by their
    config with block indices folded into `*`, and leaves out transformers' defaults."""
    stored = json.loads((checkpoints["mixed-2-4-16"] / "config.json").read_text())
    assert stored["model_type"] == "qtool" and stored["qtool_model_type"] == "llama"
    assert "id2label" not in stored and "output_attentions" not in stored
    q = stored["quantization_config"]
    assert q["quant_method"] == "qtool" and q["format_version"] == 2 and "layers" not in q
    targets = sorted(t for g in q["config_groups"].values() for t in g["targets"])
    # Block 0 only, down_proj excluded: explicit names, no `*`.
    assert targets == sorted(
        f"model.layers.0.{m}"
        for m in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
        )
    )
    assert all(k not in g for g in q["config_groups"].values() for k in ("in_features", "out_features"))
    every = json.loads((checkpoints["grouped-int"] / "config.json").read_text())["quantization_config"]
    (group,) = every["config_groups"].values()
    assert "model.layers.*.mlp.down_proj" in group["targets"] and len(group["targets"]) == 7
