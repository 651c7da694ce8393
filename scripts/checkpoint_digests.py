"""The sha256 of every file each shipped recipe writes, on stories260K and small random models, plus the digest of
the loaded checkpoint's logits and of its compressed-tensors export: what a refactoring that claims to change no
output must leave equal. Run it on two trees (before and after) and compare the JSON files.

    python scripts/checkpoint_digests.py --out after.json
    python scripts/checkpoint_digests.py --tree /path/to/old/checkout --out before.json
    python scripts/checkpoint_digests.py --recipes quickstart-stories260k,quik-w4a4 --models stories260k --out x.json

Every run uses a small calibration (4 windows of 64 tokens of the TinyStories sample, seed 0) and skips the
recipes' evaluations. Numerics on the CPU depend on the vector instructions and the thread count, so the script
re-executes itself with ATen on AVX2 kernels, MKL in its AVX2 reproducible mode and one thread: two machines with
AVX2 then agree, whatever else they have.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ASSETS = Path(os.environ.get("QTOOL_ASSETS", ROOT.parent / "shared" / "assets")).resolve()
STORIES = ASSETS / "models" / "stories260K"
CALIBRATION = ASSETS / "data" / "tinystories" / "cs336_tinystories_sample.txt"
PINNED_ENV = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_CBWR": "AVX2",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "QTOOL_DIGEST_PINNED": "1",
}

# Random-weight models beside stories260K (5 blocks, hidden 64): odd widths with GQA and tied embeddings (the
# tests' tiny Llama), OPT (biases, LayerNorm), and widths that every shipped group size and vector size divide.
MODELS = {
    "tiny-llama": (
        "llama",
        dict(
            vocab_size=512,
            hidden_size=96,
            intermediate_size=200,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=2048,
            tie_word_embeddings=True,
        ),
    ),
    "tiny-opt": (
        "opt",
        dict(
            vocab_size=512,
            hidden_size=64,
            ffn_dim=160,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=2048,
            word_embed_proj_dim=64,
        ),
    ),
    "llama-256": (
        "llama",
        dict(
            vocab_size=512,
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=2048,
        ),
    ),
}


def build_models(folder: Path) -> dict[str, Path]:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, OPTConfig, OPTForCausalLM

    out = {"stories260k": STORIES}
    for name, (kind, cfg) in MODELS.items():
        path = folder / name
        if not (path / "config.json").is_file():
            model = (
                LlamaForCausalLM(LlamaConfig(**cfg)) if kind == "llama" else OPTForCausalLM(OPTConfig(**cfg))
            )
            # Drawn here rather than by the library's initialisation, which may change between its versions.
            g = torch.Generator().manual_seed(0)
            with torch.no_grad():
                for _, p in sorted(model.named_parameters()):
                    if p.dim() == 2:
                        p.copy_(torch.randn(p.shape, generator=g) * 0.05)
                    else:
                        p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            model.eval().save_pretrained(path)
            AutoTokenizer.from_pretrained(STORIES).save_pretrained(path)
        out[name] = path
    return out


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


TENSORS_ONLY = (
    False  # --tensors-only: the safetensors files alone (config.json and the manifest name versions)
)


def folder_digests(folder: Path) -> dict[str, str]:
    return {
        p.name: sha(p)
        for p in sorted(folder.iterdir())
        if p.is_file() and (not TENSORS_ONLY or p.suffix == ".safetensors")
    }


def logits_digest(checkpoint: Path) -> str:
    import torch

    import qtool

    model = qtool.load(checkpoint)
    ids = torch.arange(1, 33, dtype=torch.long)[None] % model.config.vocab_size
    with torch.no_grad():
        logits = model(ids).logits.float().contiguous()
    return hashlib.sha256(logits.numpy().tobytes()).hexdigest()


def run_one(recipe: Path, model: Path, work: Path) -> dict:
    from click.testing import CliRunner

    import qtool
    from qtool.cli import cli
    from qtool.errors import QtoolError

    out = work / "ckpt"
    shutil.rmtree(out, ignore_errors=True)
    try:
        qtool.quantize(
            recipe,
            model=str(model),
            output=str(out),
            calibration=str(CALIBRATION),
            num_samples=4,
            seq_len=64,
            seed=0,
            run_eval=False,
            overwrite=True,
        )
    except QtoolError as e:
        return {"refused": str(e).replace(str(model), "MODEL").replace(str(recipe.parent), "RECIPES")}
    record = {"files": folder_digests(out), "logits": logits_digest(out)}
    runner = CliRunner()
    for name, args in (
        ("pack", ["pack", str(out), "-o", str(work / "pack"), "--overwrite"]),
        (
            "export",
            ["export", str(out), "--format", "compressed-tensors", "-o", str(work / "export"), "--overwrite"],
        ),
    ):
        res = runner.invoke(cli, args, catch_exceptions=False)
        target = work / name
        if res.exit_code == 0:
            record[name] = folder_digests(target)
        else:
            record[name] = {
                "exit": res.exit_code,
                "error": res.output.strip().splitlines()[-1].replace(str(out), "CKPT"),
            }
        shutil.rmtree(target, ignore_errors=True)
    return record


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--tree", type=Path, default=ROOT, help="checkout whose qtool package runs (default: this one)"
    )
    ap.add_argument("--out", type=Path, required=True, help="JSON file to write")
    ap.add_argument("--recipes", help="comma-separated recipe names (default: every file in recipes/)")
    ap.add_argument("--models", help=f"comma-separated models (default: stories260k,{','.join(MODELS)})")
    ap.add_argument(
        "--tensors-only",
        action="store_true",
        help="digest only the safetensors files (the other files record package versions)",
    )
    ap.add_argument(
        "--work", type=Path, help="folder for the random models and outputs (default: a temporary one)"
    )
    args = ap.parse_args()
    if os.environ.get("QTOOL_DIGEST_PINNED") != "1":
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **PINNED_ENV})
    global TENSORS_ONLY
    TENSORS_ONLY = args.tensors_only
    tree = args.tree.resolve()
    sys.path.insert(0, str(tree))
    import torch

    torch.set_num_threads(1)
    import qtool

    assert Path(qtool.__file__).resolve().is_relative_to(tree), qtool.__file__
    # The shipped recipes: not the hidden ones that tests write beside them while they run.
    recipes = [r for r in sorted((ROOT / "recipes").glob("*.yaml")) if not r.name.startswith(".")]
    if args.recipes:
        wanted = set(args.recipes.split(","))
        recipes = [r for r in recipes if r.stem in wanted]
    work = args.work or Path(tempfile.mkdtemp(prefix="qtool-digests-"))
    models = build_models(work / "models")
    if args.models:
        models = {k: v for k, v in models.items() if k in set(args.models.split(","))}
    results: dict[str, dict] = {}
    for name, path in models.items():
        for recipe in recipes:
            key = f"{recipe.stem}@{name}"
            results[key] = run_one(recipe, path, work)
            print(key, "refused" if "refused" in results[key] else "ok", file=sys.stderr, flush=True)
    args.out.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
