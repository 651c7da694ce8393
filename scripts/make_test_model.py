"""Write a random-weight Llama-shaped model in sharded safetensors, with a real config and a tokenizer borrowed
from the shared assets, for timing and memory runs of models larger than memory (quality is measured on real
models; random weights time the same).

    python scripts/make_test_model.py out/llama-7b-shape --shape 7b
    python scripts/make_test_model.py out/llama-70b-shape --shape 70b --layers 8     # fewer layers, same blocks
    python scripts/make_test_model.py /tmp/tiny --shape tiny

The tensors are written one shard at a time (host memory: one shard), float16, N(0, 0.02) with unit norm scales.
The tokenizer is stories260K's (a Llama sentencepiece tokenizer of 512 tokens): its ids are valid for any vocab.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parent.parent
ASSETS = Path(os.environ.get("QTOOL_ASSETS", ROOT.parent / "shared" / "assets"))
TOKENIZER_FROM = ASSETS / "models" / "stories260K"

SHAPES = {
    # Llama-2-7B
    "7b": dict(
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=32000,
        max_position_embeddings=4096,
    ),
    # Llama-2-70B (GQA with 8 KV heads)
    "70b": dict(
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=32000,
        max_position_embeddings=4096,
    ),
    # for tests: seconds to write and to quantize
    "tiny": dict(
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=512,
    ),
}


def tensor_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * d
    out = {"model.embed_tokens.weight": (v, h)}
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}"
        out.update(
            {
                f"{p}.input_layernorm.weight": (h,),
                f"{p}.post_attention_layernorm.weight": (h,),
                f"{p}.self_attn.q_proj.weight": (h, h),
                f"{p}.self_attn.k_proj.weight": (kv, h),
                f"{p}.self_attn.v_proj.weight": (kv, h),
                f"{p}.self_attn.o_proj.weight": (h, h),
                f"{p}.mlp.gate_proj.weight": (i, h),
                f"{p}.mlp.up_proj.weight": (i, h),
                f"{p}.mlp.down_proj.weight": (h, i),
            }
        )
    out["model.norm.weight"] = (h,)
    out["lm_head.weight"] = (v, h)
    return out


def make(out: Path, shape: str, layers: int | None, max_shard: int, seed: int) -> dict:
    cfg = dict(SHAPES[shape])
    if layers is not None:
        cfg["num_hidden_layers"] = layers
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **cfg,
        "head_dim": cfg["hidden_size"] // cfg["num_attention_heads"],
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float16",
    }
    shapes = tensor_shapes(cfg)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    gen = torch.Generator().manual_seed(seed)
    names = list(shapes)
    groups: list[list[str]] = [[]]
    size = 0
    for name in names:
        nbytes = 2 * torch.Size(shapes[name]).numel()
        if groups[-1] and size + nbytes > max_shard:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    weight_map, total = {}, 0
    for k, group in enumerate(groups, 1):
        fname = f"model-{k:05d}-of-{len(groups):05d}.safetensors"
        shard = {}
        for name in group:
            s = shapes[name]
            shard[name] = (torch.ones(s) if len(s) == 1 else torch.randn(s, generator=gen) * 0.02).half()
            total += 2 * shard[name].numel()
        save_file(shard, str(tmp / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(group, fname))
        print(f"wrote {fname} ({len(group)} tensors)", file=sys.stderr)
        del shard
    (tmp / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
    )
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"):
        if (TOKENIZER_FROM / f).is_file():
            shutil.copy(TOKENIZER_FROM / f, tmp / f)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return {"output": str(out), "layers": cfg["num_hidden_layers"], "bytes": total, "shards": len(groups)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("output", type=Path)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="7b")
    ap.add_argument("--layers", type=int, help="decoder blocks (default: the shape's)")
    ap.add_argument("--max-shard-size", type=float, default=5.0, help="GB per shard")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if not TOKENIZER_FROM.is_dir():
        sys.exit(
            f"make_test_model: error: {TOKENIZER_FROM}: missing; expected the shared assets (set QTOOL_ASSETS)"
        )
    print(json.dumps(make(args.output, args.shape, args.layers, int(args.max_shard_size * 1e9), args.seed)))


if __name__ == "__main__":
    main()
