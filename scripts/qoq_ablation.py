"""The QoQ ablation ladder (QServe Fig. 16) on a small model: each rung adds one technique to the one before, is
quantized with the block-wise pipeline and scored by WikiText-2 perplexity on the CPU reference path.

    python scripts/qoq_ablation.py MODEL_DIR [--group-size 64] [--solver rtn] [--windows 40] [--json out.json]

Protocol (stated in the output): calibration = `--num-samples` random `--seq-len`-token windows of the C4 sample,
seed 0; evaluation = the first `--windows` non-overlapping 512-token windows of the WikiText-2 test text ("\\n\\n"-
joined rows). Rungs, after the float model and W4A16 RTN for reference:
  W8A8 RTN -> W4A8 RTN -> + rotate -> + clipping -> + KV4 -> + SmoothAttention -> + progressive groups -> + reorder
  -> + output smoothing (the full QoQ); then KV4 alone and with SmoothAttention, RTN W4A8KV4 without transforms
  (per channel and grouped), the full QoQ with the GPTQ solver, and the full QoQ without rotate.

`--rows quality` runs instead what bounds the full QoQ on a model (formats/qoq.md, "What bounds QoQ"): the best
weight-only 4-bit (RTN and GPTQ, with and without rotate, at the group size and at half of it), the full QoQ with
GPTQ at more calibration, with the clipping search, at half the group size, and with its parts taken away (no KV4;
weights only, activations in float), the QoQ transforms with W8A8KV4 (the floor set by activations and cache),
and the per-channel QoQ of recipes/qoq-w4a8kv4-chn.yaml with and without the clipping search. "weights only" rows replace each quantized linear by a float one holding its dequantized weight.
`--only` numbers the rows of the list chosen; `--json` is rewritten after every row.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from torch import nn

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
        (
            "+ SmoothAttention",
            [{"stage": "rotate"}, {"stage": "smooth_attention"}, {"stage": "kv_cache", "bits": 4}, clip],
        ),
        (
            f"+ progressive g{g}",
            [{"stage": "rotate"}, {"stage": "smooth_attention"}, {"stage": "kv_cache", "bits": 4}, grouped],
        ),
        (
            "+ reorder",
            [
                {"stage": "rotate"},
                {"stage": "reorder"},
                {"stage": "smooth_attention"},
                {"stage": "kv_cache", "bits": 4},
                grouped,
            ],
        ),
        (
            "+ output smoothing (QoQ)",
            [
                {"stage": "rotate"},
                {"stage": "reorder"},
                {"stage": "smooth_attention"},
                {"stage": "smooth"},
                {"stage": "kv_cache", "bits": 4},
                grouped,
            ],
        ),
        ("W4A8KV4 RTN, no transforms", [{"stage": "kv_cache", "bits": 4}, pc]),
        ("KV4 only (no weight quantization)", [{"stage": "kv_cache", "bits": 4}]),
        ("KV4 + SmoothAttention only", [{"stage": "smooth_attention"}, {"stage": "kv_cache", "bits": 4}]),
        (f"W4A8KV4 g{g} RTN, no transforms", [{"stage": "kv_cache", "bits": 4}, {**pc, "group_size": g}]),
        (
            f"QoQ g{g}, GPTQ solver (act_order, static groups)",
            [
                {"stage": "rotate"},
                {"stage": "reorder"},
                {"stage": "smooth_attention"},
                {"stage": "smooth"},
                {"stage": "kv_cache", "bits": 4},
                {**grouped, "solver": "gptq", "clip": False, "act_order": True, "static_groups": True},
            ],
        ),
        (
            f"QoQ g{g} without rotate",
            [
                {"stage": "reorder"},
                {"stage": "smooth_attention"},
                {"stage": "smooth"},
                {"stage": "kv_cache", "bits": 4},
                grouped,
            ],
        ),
    ]
    return ladder


QOQ_TRANSFORMS = [
    {"stage": "rotate"},
    {"stage": "reorder"},
    {"stage": "smooth_attention"},
    {"stage": "smooth"},
]
KV4 = {"stage": "kv_cache", "bits": 4}


def quality_rows(g: int) -> list[tuple[str, list[dict], dict]]:
    """(name, stages, extras): extras may set `calibration` (num_samples, seq_len) and `weights_only`."""
    h = g // 2
    gptq_w4 = {"stage": "gptq", "bits": 4, "symmetric": False, "act_order": True, "static_groups": True}
    qoq = {"stage": "progressive", "bits": 4, "solver": "gptq", "act_order": True, "static_groups": True}
    big = {"num_samples": 128, "seq_len": 1024}
    return [
        (f"W4A16 g{g} RTN", [{"stage": "rtn", "bits": 4, "group_size": g, "symmetric": False}], {}),
        (f"W4A16 g{g} GPTQ", [{**gptq_w4, "group_size": g}], {}),
        (f"rotate + W4A16 g{g} GPTQ", [{"stage": "rotate"}, {**gptq_w4, "group_size": g}], {}),
        (f"W4A16 g{h} RTN", [{"stage": "rtn", "bits": 4, "group_size": h, "symmetric": False}], {}),
        (f"W4A16 g{h} GPTQ", [{**gptq_w4, "group_size": h}], {}),
        (f"QoQ g{g} GPTQ", [*QOQ_TRANSFORMS, KV4, {**qoq, "group_size": g}], {}),
        (
            f"QoQ g{g} GPTQ, calibration 64 x 512",
            [*QOQ_TRANSFORMS, KV4, {**qoq, "group_size": g}],
            {"calibration": {"num_samples": 64, "seq_len": 512}},
        ),
        (
            f"QoQ g{g} GPTQ, calibration 128 x 1024",
            [*QOQ_TRANSFORMS, KV4, {**qoq, "group_size": g}],
            {"calibration": big},
        ),
        (f"QoQ g{g} GPTQ + clip", [*QOQ_TRANSFORMS, KV4, {**qoq, "group_size": g, "clip": True}], {}),
        (f"QoQ g{g} GPTQ without KV4 (W4A8)", [*QOQ_TRANSFORMS, {**qoq, "group_size": g}], {}),
        (
            f"QoQ g{g} GPTQ weights only (W4A16, no KV4)",
            [*QOQ_TRANSFORMS, {**qoq, "group_size": g}],
            {"weights_only": True},
        ),
        (f"QoQ g{h} GPTQ", [*QOQ_TRANSFORMS, KV4, {**qoq, "group_size": h}], {}),
        (
            f"QoQ g{h} GPTQ weights only (W4A16, no KV4)",
            [*QOQ_TRANSFORMS, {**qoq, "group_size": h}],
            {"weights_only": True},
        ),
        (
            "QoQ transforms + W8A8KV4",
            [*QOQ_TRANSFORMS, KV4, {"stage": "progressive", "bits": 8, "group_size": None}],
            {},
        ),
        ("KV4 + SmoothAttention only", [{"stage": "smooth_attention"}, KV4], {}),
        (
            f"QoQ g{g} GPTQ + clip, calibration 128 x 1024",
            [*QOQ_TRANSFORMS, KV4, {**qoq, "group_size": g, "clip": True}],
            {"calibration": big},
        ),
        (
            "QoQ per channel GPTQ, calibration 64 x 512",
            [*QOQ_TRANSFORMS, KV4, {**qoq, "group_size": None}],
            {"calibration": {"num_samples": 64, "seq_len": 512}},
        ),
        (
            "QoQ per channel GPTQ + clip, calibration 64 x 512",
            [*QOQ_TRANSFORMS, KV4, {**qoq, "group_size": None, "clip": True}],
            {"calibration": {"num_samples": 64, "seq_len": 512}},
        ),
        ("QoQ per channel GPTQ", [*QOQ_TRANSFORMS, KV4, {**qoq, "group_size": None}], {}),
        (
            "QoQ per channel GPTQ + clip",
            [*QOQ_TRANSFORMS, KV4, {**qoq, "group_size": None, "clip": True}],
            {},
        ),
    ]


def float_weights(model: nn.Module) -> int:
    """Replace every QoQ linear of `model` by a float linear with its dequantized weight (activations stay float);
    returns how many were replaced."""
    from qtool.layouts.qoq.module import QoQLinear

    swaps = [(name, m) for name, m in model.named_modules() if isinstance(m, QoQLinear)]
    for name, m in swaps:
        parent_name, _, attr = name.rpartition(".")
        lin = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, device=m.qweight.device)
        lin.weight.data = m.dequantize(torch.float32).to(m.qweight.device)
        if m.bias is not None:
            lin.bias.data = m.bias.data.float()
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, lin)
    return len(swaps)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--solver", default="rtn", choices=["rtn", "gptq"])
    ap.add_argument("--num-samples", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--windows", type=int, default=40)
    ap.add_argument(
        "--device", default="cpu", help="compute device for quantization and evaluation (cpu, cuda)"
    )
    ap.add_argument(
        "--rows",
        default="ladder",
        choices=["ladder", "quality"],
        help="the ablation ladder, or what bounds the full QoQ (see the module docstring)",
    )
    ap.add_argument("--only", help="comma-separated row numbers to run (0 = float model)")
    ap.add_argument("--json")
    args = ap.parse_args()

    from qtool.console import Reporter
    from qtool.eval.perplexity import perplexity
    from qtool.models.loading import load_model
    from qtool.pipeline import quantize_model
    from qtool.recipe import EvalSpec, validate_recipe

    reporter = Reporter(quiet=True)
    spec = EvalSpec(
        text=str(ASSETS / "data" / "wikitext2" / "wikitext-2-raw-v1.test.joined.txt"),
        seq_len=512,
        max_windows=args.windows,
        batch_size=4,
    )
    cal = {
        "source": str(ASSETS / "data" / "c4" / "c4-en-train.00000-of-01024.first1000.jsonl"),
        "num_samples": args.num_samples,
        "seq_len": args.seq_len,
        "seed": 0,
    }
    dev = torch.device(args.device)
    only = None if args.only is None else {int(x) for x in args.only.split(",")}
    rows = []
    protocol = {
        "calibration": cal,
        "eval": {"text": "wikitext-2 test joined", "seq_len": 512, "windows": args.windows},
        "group_size": args.group_size,
        "solver": args.solver,
        "model": args.model,
        "device": args.device,
        "rows": args.rows,
    }

    def record(row: dict) -> None:
        rows.append(row)
        print(row, flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps({"protocol": protocol, "rows": rows}, indent=2))

    if only is None or 0 in only:
        model, tok, _, _ = load_model(args.model, torch.float32)
        t = time.time()
        record(
            {
                "rung": "FP32",
                "perplexity": perplexity(model.to(dev), tok, spec, dev, reporter)["perplexity"],
                "seconds": round(time.time() - t, 1),
            }
        )
        del model
    if args.rows == "ladder":
        chosen = [(name, stages, {}) for name, stages in rungs(args.group_size, args.solver)]
    else:
        chosen = quality_rows(args.group_size)
    for i, (name, stages, extras) in enumerate(chosen, 1):
        if only is not None and i not in only:
            continue
        t = time.time()
        row_cal = {**cal, **extras.get("calibration", {})}
        recipe = validate_recipe(
            {
                "model": args.model,
                "calibration": row_cal,
                "stages": stages,
                "settings": {"device": args.device},
            },
            f"row {i}",
            ROOT,
            {},
        )
        qm = quantize_model(recipe, reporter)
        if extras.get("weights_only") and not float_weights(qm.model):
            raise SystemExit(f"row {i} ({name}): no QoQ linear to replace by its float weight")
        ppl = perplexity(qm.model.to(dev), qm.tokenizer, spec, dev, reporter)["perplexity"]
        record(
            {
                "row": i,
                "rung": name,
                "perplexity": ppl,
                "seconds": round(time.time() - t, 1),
                "stages": [s["stage"] for s in stages],
                **extras,
            }
        )
    print(f"\nprotocol: {json.dumps(protocol)}\n\n| rung | WikiText-2 ppl |\n|---|---|")
    for r in rows:
        print(f"| {r['rung']} | {r['perplexity']:.3f} |")


if __name__ == "__main__":
    main()
