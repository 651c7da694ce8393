"""Shared fixtures: the real small models and texts beside the checkout, tiny random models, a CLI runner."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner

ROOT = Path(__file__).resolve().parent.parent
ASSETS = Path(os.environ.get("QTOOL_ASSETS", ROOT.parent / "shared" / "assets")).resolve()
STORIES = ASSETS / "models" / "stories260K"
TINYSTORIES = ASSETS / "data" / "tinystories" / "tinystories_train_head_2MiB.txt"
TINY_SAMPLE = ASSETS / "data" / "tinystories" / "cs336_tinystories_sample.txt"
# A real, fast run that the CLI, signal, resume and value tests share: stories260K (1 MB), GPTQ on 2 windows of 32
# tokens, written to `out` beside the recipe.
FAST_RECIPE = f"""
model: {STORIES}
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
WIKITEXT = ASSETS / "data" / "wikitext2" / "wikitext-2-raw-v1.test.joined.txt"
C4 = ASSETS / "data" / "c4" / "c4-en-train.00000-of-01024.first1000.jsonl"
SMOLLM2_CACHE = ROOT / ".cache" / "models" / "smollm2-135m"

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Parallel test workers (pytest -n) share the CPUs: one intra-op thread each, or their OpenMP threads spin
    # against each other (measured: slower in two workers than serially).
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if not STORIES.is_dir():
        skip = pytest.mark.skip(reason=f"assets not found at {ASSETS} (set QTOOL_ASSETS)")
        for item in items:
            if "assets" in item.keywords:
                item.add_marker(skip)


@pytest.fixture
def cli():
    """Invoke the qtool CLI in-process; returns click's Result (exit_code, output, stderr)."""
    from qtool.cli import cli as group

    runner = CliRunner()

    def invoke(*args: str):
        return runner.invoke(group, [str(a) for a in args], catch_exceptions=False)

    return invoke


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """SmolLM2-135M as a Hugging Face folder, converted once from the shared GGUF and cached in .cache/. Test
    workers running in parallel (pytest -n) take a file lock, so one converts and the others wait for it."""
    SMOLLM2_CACHE.parent.mkdir(parents=True, exist_ok=True)
    with open(SMOLLM2_CACHE.with_name(SMOLLM2_CACHE.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (SMOLLM2_CACHE / "config.json").is_file():
            tmp = SMOLLM2_CACHE.with_name(SMOLLM2_CACHE.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            subprocess.run(
                [
                    sys.executable,
                    str(ASSETS / "tools" / "smollm2_gguf_to_hf.py"),
                    str(ASSETS / "models" / "smollm2-135m" / "SmolLM2-135M-Instruct.Q4_1.gguf"),
                    str(tmp),
                ],
                check=True,
                capture_output=True,
                timeout=1200,  # a stuck conversion fails here instead of holding every worker waiting on the lock
            )
            tmp.rename(SMOLLM2_CACHE)
    return SMOLLM2_CACHE


def _save_tiny(model, out: Path) -> Path:
    from transformers import AutoTokenizer

    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(STORIES).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    """A 2-block random Llama (GQA, odd widths) with the stories260K tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=96,
        intermediate_size=200,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    return _save_tiny(LlamaForCausalLM(cfg).eval(), tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_opt(tmp_path_factory) -> Path:
    """A 2-block random OPT (biases, LayerNorm, fc1/fc2) with the stories260K tokenizer."""
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    cfg = OPTConfig(
        vocab_size=512,
        hidden_size=64,
        ffn_dim=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=256,
        word_embed_proj_dim=64,
    )
    return _save_tiny(OPTForCausalLM(cfg).eval(), tmp_path_factory.mktemp("tiny-opt"))


@pytest.fixture(scope="session")
def family(tmp_path_factory):
    """name -> a random-weight model folder of that family (tests/families.py), built on first use."""
    from families import build

    root = tmp_path_factory.mktemp("families")
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = build(name, root / name, STORIES)
        return built[name]

    return get


def write_recipe(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def finetune_pair(tmp_path: Path, template: str) -> SimpleNamespace:
    """stories260K quantized by the recipe `template` (its {steps}: fine-tuning steps) twice, with 0 and 8 steps:
    both results (`plain`, `tuned`), the tuned recipe's path, two calibration windows and each run's relative
    error of block 0's output against the float model's on them (`err_plain`, `err_tuned`)."""
    from qtool.calibration.data import TextSource, sample_windows
    from qtool.console import Reporter
    from qtool.models.loading import load_model
    from qtool.pipeline import quantize_model
    from qtool.recipe import load_recipe

    plain = quantize_model(
        load_recipe(write_recipe(tmp_path / "plain.yaml", template.format(steps=0))), Reporter(quiet=True)
    )
    tuned_recipe = write_recipe(tmp_path / "tuned.yaml", template.format(steps=8))
    tuned = quantize_model(load_recipe(tuned_recipe), Reporter(quiet=True))
    fp, tok, _, _ = load_model(str(STORIES), torch.float32)
    windows, _ = sample_windows(tok, TextSource(str(TINY_SAMPLE)), 2, 64, 0)

    def block0_error(model) -> float:
        num = den = 0.0
        with torch.no_grad():
            for row in windows:
                ref = fp(row[None], output_hidden_states=True).hidden_states[1]
                out = model(row[None], output_hidden_states=True).hidden_states[1]
                num += float((out - ref).pow(2).sum())
                den += float(ref.pow(2).sum())
        return num / den

    return SimpleNamespace(
        plain=plain,
        tuned=tuned,
        tuned_recipe=tuned_recipe,
        windows=windows,
        err_plain=block0_error(plain.model),
        err_tuned=block0_error(tuned.model),
    )


@pytest.fixture
def no_work(monkeypatch):
    """Fail the test (as an internal error, exit 70) if the pipeline (whole-model or block by block) starts or a
    model loads: the case must be refused before any work."""
    import qtool.pipeline

    def refuse(*a, **k):
        raise AssertionError("the pipeline started")

    monkeypatch.setattr(qtool.pipeline, "quantize_model", refuse)
    monkeypatch.setattr("qtool.onloaded.quantize_onloaded", refuse)
    monkeypatch.setattr("qtool.models.loading.load_model", refuse)
