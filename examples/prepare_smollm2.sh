#!/usr/bin/env bash
# Build the SmolLM2-135M Hugging Face folder (fp16) from the GGUF in ../shared/assets, once, into
# .cache/models/smollm2-135m (the path recipes/gptq-w4a16-g64.yaml names). Needs the dev extra (gguf).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
assets=${QTOOL_ASSETS:-$root/../shared/assets}
out=$root/.cache/models/smollm2-135m
if [ -f "$out/config.json" ]; then echo "$out exists"; exit 0; fi
gguf=$assets/models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf
convert=$assets/tools/smollm2_gguf_to_hf.py
# One line naming what is missing (exit 4, qtool's code for a missing input), not a Python traceback.
for f in "$gguf" "$convert"; do
  if [ ! -f "$f" ]; then
    echo "prepare_smollm2.sh: error: $f: not found; expected the shared assets (set QTOOL_ASSETS to their folder)" >&2
    exit 4
  fi
done
mkdir -p "$(dirname "$out")"
# A conversion killed half-way leaves its temporary folder behind: start from nothing.
rm -rf "$out.tmp"
python "$convert" "$gguf" "$out.tmp"
mv "$out.tmp" "$out"
