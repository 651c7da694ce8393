"""Malformed models, checkpoints, configs, tokenizers, texts and stats files: each fails before any work with one
line naming the file, key or tensor, under its class's exit code (4 input, 5 checkpoint, 3 recipe, 2 usage), and
leaves nothing at the output path.

Every case copies stories260K (or one RTN checkpoint of it, made once for the module) into tmp_path and breaks one
thing. The cases run in-process; the few that must succeed (the opt-ins: `allow_long_context`, `encoding`) are at
the end.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from bad_input import assert_nothing_at, assert_one_line_error, run_cli
from conftest import ROOT, STORIES, TINY_SAMPLE, TINYSTORIES, write_recipe

pytestmark = pytest.mark.skipif(not STORIES.is_dir(), reason="stories260K assets not found")

USAGE, RECIPE, INPUT, CHECKPOINT = 2, 3, 4, 5
WEIGHTS = "model.safetensors"
MANIFEST = "qtool-manifest.json"


# ---- building broken inputs ----------------------------------------------------------------------------------


def copy_model(tmp: Path) -> Path:
    dst = tmp / "model"
    shutil.copytree(STORIES, dst)
    for p in dst.iterdir():  # the shared assets are read-only
        p.chmod(0o644)
    dst.chmod(0o755)
    return dst


def edit_tensors(folder: Path, edit: Callable[[dict], None], name: str = WEIGHTS) -> None:
    t = load_file(str(folder / name))
    edit(t)
    save_file(t, str(folder / name), metadata={"format": "pt"})


def edit_json(path: Path, edit: Callable[[dict], object]) -> None:
    """Edit the parsed JSON in place (what `edit` returns is ignored, so `dict.pop` can be the edit)."""
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def poison(name: str, value: float, index: tuple = (0,)):
    def edit(t):
        t[name] = t[name].clone()
        t[name][index] = value

    return edit


def shard(folder: Path) -> list[str]:
    """Split the weights into two shards with their index (the Hugging Face layout of big models)."""
    t = load_file(str(folder / WEIGHTS))
    names = sorted(t)
    files = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    halves = [names[: len(names) // 2], names[len(names) // 2 :]]
    for fname, part in zip(files, halves, strict=True):
        save_file({n: t[n] for n in part}, str(folder / fname), metadata={"format": "pt"})
    weight_map = {n: f for f, part in zip(files, halves, strict=True) for n in part}
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    (folder / WEIGHTS).unlink()
    return files


def other_shard(folder: Path, name: str = "model.norm.weight") -> str:
    """Shard the weights; return the shard that does not hold `name`."""
    files = shard(folder)
    return files[0] if name not in load_file(str(folder / files[0])) else files[1]


def truncate(path: Path, keep: int | None = None) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2 if keep is None else keep])


def header_only(path: Path) -> None:
    """The 8-byte length and the JSON header, without the tensor data."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    path.write_bytes(data[: 8 + n])


def garble_header(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[8:24] = b"\x00garbage-header!"
    path.write_bytes(bytes(data))


def rehash(ckpt: Path, *names: str) -> None:
    """Make the manifest agree with edited files, so the corruption is found by what reads them, not the hash."""
    from qtool.checkpoint.manifest import file_sha256

    m = json.loads((ckpt / MANIFEST).read_text())
    for name in names:
        if (ckpt / name).exists():
            m["files"][name] = file_sha256(ckpt / name)
            m["sizes"][name] = (ckpt / name).stat().st_size
        else:
            m["files"].pop(name, None)
            m["sizes"].pop(name, None)
    (ckpt / MANIFEST).write_text(json.dumps(m))


def rtn_recipe(tmp: Path, model: Path, extra: str = "") -> Path:
    return write_recipe(
        tmp / "r.yaml", f"model: {model}\nstages: [{{stage: rtn, bits: 4, group_size: 32}}]\n{extra}"
    )


def gptq_recipe(tmp: Path, model: Path, source: Path, cal_extra: str = "", extra: str = "") -> Path:
    return write_recipe(
        tmp / "r.yaml",
        f"""
model: {model}
calibration:
  source: {source}
  num_samples: 2
  seq_len: 32
{cal_extra}
stages: [{{stage: gptq, bits: 4, group_size: 32}}]
{extra}""",
    )


def eval_args(model: Path, *extra) -> list:
    return [
        "eval",
        model,
        "--text",
        TINY_SAMPLE,
        "--seq-len",
        "32",
        "--windows",
        "1",
        "--device",
        "cpu",
        *extra,
    ]


# ---- the valid checkpoint that the checkpoint cases corrupt ---------------------------------------------------


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("good")
    out = tmp / "ckpt"
    res = run_cli(["quantize", rtn_recipe(tmp, STORIES), "-o", out, "-q"])
    assert res.exit_code == 0, res.output
    # The corruptions below are what fail: the checkpoint itself verifies.
    res = run_cli(["pack", out, "-q"])
    assert res.exit_code == 0, res.output
    return out


def copy_ckpt(ckpt: Path, tmp: Path) -> Path:
    dst = tmp / "ckpt"
    shutil.copytree(ckpt, dst)
    return dst


# ---- the cases ---------------------------------------------------------------------------------------------


@dataclass
class Case:
    code: int
    words: tuple[str, ...]
    # (tmp_path, the valid checkpoint) -> (CLI args, the output path that must stay absent, or None)
    build: Callable[[Path, Path], tuple[list, Path | None]]


def quantize_broken_model(breaker: Callable[[Path], object]):
    def build(tmp, _):
        model = copy_model(tmp)
        breaker(model)
        return ["quantize", rtn_recipe(tmp, model), "-o", tmp / "out"], tmp / "out"

    return build


def eval_broken_model(breaker: Callable[[Path], object]):
    def build(tmp, _):
        model = copy_model(tmp)
        breaker(model)
        return eval_args(model), None

    return build


def calibrate_broken_model(breaker: Callable[[Path], object]):
    def build(tmp, _):
        model = copy_model(tmp)
        breaker(model)
        out = tmp / "stats.safetensors"
        return [
            "calibrate",
            "--model",
            model,
            "--calibration",
            TINY_SAMPLE,
            "--num-samples",
            "2",
            "--seq-len",
            "32",
            "-o",
            out,
        ], out

    return build


def pack_broken_ckpt(breaker: Callable[[Path], object]):
    def build(tmp, ckpt):
        c = copy_ckpt(ckpt, tmp)
        breaker(c)
        return ["pack", c, "-o", tmp / "out"], tmp / "out"

    return build


def eval_broken_ckpt(breaker: Callable[[Path], object], *extra):
    def build(tmp, ckpt):
        c = copy_ckpt(ckpt, tmp)
        breaker(c)
        return eval_args(c, *extra), None

    return build


def quantize_with_text(content: bytes, suffix: str = ".txt", cal_extra: str = ""):
    def build(tmp, _):
        src = tmp / f"cal{suffix}"
        src.write_bytes(content)
        return ["quantize", gptq_recipe(tmp, STORIES, src, cal_extra), "-o", tmp / "out"], tmp / "out"

    return build


def eval_with_text(content: bytes, suffix: str = ".txt", *extra):
    def build(tmp, _):
        src = tmp / f"text{suffix}"
        src.write_bytes(content)
        return ["eval", STORIES, "--text", src, "--seq-len", "32", "--device", "cpu", *extra], None

    return build


def quantize_recipe(cal_line: str = "", extra: str = "", *args):
    """quantize (GPTQ on the TinyStories sample) with `cal_line` replacing the calibration's seq_len line."""

    def build(tmp, _):
        recipe = gptq_recipe(tmp, STORIES, TINY_SAMPLE, extra=extra)
        if cal_line:
            recipe.write_text(recipe.read_text().replace("  seq_len: 32", cal_line))
        return ["quantize", recipe, "-o", tmp / "out", *args], tmp / "out"

    return build


def with_stats(make: Callable[[Path], None], stage: str = "rtn"):
    """quantize with `calibration.stats` (RTN with clipping reads the per-linear statistics)."""

    def build(tmp, _):
        stats = tmp / "stats.safetensors"
        make(stats)
        recipe = write_recipe(
            tmp / "r.yaml",
            f"""
model: {STORIES}
calibration: {{source: {TINY_SAMPLE}, num_samples: 2, seq_len: 32, stats: {stats}}}
stages: [{{stage: {stage}, bits: 4, group_size: 32, clip: true}}]
""",
        )
        return ["quantize", recipe, "-o", tmp / "out"], tmp / "out"

    return build


def stories_stats(
    path: Path, width: dict[str, int] | None = None, nan: str | None = None, extra_linear: str | None = None
) -> None:
    """A stats file in the format qtool calibrate writes, with the stories260K linears' names (widths overridable)."""
    from qtool.calibration.stats import LinearStats, save_stats

    names = [
        f"model.layers.{i}.{rel}"
        for i in range(5)
        for rel in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        )
    ]
    if extra_linear:
        names.append(extra_linear)
    stats = {}
    for n in names:
        k = (width or {}).get(n, 172 if n.endswith("down_proj") else 64)
        s = LinearStats(k, hessian=False)
        s.update(torch.randn(8, k))
        if n == nan:
            s.absmax[3] = float("nan")
        stats[n] = s
    save_stats(path, stats, {"model": "x"})


def remove(*names: str):
    def edit(folder: Path):
        for n in names:
            (folder / n).unlink()

    return edit


def set_config(key: str, value):
    return lambda folder: edit_json(folder / "config.json", lambda c: c.__setitem__(key, value))


def in_ckpt(edit: Callable[[Path], object], *changed: str):
    """Apply `edit` to a checkpoint copy, then make the manifest agree with the changed files."""

    def breaker(c: Path):
        edit(c)
        rehash(c, *changed)

    return breaker


def drop_manifest(c: Path) -> None:
    (c / MANIFEST).unlink()


def edit_layer_configs(c: Path, edit) -> None:
    """Rewrite a checkpoint's config.json in the per-layer form (format version 1, which qtool still reads) with
    `edit` applied to the layer configs."""
    from qtool.checkpoint.loader import read_config

    cfg = read_config(c)
    cfg["quantization_config"]["format_version"] = 1
    edit(cfg["quantization_config"]["layers"])
    (c / "config.json").write_text(json.dumps(cfg))


def strip_checkpoint_marks(c: Path) -> None:
    """A checkpoint without its manifest, recipe and quantization_config: only its packed tensor names are left."""
    (c / MANIFEST).unlink()
    (c / "recipe.yaml").unlink()
    edit_json(c / "config.json", lambda cfg: cfg.pop("quantization_config"))
    edit_json(c / "config.json", lambda cfg: cfg.__setitem__("model_type", cfg.pop("qtool_model_type")))


def smaller_vocab(folder: Path) -> None:
    """A model whose embedding has 256 rows, next to a tokenizer of 512 tokens (a tokenizer of another model)."""
    edit_json(folder / "config.json", lambda c: c.__setitem__("vocab_size", 256))
    edit_tensors(
        folder,
        lambda t: t.update({"model.embed_tokens.weight": t["model.embed_tokens.weight"][:256].contiguous()}),
    )


LATIN1 = ("Once upon a time, a café served crème brûlée to a naïve señor. " * 40).encode("latin-1")

CASES = {
    # -- original model: weights
    "missing-tensor": Case(
        INPUT,
        ("model.layers.2.mlp.up_proj.weight", "missing"),
        quantize_broken_model(
            lambda m: edit_tensors(m, lambda t: t.pop("model.layers.2.mlp.up_proj.weight"))
        ),
    ),
    "missing-norm-at-eval": Case(
        INPUT,
        ("model.norm.weight", "missing"),
        eval_broken_model(lambda m: edit_tensors(m, lambda t: t.pop("model.norm.weight"))),
    ),
    "unexpected-tensor": Case(
        INPUT,
        ("model.layers.0.mlp.extra.weight", "not a parameter"),
        quantize_broken_model(
            lambda m: edit_tensors(
                m, lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.ones(4, 4)})
            )
        ),
    ),
    "shape-mismatch": Case(
        INPUT,
        ("model.layers.1.self_attn.q_proj.weight", "found shape [64, 63]", "[64, 64]"),
        quantize_broken_model(
            lambda m: edit_tensors(
                m, lambda t: t.update({"model.layers.1.self_attn.q_proj.weight": torch.ones(64, 63)})
            )
        ),
    ),
    "integer-norm": Case(
        INPUT,
        ("model.norm.weight", "I32", "floating-point"),
        eval_broken_model(
            lambda m: edit_tensors(
                m, lambda t: t.update({"model.norm.weight": torch.ones(64, dtype=torch.int32)})
            )
        ),
    ),
    "nan-in-weight": Case(
        INPUT,
        ("model.layers.3.mlp.down_proj.weight", "NaN or Inf"),
        quantize_broken_model(
            lambda m: edit_tensors(m, poison("model.layers.3.mlp.down_proj.weight", float("nan"), (0, 0)))
        ),
    ),
    "inf-in-embedding": Case(
        INPUT,
        ("model.embed_tokens.weight", "NaN or Inf"),
        eval_broken_model(
            lambda m: edit_tensors(m, poison("model.embed_tokens.weight", float("inf"), (5, 1)))
        ),
    ),
    "nan-in-norm-calibrate": Case(
        INPUT,
        ("model.layers.0.input_layernorm.weight", "NaN or Inf"),
        calibrate_broken_model(
            lambda m: edit_tensors(m, poison("model.layers.0.input_layernorm.weight", float("nan")))
        ),
    ),
    # -- original model: files
    "truncated-safetensors": Case(
        INPUT, ("model.safetensors", "truncated"), quantize_broken_model(lambda m: truncate(m / WEIGHTS))
    ),
    "zero-byte-safetensors": Case(
        INPUT, ("model.safetensors", "0 bytes"), quantize_broken_model(lambda m: truncate(m / WEIGHTS, 0))
    ),
    "header-only-safetensors": Case(
        INPUT,
        ("model.safetensors", "truncated", "ends at byte"),
        eval_broken_model(lambda m: header_only(m / WEIGHTS)),
    ),
    "garbled-header": Case(
        INPUT,
        ("model.safetensors", "garbled safetensors header"),
        eval_broken_model(lambda m: garble_header(m / WEIGHTS)),
    ),
    "no-weights": Case(INPUT, ("no weights", "model.safetensors"), quantize_broken_model(remove(WEIGHTS))),
    "index-names-missing-shard": Case(
        INPUT,
        ("model-00002-of-00002.safetensors", "missing"),
        quantize_broken_model(lambda m: (m / shard(m)[1]).unlink()),
    ),
    "shards-without-index": Case(
        INPUT,
        ("model-00001-of-00002.safetensors", "model.safetensors.index.json"),
        eval_broken_model(lambda m: (shard(m), (m / "model.safetensors.index.json").unlink())),
    ),
    "garbled-index": Case(
        INPUT,
        ("model.safetensors.index.json", "invalid JSON"),
        eval_broken_model(
            lambda m: (shard(m), (m / "model.safetensors.index.json").write_text('{"weight_map": {'))
        ),
    ),
    "duplicate-across-shards": Case(
        INPUT,
        ("model.norm.weight", "stored twice"),
        quantize_broken_model(
            lambda m: edit_tensors(
                m, lambda t: t.update({"model.norm.weight": torch.ones(64)}), other_shard(m)
            )
        ),
    ),
    "index-lists-absent-tensor": Case(
        INPUT,
        ("model.norm.weight", "does not hold it"),
        eval_broken_model(
            lambda m: (
                shard(m),
                [
                    edit_tensors(m, lambda t: t.pop("model.norm.weight", None), f)
                    for f in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
                ],
            )
        ),
    ),
    "index-maps-to-wrong-shard": Case(
        INPUT,
        ("model.norm.weight", "maps it to", "but it is in"),
        eval_broken_model(
            lambda m: (
                wrong := other_shard(m),
                edit_json(
                    m / "model.safetensors.index.json",
                    lambda ix: ix["weight_map"].update({"model.norm.weight": wrong}),
                ),
            )
        ),
    ),
    # -- original model: config.json
    "config-missing": Case(INPUT, ("config.json", "missing"), eval_broken_model(remove("config.json"))),
    "config-garbled": Case(
        INPUT,
        ("config.json", "invalid JSON"),
        eval_broken_model(lambda m: (m / "config.json").write_text('{"hidden_size": 64,')),
    ),
    "config-hidden-size-string": Case(
        INPUT,
        ("config.json", "hidden_size", "'abc'", "positive integer"),
        quantize_broken_model(set_config("hidden_size", "abc")),
    ),
    "config-negative-layers": Case(
        INPUT,
        ("config.json", "num_hidden_layers", "-1"),
        eval_broken_model(set_config("num_hidden_layers", -1)),
    ),
    "config-heads-do-not-divide": Case(
        INPUT, ("config.json", "attention heads"), eval_broken_model(set_config("num_attention_heads", 7))
    ),
    "config-fewer-layers-than-weights": Case(
        INPUT, ("model.layers.3.", "not a parameter"), eval_broken_model(set_config("num_hidden_layers", 3))
    ),
    "config-architectures-not-a-list": Case(
        INPUT,
        ("config.json", "architectures"),
        quantize_broken_model(set_config("architectures", "LlamaForCausalLM")),
    ),
    # -- original model: tokenizer
    "tokenizer-missing": Case(
        INPUT,
        ("no tokenizer", "tokenizer.json"),
        quantize_broken_model(remove("tokenizer.json", "tokenizer.model")),
    ),
    "tokenizer-missing-at-eval": Case(
        INPUT, ("no tokenizer",), eval_broken_model(remove("tokenizer.json", "tokenizer.model"))
    ),
    "tokenizer-garbled": Case(
        INPUT,
        ("tokenizer.json", "invalid JSON"),
        quantize_broken_model(lambda m: (m / "tokenizer.json").write_text('{"model": {"vocab": [1, 2')),
    ),
    "tokenizer-of-another-model": Case(
        INPUT, ("token id", "vocab_size 256"), eval_broken_model(smaller_vocab)
    ),
    # -- checkpoints where an original model is expected, or the reverse
    "checkpoint-as-original": Case(
        INPUT,
        ("packed qtool checkpoint", "original"),
        lambda tmp, ckpt: (
            ["quantize", rtn_recipe(tmp, copy_ckpt(ckpt, tmp)), "-o", tmp / "out"],
            tmp / "out",
        ),
    ),
    "checkpoint-without-manifest": Case(
        CHECKPOINT, (MANIFEST, "looks like a qtool checkpoint"), eval_broken_ckpt(drop_manifest)
    ),
    "packed-tensors-without-marks": Case(
        CHECKPOINT, ("packed tensor", ".qweight", MANIFEST), eval_broken_ckpt(strip_checkpoint_marks)
    ),
    # -- checkpoints
    "ckpt-nan-in-norm": Case(
        CHECKPOINT,
        ("model.norm.weight", "NaN or Inf"),
        pack_broken_ckpt(
            in_ckpt(lambda c: edit_tensors(c, poison("model.norm.weight", float("nan"))), WEIGHTS)
        ),
    ),
    "ckpt-inf-in-embedding": Case(
        CHECKPOINT,
        ("model.embed_tokens.weight", "NaN or Inf"),
        eval_broken_ckpt(
            in_ckpt(
                lambda c: edit_tensors(c, poison("model.embed_tokens.weight", float("-inf"), (3, 3))), WEIGHTS
            )
        ),
    ),
    "ckpt-nan-in-scale": Case(
        CHECKPOINT,
        ("model.layers.2.mlp.gate_proj.scales", "NaN or Inf"),
        pack_broken_ckpt(
            in_ckpt(
                lambda c: edit_tensors(
                    c, poison("model.layers.2.mlp.gate_proj.scales", float("nan"), (1, 0))
                ),
                WEIGHTS,
            )
        ),
    ),
    "ckpt-inf-in-scale": Case(
        CHECKPOINT,
        ("model.layers.0.self_attn.v_proj.scales", "NaN or Inf"),
        eval_broken_ckpt(
            in_ckpt(
                lambda c: edit_tensors(
                    c, poison("model.layers.0.self_attn.v_proj.scales", float("inf"), (0, 1))
                ),
                WEIGHTS,
            )
        ),
    ),
    "ckpt-qweight-wrong-dtype": Case(
        CHECKPOINT,
        ("model.layers.1.mlp.up_proj.qweight", "torch.int64"),
        pack_broken_ckpt(
            in_ckpt(
                lambda c: edit_tensors(
                    c,
                    lambda t: t.update(
                        {"model.layers.1.mlp.up_proj.qweight": t["model.layers.1.mlp.up_proj.qweight"].long()}
                    ),
                ),
                WEIGHTS,
            )
        ),
    ),
    "ckpt-norm-wrong-dtype": Case(
        CHECKPOINT,
        ("model.norm.weight", "int32"),
        pack_broken_ckpt(
            in_ckpt(
                lambda c: edit_tensors(
                    c, lambda t: t.update({"model.norm.weight": torch.ones(64, dtype=torch.int32)})
                ),
                WEIGHTS,
            )
        ),
    ),
    "ckpt-norm-float64": Case(
        CHECKPOINT,
        ("model.norm.weight", "found dtype float64", "expected float32", "config.json"),
        pack_broken_ckpt(
            in_ckpt(
                lambda c: edit_tensors(
                    c, lambda t: t.update({"model.norm.weight": t["model.norm.weight"].double()})
                ),
                WEIGHTS,
            )
        ),
    ),
    "ckpt-embedding-float16-at-eval": Case(
        CHECKPOINT,
        ("model.embed_tokens.weight", "found dtype float16", "expected float32"),
        eval_broken_ckpt(
            in_ckpt(
                lambda c: edit_tensors(
                    c,
                    lambda t: t.update({"model.embed_tokens.weight": t["model.embed_tokens.weight"].half()}),
                ),
                WEIGHTS,
            )
        ),
    ),
    "ckpt-truncated-safetensors": Case(
        CHECKPOINT,
        ("model.safetensors", "truncated"),
        pack_broken_ckpt(in_ckpt(lambda c: truncate(c / WEIGHTS), WEIGHTS)),
    ),
    "ckpt-zero-byte-safetensors": Case(
        CHECKPOINT,
        ("model.safetensors", "0 bytes"),
        eval_broken_ckpt(in_ckpt(lambda c: truncate(c / WEIGHTS, 0), WEIGHTS)),
    ),
    "ckpt-config-missing": Case(
        CHECKPOINT,
        ("config.json", "missing"),
        pack_broken_ckpt(in_ckpt(remove("config.json"), "config.json")),
    ),
    "ckpt-config-missing-at-eval": Case(
        CHECKPOINT,
        ("config.json", "missing"),
        eval_broken_ckpt(in_ckpt(remove("config.json"), "config.json")),
    ),
    "ckpt-config-garbled": Case(
        CHECKPOINT,
        ("config.json", "invalid JSON"),
        eval_broken_ckpt(in_ckpt(lambda c: (c / "config.json").write_text("{nope"), "config.json")),
    ),
    "ckpt-config-hidden-size-string": Case(
        CHECKPOINT,
        ("config.json", "hidden_size", "positive integer"),
        pack_broken_ckpt(in_ckpt(set_config("hidden_size", "abc"), "config.json")),
    ),
    "ckpt-config-shape-mismatch": Case(
        CHECKPOINT,
        ("config.json", "model.layers.0.mlp.gate_proj", "[172, 8]", "[170, 8]", "64x170"),
        pack_broken_ckpt(in_ckpt(set_config("intermediate_size", 170), "config.json")),
    ),
    "ckpt-layer-config-without-bits": Case(
        CHECKPOINT,
        ("config.json", "model.layers.0.mlp.up_proj", "bits"),
        pack_broken_ckpt(
            in_ckpt(
                lambda c: edit_layer_configs(
                    c, lambda layers: layers["model.layers.0.mlp.up_proj"].pop("bits")
                ),
                "config.json",
            )
        ),
    ),
    "ckpt-tokenizer-missing": Case(
        CHECKPOINT, ("no tokenizer",), pack_broken_ckpt(in_ckpt(remove("tokenizer.json"), "tokenizer.json"))
    ),
    "ckpt-tokenizer-missing-at-eval": Case(
        CHECKPOINT, ("no tokenizer",), eval_broken_ckpt(in_ckpt(remove("tokenizer.json"), "tokenizer.json"))
    ),
    "ckpt-tokenizer-garbled": Case(
        CHECKPOINT,
        ("tokenizer.json", "invalid JSON"),
        pack_broken_ckpt(in_ckpt(lambda c: (c / "tokenizer.json").write_text("[1, 2,"), "tokenizer.json")),
    ),
    "ckpt-manifest-a-list": Case(
        CHECKPOINT,
        (MANIFEST, "expected an object"),
        pack_broken_ckpt(lambda c: (c / MANIFEST).write_text("[1, 2]")),
    ),
    "ckpt-seq-len-beyond-context": Case(
        USAGE,
        ("--seq-len", "4096", "512", "--allow-long-context"),
        lambda tmp, ckpt: (
            ["eval", ckpt, "--text", TINYSTORIES, "--seq-len", "4096", "--windows", "1"],
            None,
        ),
    ),
    # -- calibration text
    "calibration-empty": Case(INPUT, ("cal.txt", "no text"), quantize_with_text(b"")),
    "calibration-whitespace": Case(INPUT, ("cal.txt", "no text"), quantize_with_text(b" \n\n\t  \n")),
    "calibration-shorter-than-a-window": Case(
        INPUT, ("cal.txt", "tokens, expected at least 33"), quantize_with_text(b"Once upon a time.")
    ),
    "calibration-latin1": Case(INPUT, ("cal.txt", "not utf-8", "offset", "0xe9"), quantize_with_text(LATIN1)),
    "calibration-jsonl-missing-field": Case(
        INPUT,
        ("cal.jsonl:3", "no field 'text'"),
        quantize_with_text(
            b'{"text": "a story"}\n{"text": "another"}\n{"body": "no text field"}\n', ".jsonl"
        ),
    ),
    "calibration-jsonl-garbled-line": Case(
        INPUT,
        ("cal.jsonl:2", "invalid JSON"),
        quantize_with_text(b'{"text": "a story"}\n{"text": "unterminated\n{"text": "x"}\n', ".jsonl"),
    ),
    "calibration-jsonl-not-an-object": Case(
        INPUT, ("cal.jsonl:1", "list"), quantize_with_text(b'["text", "in a list"]\n', ".jsonl")
    ),
    "calibration-unknown-encoding": Case(
        RECIPE,
        ("calibration.encoding", "'klingon'"),
        quantize_with_text(LATIN1, ".txt", "  encoding: klingon"),
    ),
    # -- seq_len against the context length (stories260K: 512)
    "seq-len-beyond-context": Case(
        RECIPE,
        ("calibration.seq_len", "4096", "512", "allow_long_context"),
        quantize_recipe("  seq_len: 4096"),
    ),
    "seq-len-default-beyond-context": Case(
        RECIPE, ("calibration.seq_len (default)", "2048", "512"), quantize_recipe("  seed: 0")
    ),
    "seq-len-a-million": Case(
        RECIPE, ("calibration.seq_len", "1048576", "512"), quantize_recipe("  seq_len: 1048576")
    ),
    "seq-len-flag-beyond-context": Case(
        USAGE, ("--seq-len", "4096", "512"), quantize_recipe("", "", "--seq-len", "4096")
    ),
    "eval-seq-len-in-recipe-beyond-context": Case(
        RECIPE,
        ("eval.seq_len", "1024", "512"),
        quantize_recipe("", f"eval: {{text: {TINY_SAMPLE}, seq_len: 1024}}"),
    ),
    "calibrate-seq-len-beyond-context": Case(
        USAGE,
        ("--seq-len", "600", "512"),
        lambda tmp, _: (
            [
                "calibrate",
                "--model",
                STORIES,
                "--calibration",
                TINYSTORIES,
                "--num-samples",
                "1",
                "--seq-len",
                "600",
                "-o",
                tmp / "stats.safetensors",
            ],
            tmp / "stats.safetensors",
        ),
    ),
    # -- eval text
    "eval-text-latin1": Case(INPUT, ("text.txt", "not utf-8", "offset"), eval_with_text(LATIN1)),
    "eval-unknown-encoding": Case(
        USAGE, ("--encoding", "'klingon'"), eval_with_text(LATIN1, ".txt", "--encoding", "klingon")
    ),
    "eval-text-jsonl-garbled": Case(
        INPUT, ("text.jsonl:2", "invalid JSON"), eval_with_text(b'{"text": "fine"}\n{oops}\n', ".jsonl")
    ),
    "eval-text-empty": Case(INPUT, ("text.txt", "no text"), eval_with_text(b"\n \n")),
    # -- stats files
    "stats-of-another-model": Case(
        INPUT,
        ("stats.safetensors", "model.layers.0.self_attn.q_proj", "[96]", "64"),
        with_stats(lambda p: stories_stats(p, {"model.layers.0.self_attn.q_proj": 96})),
    ),
    "stats-linear-not-in-model": Case(
        INPUT,
        ("stats.safetensors", "model.layers.7.mlp.up_proj", "not a linear"),
        with_stats(lambda p: stories_stats(p, extra_linear="model.layers.7.mlp.up_proj")),
    ),
    "stats-with-nan": Case(
        INPUT,
        ("model.layers.1.mlp.down_proj.absmax", "NaN or Inf"),
        with_stats(lambda p: stories_stats(p, nan="model.layers.1.mlp.down_proj")),
    ),
    "stats-truncated": Case(
        INPUT, ("stats.safetensors", "truncated"), with_stats(lambda p: (stories_stats(p), truncate(p)))
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_fails_with_one_line(name, ckpt, tmp_path):
    case = CASES[name]
    args, output = case.build(tmp_path, ckpt)
    res = run_cli([*args, "--quiet"])  # progress lines would share stderr with the error line
    assert_one_line_error(res, case.code, *case.words, output=output)


def test_prepare_smollm2_without_gguf_says_so_in_one_line(tmp_path):
    (tmp_path / "examples").mkdir()
    script = tmp_path / "examples" / "prepare_smollm2.sh"
    shutil.copy(ROOT / "examples" / "prepare_smollm2.sh", script)
    proc = subprocess.run(
        ["bash", str(script)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "QTOOL_ASSETS": str(tmp_path / "no-assets")},
    )
    assert proc.returncode == 4, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "SmolLM2-135M-Instruct.Q4_1.gguf: not found" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert_nothing_at(tmp_path / ".cache" / "models" / "smollm2-135m")


# ---- the opt-ins: what the errors above point to must work ----------------------------------------------------


def test_allow_long_context_lets_calibration_run_past_the_context(tmp_path):
    recipe = write_recipe(
        tmp_path / "r.yaml",
        f"""
model: {STORIES}
calibration: {{source: {TINYSTORIES}, num_samples: 1, seq_len: 600, allow_long_context: true}}
stages: [{{stage: rtn, bits: 4, group_size: 32}}]
""",
    )
    out = tmp_path / "stats.safetensors"
    res = run_cli(["calibrate", recipe, "-o", out, "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["seq_len"] == 600 and out.is_file()


def test_allow_long_context_lets_eval_run_past_the_context(ckpt):
    res = run_cli(
        [
            "eval",
            ckpt,
            "--text",
            TINYSTORIES,
            "--seq-len",
            "600",
            "--windows",
            "1",
            "--allow-long-context",
            "--json",
        ]
    )
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["protocol"]["seq_len"] == 600


def test_latin1_calibration_text_reads_with_its_encoding(tmp_path):
    src = tmp_path / "cal.txt"
    src.write_bytes(LATIN1)
    out = tmp_path / "stats.safetensors"
    recipe = write_recipe(
        tmp_path / "r.yaml",
        f"""
model: {STORIES}
calibration: {{source: {src}, num_samples: 2, seq_len: 32, encoding: latin-1}}
stages: [{{stage: rtn}}]
""",
    )
    res = run_cli(["calibrate", recipe, "-o", out, "-q"])
    assert res.exit_code == 0, res.output
    from qtool.calibration.data import TextSource, read_documents

    # Decoded as latin-1, the text is the original one (not a lossy replacement).
    assert read_documents(TextSource(str(src), encoding="latin-1")) == [LATIN1.decode("latin-1")]


def test_latin1_eval_text_reads_with_encoding_flag(tmp_path):
    src = tmp_path / "text.txt"
    src.write_bytes(LATIN1)
    res = run_cli(
        [
            "eval",
            STORIES,
            "--text",
            src,
            "--seq-len",
            "32",
            "--windows",
            "2",
            "--encoding",
            "latin-1",
            "--device",
            "cpu",
            "--json",
        ]
    )
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["windows"] == 2 and out["protocol"]["encoding"] == "latin-1"


# ---- what strict loading must still accept -------------------------------------------------------------------


def _perplexity(model: Path) -> float:
    res = run_cli([*eval_args(model), "--windows", "2", "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)["perplexity"]


def test_sharded_model_and_legacy_rotary_buffers_load_as_the_original(tmp_path):
    """Shards with their index, and the per-layer `rotary_emb.inv_freq` buffers that older Llama checkpoints
    stored (transformers ignores them), are a valid model: same perplexity as the single file."""
    model = copy_model(tmp_path)
    edit_tensors(model, lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4)}))
    shard(model)
    assert _perplexity(model) == pytest.approx(_perplexity(STORIES), rel=1e-6)
