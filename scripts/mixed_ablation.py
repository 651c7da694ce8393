"""The 2/4/16 ablation (Li et al., Table 4, and the choices the paper leaves open) on a small model, each row run
through the CLI: a recipe written per row, `qtool quantize` (CPU, block onloading), then `qtool eval` of the
written checkpoint on WikiText-2; bits per weight are read from the checkpoint's manifest.

    python scripts/mixed_ablation.py [--model .cache/models/smollm2-135m] [--num-samples 32] [--windows 16]
        [--only 0,2,3] [--work out/mixed-ablation] [--json out.json]

Protocol (printed with the table): calibration = `--num-samples` random `--seq-len`-token windows of the C4
sample, seed 0; evaluation = `qtool eval --text wikitext2 --seq-len 512 --windows N` (the first N non-overlapping
512-token windows of the "\\n\\n"-joined test text). Rows (all g1 = g2 = 16, round to nearest unless said):

  intra-weight (Eq. 9 stripes) vs manual inter-layer (whole blocks at 4 bits, the rest at 2, evenly spaced) at
  25% and 10% 4-bit; the assignment's sensitivity (Eq. 9 as printed, the OBS saliency w²/[H⁻¹]_qq, random);
  0.2% outliers on/off; solver rtn vs gptq; block-wise fine-tuning of the scales; all-2-bit; GPTQ W2 g16 and
  W3 g128 (asymmetric) at their bits.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
ASSETS = Path(os.environ.get("QTOOL_ASSETS", ROOT.parent / "shared" / "assets"))
C4 = ASSETS / "data" / "c4" / "c4-en-train.00000-of-01024.first1000.jsonl"
WIKI = ASSETS / "data" / "wikitext2" / "wikitext-2-raw-v1.test.joined.txt"

MIXED = {"stage": "mixed", "group_size": 16, "scale_group_size": 16, "solver": "rtn", "outlier_fraction": 0.0}
BLOCK4 = {**MIXED, "assign": "block4", "fraction_4bit": 0.25}


def spaced(num_blocks: int, count: int) -> list[int]:
    """`count` block indices spread evenly over `num_blocks` (the middle of each of `count` equal runs)."""
    return sorted({int((i + 0.5) * num_blocks / count) for i in range(count)})


def inter_layer(num_blocks: int, count: int) -> list[dict]:
    """Whole blocks at one precision: `count` evenly spaced blocks with every stripe at 4 bits, the others at 2
    (the paper's "manual inter-layer" baseline, in the same layout and grids as the intra-weight rows)."""
    four = [f"model.layers.{i}.*" for i in spaced(num_blocks, count)]
    return [
        {**MIXED, "assign": "global", "fraction_4bit": 1.0, "targets": {"include": four}},
        {**MIXED, "assign": "global", "fraction_4bit": 0.0, "targets": {"exclude": four}},
    ]


def rows(num_blocks: int, finetune_steps: int) -> list[tuple[str, list[dict]]]:
    n25 = round(0.25 * num_blocks + 0.01)  # halves up: the inter-layer rows never get fewer 4-bit weights
    n10 = round(0.10 * num_blocks + 0.01)
    paper = {**BLOCK4, "outlier_fraction": 0.002}
    # In order of what the comparison needs first (a cut run with --only keeps the head of the list).
    return [
        ("intra-weight 25% 4-bit (block4, Eq. 9)", [BLOCK4]),
        (f"manual inter-layer, {n25}/{num_blocks} blocks 4-bit", inter_layer(num_blocks, n25)),
        ("intra-weight 10% 4-bit (global, Eq. 9)", [{**MIXED, "assign": "global", "fraction_4bit": 0.1}]),
        (f"manual inter-layer, {n10}/{num_blocks} blocks 4-bit", inter_layer(num_blocks, n10)),
        ("2/4/16: 25% block4 + 0.2% outliers (paper default)", [paper]),
        ("GPTQ W2 g16 (asymmetric)", [{"stage": "gptq", "bits": 2, "group_size": 16, "symmetric": False}]),
        ("GPTQ W3 g128 (asymmetric)", [{"stage": "gptq", "bits": 3, "group_size": 128, "symmetric": False}]),
        ("2/4/16 + 0.2% + block-wise fine-tuning", [{**paper, "finetune_steps": finetune_steps}]),
        ("2/4/16 + 0.2%, solver gptq", [{**paper, "solver": "gptq"}]),
        ("intra-weight 25% (block4, random stripes)", [{**BLOCK4, "sensitivity": "random"}]),
        ("intra-weight 25% (block4, OBS saliency)", [{**BLOCK4, "sensitivity": "obs"}]),
        ("intra-weight 25% (global, Eq. 9)", [{**MIXED, "assign": "global", "fraction_4bit": 0.25}]),
        ("all 2-bit (0% 4-bit)", [{**MIXED, "assign": "global", "fraction_4bit": 0.0}]),
        (
            "2/4/16 + 0.2%, gptq + block-wise fine-tuning",
            [{**paper, "solver": "gptq", "finetune_steps": finetune_steps}],
        ),
    ]


def qtool(*args: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "qtool.cli", *args, "--json", "--quiet"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if done.returncode:
        raise SystemExit(
            f"qtool {' '.join(args)} failed ({done.returncode}): {done.stdout[-2000:]}{done.stderr[-2000:]}"
        )
    return json.loads(done.stdout)


def perplexity(summary: dict) -> float:
    """The WikiText-2 perplexity in a `qtool eval --json` summary."""
    found = []

    def walk(o):
        if isinstance(o, dict):
            for k, v in o.items():
                if k == "perplexity" and isinstance(v, (int, float)):
                    found.append(float(v))
                else:
                    walk(v)
        elif isinstance(o, list):
            for v in o:
                walk(v)

    walk(summary)
    if not found:
        raise SystemExit(f"no perplexity in qtool eval's summary: {json.dumps(summary)[:500]}")
    return found[0]


def evaluate(model: str, windows: int, device: str = "cpu") -> float:
    return perplexity(
        qtool(
            "eval",
            model,
            "--text",
            str(WIKI),
            "--seq-len",
            "512",
            "--windows",
            str(windows),
            "--device",
            device,
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(ROOT / ".cache" / "models" / "smollm2-135m"))
    ap.add_argument("--num-samples", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument(
        "--finetune-steps",
        type=int,
        default=32,
        help="steps per block of the fine-tuning rows (one calibration window per step)",
    )
    ap.add_argument("--only", help="comma-separated row numbers, run in that order (0 = the float model)")
    ap.add_argument("--work", default=str(ROOT / "out" / "mixed-ablation"))
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints")
    ap.add_argument("--json")
    args = ap.parse_args()

    config = json.loads((Path(args.model) / "config.json").read_text())
    num_blocks = int(config["num_hidden_layers"])
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    cal = {"source": str(C4), "num_samples": args.num_samples, "seq_len": args.seq_len, "seed": 0}
    only = None if args.only is None else [int(x) for x in args.only.split(",")]
    results = []
    if only is None or 0 in only:
        t = time.time()
        results.append(
            {
                "row": 0,
                "name": "float",
                "ppl": evaluate(args.model, args.windows),
                "seconds": round(time.time() - t, 1),
            }
        )
        print(json.dumps(results[-1]), flush=True)
    table = list(enumerate(rows(num_blocks, args.finetune_steps), 1))
    for i, (name, stages) in table if only is None else [table[i - 1] for i in only if i > 0]:
        recipe = {
            "model": str(Path(args.model).resolve()),
            "calibration": cal,
            "stages": stages,
            "settings": {"device": "cpu"},
            "output": str((work / f"row{i}").resolve()),
        }
        path = work / f"row{i}.yaml"
        path.write_text(yaml.safe_dump(recipe, sort_keys=False))
        t = time.time()
        summary = qtool("quantize", str(path), "--overwrite", "--no-eval")
        seconds = time.time() - t
        bpw = summary["bits_per_weight"]
        ppl = evaluate(recipe["output"], args.windows)
        results.append(
            {
                "row": i,
                "name": name,
                "ppl": ppl,
                "stored": bpw["quantized_linears"],
                "eq10": (bpw.get("reported_layers") or {}).get("eq10"),
                "quantize_s": round(seconds, 1),
                "stages": stages,
            }
        )
        print(json.dumps({k: v for k, v in results[-1].items() if k != "stages"}), flush=True)
        if not args.keep:
            subprocess.run(["rm", "-rf", recipe["output"]], check=True)
    protocol = (
        f"{Path(args.model).name}; calibration {args.num_samples} x {args.seq_len} tokens of C4 (seed 0); "
        f"`qtool eval --text wikitext2 --seq-len 512 --windows {args.windows}`; fine-tuning rows "
        f"{args.finetune_steps} Adam steps per block, one window per step, lr 0.005; CPU reference path"
    )
    print(
        f"\nProtocol: {protocol}\n\n| # | configuration | bits (Eq. 10) | bits (stored) | WikiText-2 ppl |\n"
        f"|---|---|---|---|---|"
    )
    for r in results:
        eq10 = "16" if r["row"] == 0 else (f"{r['eq10']:.3f}" if r.get("eq10") is not None else "-")
        stored = "16" if r["row"] == 0 else f"{r['stored']:.3f}"
        print(f"| {r['row']} | {r['name']} | {eq10} | {stored} | {r['ppl']:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"protocol": protocol, "rows": results}, indent=2))


if __name__ == "__main__":
    main()
