"""Vector vs scalar quantization at equal bits on a small model (issue 32's acceptance), each row run through the
CLI: a recipe written per row, `qtool quantize` (block onloading, on `--device`), then `qtool eval` of the written
checkpoint on WikiText-2; bits per weight as stored are read from the checkpoint's manifest.

    python scripts/vq_ablation.py [--model .cache/models/smollm2-135m] [--num-samples 16] [--windows 16]
        [--finetune-steps 16] [--blocks N] [--only 0,1,2] [--device cpu] [--work out/vq-ablation] [--json out.json]

Rows: GPTVQ-2 against GPTQ W2 with the group size whose scale/zero overhead matches GPTVQ-2's codebook overhead on
this model (g64: 24/64 = 0.375 bits against 0.36); the model-sized AQLM-style 3-bit configuration (vectors of 4,
two additive 64-entry codebooks per tensor, beam search; formats/vq.md says why) against GPTQ W3 g128; each VQ row
again with codebook fine-tuning against the block output (`finetune_steps`). Protocol as scripts/mixed_ablation.py:
calibration `--num-samples` random `--seq-len`-token windows of the C4 sample, seed 0; evaluation `qtool eval
--text wikitext2 --seq-len 512 --windows N`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

import yaml
from mixed_ablation import ASSETS, evaluate, qtool  # this folder's sibling: the same CLI calls, data, reading

ROOT = Path(__file__).resolve().parent.parent
C4 = ASSETS / "data" / "c4" / "c4-en-train.00000-of-01024.first1000.jsonl"

GPTVQ2 = {"stage": "vq", "preset": "gptvq-2", "kmeans_iters": 20, "beam": 1, "seed": 0}
AQLM3S = {
    "stage": "vq",
    "preset": "aqlm-3",
    "vector_size": 4,
    "entries": 64,
    "residuals": 2,
    "kmeans_iters": 20,
    "beam": 8,
    "seed": 0,
}


def rows(finetune_steps: int, finetune_lr: float) -> list[tuple[str, list[dict]]]:
    ft = {"finetune_steps": finetune_steps, "finetune_lr": finetune_lr}
    return [
        ("GPTVQ-2 (VQ<4,8,1>, 256x256 tiles)", [GPTVQ2]),
        ("GPTQ W2 g64 (asymmetric)", [{"stage": "gptq", "bits": 2, "group_size": 64, "symmetric": False}]),
        ("AQLM-style 3-bit (VQ<4,6,2>, per tensor, beam 8)", [AQLM3S]),
        ("GPTQ W3 g128 (asymmetric)", [{"stage": "gptq", "bits": 3, "group_size": 128, "symmetric": False}]),
        ("GPTVQ-2 + codebook fine-tuning", [{**GPTVQ2, **ft}]),
        ("AQLM-style 3-bit + codebook fine-tuning", [{**AQLM3S, **ft}]),
    ]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(ROOT / ".cache" / "models" / "smollm2-135m"))
    ap.add_argument("--num-samples", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument(
        "--finetune-steps", type=int, default=16, help="Adam steps per block of the fine-tuning rows"
    )
    ap.add_argument(
        "--finetune-lr",
        type=float,
        default=0.02,
        help="Adam learning rate of the fine-tuning rows (relative to each layer's codebook RMS)",
    )
    ap.add_argument(
        "--blocks",
        type=int,
        help="quantize only the linears of the first N decoder blocks (every "
        "row alike; the rest stay float), for a shorter run",
    )
    ap.add_argument("--only", help="comma-separated row numbers, run in that order (0 = the float model)")
    ap.add_argument("--work", default=str(ROOT / "out" / "vq-ablation"))
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints")
    ap.add_argument("--device", default="cpu", help="where every row quantizes and evaluates")
    ap.add_argument("--json")
    args = ap.parse_args()

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
                "ppl": evaluate(args.model, args.windows, args.device),
                "seconds": round(time.time() - t, 1),
            }
        )
        print(json.dumps(results[-1]), flush=True)
    table = list(enumerate(rows(args.finetune_steps, args.finetune_lr), 1))
    for i, (name, stages) in table if only is None else [table[i - 1] for i in only if i > 0]:
        if args.blocks is not None:
            scope = {"include": [f"model.layers.{b}.*" for b in range(args.blocks)]}
            stages = [{**st, "targets": scope} for st in stages]
        recipe = {
            "model": str(Path(args.model).resolve()),
            "calibration": cal,
            "stages": stages,
            "settings": {"device": args.device},
            "output": str((work / f"row{i}").resolve()),
        }
        path = work / f"row{i}.yaml"
        path.write_text(yaml.safe_dump(recipe, sort_keys=False))
        t = time.time()
        summary = qtool("quantize", str(path), "--overwrite", "--no-eval")
        seconds = time.time() - t
        ppl = evaluate(recipe["output"], args.windows, args.device)
        manifest = json.loads((Path(recipe["output"]) / "qtool-manifest.json").read_text())
        results.append(
            {
                "row": i,
                "name": name,
                "ppl": ppl,
                "stored": summary["bits_per_weight"]["quantized_linears"],
                "quantize_s": round(seconds, 1),
                "stages": stages,
                "finetune": [t["finetune"] for t in manifest.get("transforms", []) if "finetune" in t],
            }
        )
        print(
            json.dumps({k: v for k, v in results[-1].items() if k not in ("stages", "finetune")}), flush=True
        )
        if not args.keep:
            subprocess.run(["rm", "-rf", recipe["output"]], check=True)
    scope = "" if args.blocks is None else f"; only the linears of blocks 0-{args.blocks - 1} quantized"
    protocol = (
        f"{Path(args.model).name}{scope}; calibration {args.num_samples} x {args.seq_len} tokens of C4 (seed 0); "
        f"`qtool eval --text wikitext2 --seq-len 512 --windows {args.windows}`; fine-tuning rows "
        f"{args.finetune_steps} Adam steps per block, one window per step, lr {args.finetune_lr}; "
        f"device {args.device}"
    )
    print(
        f"\nProtocol: {protocol}\n\n| # | configuration | bits (stored) | WikiText-2 ppl |\n|---|---|---|---|"
    )
    for r in results:
        stored = "16" if r["row"] == 0 else f"{r['stored']:.3f}"
        print(f"| {r['row']} | {r['name']} | {stored} | {r['ppl']:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"protocol": protocol, "rows": results}, indent=2))


if __name__ == "__main__":
    main()
