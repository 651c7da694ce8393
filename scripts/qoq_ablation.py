"""The QoQ ablation ladder (QServe Fig. 16) on a small model: each rung adds one technique to the one before, is
quantized with the block-wise pipeline and scored by WikiText-2 perplexity on the CPU reference path.

    python scripts/qoq_ablation.py MODEL_DIR [--group-size 64] [--solver rtn] [--windows 40] [--json out.json]

Protocol (stated in the output): calibration = `--num-samples` random `--seq-len`-token windows of the C4 sample,
seed 0; evaluation = the first `--windows` non-overlapping 512-token windows of the WikiText-2 test text ("\\n\\n"-
joined rows). Rungs, after the float model and W4A16 RTN for reference:
  W8A8 RTN -> W4A8 RTN -> + rotate -> + clipping -> + KV4 -> + SmoothAttention -> + progressive groups -> + reorder
  -> + output smoothing (the full QoQ); then KV4 alone and with SmoothAttention, RTN W4A8KV4 without transforms
  (per channel and grouped), the full QoQ with the GPTQ solver, and the full QoQ without rotate.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
ASSETS = Path(os.environ.get("QTOOL_ASSETS", ROOT.parent / "shared" / "assets"))


def rungs(g: int, solver: str) -> list[tuple[str, list[dict]]]:
    pc = {"stage": "progressive", "bits": 4, "group_size": None, "solver": solver}
    clip = {**pc, "clip": True}
    grouped = {**clip, "group_size": g}
    ladder = [
        (f"W4A16 g{g} RTN (reference)", [{"stage": "rtn", "bits": 4, "group_size": g, "symmetric": False}]),
        ("W8A8 RTN", [{"stage": "progressive", "bits": 8, "group_size": None, "solver": solver}]),
        ("W4A8 RTN", [pc]),
        ("+ rotate", [{"stage": "rotate"}, pc]),
        ("+ clipping", [{"stage": "rotate"}, clip]),
        ("+ KV4", [{"stage": "rotate"}, {"stage": "kv_cache", "bits": 4}, clip]),
        ("+ SmoothAttention", [{"stage": "rotate"}, {"stage": "smooth_attention"}, {"stage": "kv_cache", "bits": 4},
                               clip]),
        (f"+ progressive g{g}", [{"stage": "rotate"}, {"stage": "smooth_attention"},
                                 {"stage": "kv_cache", "bits": 4}, grouped]),
        ("+ reorder", [{"stage": "rotate"}, {"stage": "reorder"}, {"stage": "smooth_attention"},
                       {"stage": "kv_cache", "bits": 4}, grouped]),
        ("+ output smoothing (QoQ)", [{"stage": "rotate"}, {"stage": "reorder"}, {"stage": "smooth_attention"},
                                      {"stage": "smooth"}, {"stage": "kv_cache", "bits": 4}, grouped]),
        ("W4A8KV4 RTN, no transforms", [{"stage": "kv_cache", "bits": 4}, pc]),
        ("KV4 only (no weight quantization)", [{"stage": "kv_cache", "bits": 4}]),
        ("KV4 + SmoothAttention only", [{"stage": "smooth_attention"}, {"stage": "kv_cache", "bits": 4}]),
        (f"W4A8KV4 g{g} RTN, no transforms", [{"stage": "kv_cache", "bits": 4}, {**pc, "group_size": g}]),
        (f"QoQ g{g}, GPTQ solver (act_order, static groups)",
         [{"stage": "rotate"}, {"stage": "reorder"}, {"stage": "smooth_attention"}, {"stage": "smooth"},
          {"stage": "kv_cache", "bits": 4},
          {**grouped, "solver": "gptq", "clip": False, "act_order": True, "static_groups": True}]),
        (f"QoQ g{g} without rotate", [{"stage": "reorder"}, {"stage": "smooth_attention"}, {"stage": "smooth"},
                                      {"stage": "kv_cache", "bits": 4}, grouped]),
    ]
    return ladder


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--solver", default="rtn", choices=["rtn", "gptq"])
    ap.add_argument("--num-samples", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--windows", type=int, default=40)
    ap.add_argument("--device", default="cpu", help="compute device for quantization and evaluation (cpu, cuda)")
    ap.add_argument("--only", help="comma-separated rung numbers to run (0 = float model)")
    ap.add_argument("--json")
    args = ap.parse_args()

    from qtool.console import Reporter
    from qtool.eval.perplexity import perplexity
    from qtool.models.loading import load_model
    from qtool.pipeline import quantize_model
    from qtool.recipe import EvalSpec, validate_recipe

    reporter = Reporter(quiet=True)
    spec = EvalSpec(text=str(ASSETS / "data" / "wikitext2" / "wikitext-2-raw-v1.test.joined.txt"), seq_len=512,
                    max_windows=args.windows, batch_size=4)
    cal = {"source": str(ASSETS / "data" / "c4" / "c4-en-train.00000-of-01024.first1000.jsonl"),
           "num_samples": args.num_samples, "seq_len": args.seq_len, "seed": 0}
    dev = torch.device(args.device)
    only = None if args.only is None else {int(x) for x in args.only.split(",")}
    rows = []
    if only is None or 0 in only:
        model, tok, _, _ = load_model(args.model, torch.float32)
        t = time.time()
        rows.append({"rung": "FP32", "perplexity": perplexity(model.to(dev), tok, spec, dev, reporter)["perplexity"],
                     "seconds": round(time.time() - t, 1)})
        print(rows[-1], flush=True)
        del model
    for i, (name, stages) in enumerate(rungs(args.group_size, args.solver), 1):
        if only is not None and i not in only:
            continue
        t = time.time()
        recipe = validate_recipe({"model": args.model, "calibration": cal, "stages": stages,
                                  "settings": {"device": args.device}}, f"rung {i}", ROOT, {})
        qm = quantize_model(recipe, reporter)
        ppl = perplexity(qm.model.to(dev), qm.tokenizer, spec, dev, reporter)["perplexity"]
        rows.append({"rung": name, "perplexity": ppl, "seconds": round(time.time() - t, 1),
                     "stages": [s["stage"] for s in stages]})
        print(rows[-1], flush=True)
    protocol = {"calibration": cal, "eval": {"text": "wikitext-2 test joined", "seq_len": 512,
                                             "windows": args.windows}, "group_size": args.group_size,
                "solver": args.solver, "model": args.model, "device": args.device}
    print(f"\nprotocol: {json.dumps(protocol)}\n\n| rung | WikiText-2 ppl |\n|---|---|")
    for r in rows:
        print(f"| {r['rung']} | {r['perplexity']:.3f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"protocol": protocol, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
