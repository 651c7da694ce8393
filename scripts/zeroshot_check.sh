#!/usr/bin/env bash
# Zero-shot acceptance on one GPU: SmolLM2-135M float, GPTQ W4 g64, QUIK W4A4 and QUIK W8A8, the six standard
# tasks in full through the packed layers' CUDA kernels (QTOOL_KERNELS=cuda: a layer that would fall back to the
# reference is an error), wall time per model; then the first 200 PIQA items of each quantized model on cuda and on
# cpu (reference path), which must agree within 1 point.
#
#   scripts/zeroshot_check.sh SMOLLM2_DIR [OUT_DIR]
#
# SMOLLM2_DIR: the float SmolLM2-135M folder (examples/prepare_smollm2.sh; the recipes point at
# .cache/models/smollm2-135m). Task data: ../shared/assets/data/zeroshot, or set QTOOL_ZEROSHOT_DATA.
# Summary: OUT_DIR/summary.md (one table: task x metric x model, then the wall times and the cuda/cpu PIQA check);
# every run's JSON beside it.
#
# On a machine without lm-eval (and without network), install it from wheels made with
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl/rest NAME==VERSION
# (pyarrow into .whl/pyarrow: 53 MB on its own, so the two folders can travel separately). The set lm-eval 0.4.13
# and datasets need to import and to read the JSONL tasks, on top of torch, transformers, accelerate, safetensors,
# click, rich, tqdm, pyyaml, numpy, sentencepiece, tokenizers and huggingface_hub (found by running
# `qtool eval --tasks` with only those importable):
#   .whl/pyarrow: pyarrow==26.0.1
#   .whl/rest:    lm_eval==0.4.13 datasets==5.2.0 pandas==3.1.1 python-dateutil==2.9.0.post0 six==1.17.0
#                 dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0 fsspec==2026.9.0 requests==2.34.2 urllib3==2.8.0
#                 charset-normalizer==3.5.3 certifi==2026.10.19.post1
#                 sacrebleu==2.6.0 portalocker==4.4.2 tabulate==0.10.0 lxml==6.1.3
#                 (lm-eval imports sacrebleu at import time, and sacrebleu imports lxml, portalocker, tabulate; not
#                 needed: evaluate, scikit-learn, rouge-score, pytablewriter, sqlitedict, word2number, more_itertools,
#                 which lm-eval imports lazily)
# and install them with
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#     .whl/*/*.whl && export PYTHONPATH=/tmp/site
set -euo pipefail
cd "$(dirname "$0")/.."
SMOL=${1:?usage: scripts/zeroshot_check.sh SMOLLM2_DIR [OUT_DIR]}
OUT=${2:-out/zeroshot-check}
TASKS=piqa,arc_easy,arc_challenge,winogrande,hellaswag,lambada_openai
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
qtool() { python3 -m qtool.cli "$@"; }
python3 -c "import lm_eval, torch; print('lm-eval', lm_eval.__version__, 'torch', torch.__version__, torch.cuda.get_device_name())"

declare -A CKPT=([fp]="$SMOL")
for r in gptq-w4a16-g64 quik-w4a4 quik-w8a8; do
  if [ ! -f "$OUT/$r/qtool-manifest.json" ]; then
    qtool quantize "recipes/$r.yaml" --model "$SMOL" -o "$OUT/$r" --no-eval --overwrite -q
  fi
  CKPT[$r]="$OUT/$r"
done

declare -A WALL
for m in fp gptq-w4a16-g64 quik-w4a4 quik-w8a8; do
  t0=$(date +%s.%N)
  QTOOL_KERNELS=cuda qtool eval "${CKPT[$m]}" --tasks "$TASKS" --device cuda --batch-size 64 --json > "$OUT/$m.json"
  WALL[$m]=$(python3 -c "print(f'{$(date +%s.%N) - $t0:.1f}')")
  echo "$m: ${WALL[$m]} s"
done
for m in gptq-w4a16-g64 quik-w4a4 quik-w8a8; do
  QTOOL_KERNELS=cuda qtool eval "${CKPT[$m]}" --tasks piqa --limit 200 --device cuda --json > "$OUT/$m.piqa200.cuda.json"
  qtool eval "${CKPT[$m]}" --tasks piqa --limit 200 --device cpu --json > "$OUT/$m.piqa200.cpu.json"
done

python3 - "$OUT" "${WALL[fp]}" "${WALL[gptq-w4a16-g64]}" "${WALL[quik-w4a4]}" "${WALL[quik-w8a8]}" <<'PY'
import json, sys
from pathlib import Path
from qtool.eval.zeroshot import metrics
out = Path(sys.argv[1]); models = ["fp", "gptq-w4a16-g64", "quik-w4a4", "quik-w8a8"]
runs = {m: json.loads((out / f"{m}.json").read_text()) for m in models}
res = {m: metrics(r["zeroshot"]["results"]) for m, r in runs.items()}
lines = ["| task | metric | " + " | ".join(models) + " |", "|---|---|" + "---|" * len(models)]
for task, ms in res["fp"].items():
    for metric in ms:
        cells = []
        for m in models:
            v = res[m][task][metric]
            cells.append(f"{v['value']:.4f} ± {v['stderr']:.4f}" if v["stderr"] is not None else f"{v['value']:.4f}")
        lines.append(f"| {task} | {metric} | " + " | ".join(cells) + " |")
p = runs["fp"]["zeroshot"]["protocol"]
lines += ["", f"lm-eval {p['lm_eval_version']}, {p['num_fewshot']}-shot, no limit, batch {p['batch_size']}, "
              f"{p['device']}", "", "| model | runtime | wall s (load + six tasks) | tasks s |", "|---|---|---|---|"]
for m, wall in zip(models, sys.argv[2:]):
    z = runs[m]["zeroshot"]["protocol"]
    lines.append(f"| {m} | {z['runtime']} | {wall} | {z['seconds']:.1f} |")
lines += ["", "| model | PIQA acc (200, cuda) | PIQA acc (200, cpu) | diff (points) |", "|---|---|---|---|"]
for m in models[1:]:
    a = json.loads((out / f"{m}.piqa200.cuda.json").read_text())["zeroshot"]["results"]["piqa"]["acc,none"]
    b = json.loads((out / f"{m}.piqa200.cpu.json").read_text())["zeroshot"]["results"]["piqa"]["acc,none"]
    lines.append(f"| {m} | {a:.3f} | {b:.3f} | {100 * (a - b):+.1f} |")
(out / "summary.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
PY
