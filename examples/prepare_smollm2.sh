#!/usr/bin/env bash
# Build the SmolLM2-135M Hugging Face folder (fp16) from the GGUF in ../shared/assets, once, into
# .cache/models/smollm2-135m (the path recipes/gptq-w4a16-g64.yaml names). Needs the dev extra (gguf).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
assets=${QTOOL_ASSETS:-$root/../shared/assets}
out=$root/.cache/models/smollm2-135m
if [ -f "$out/config.json" ]; then echo "$out exists"; exit 0; fi
mkdir -p "$(dirname "$out")"
python "$assets/tools/smollm2_gguf_to_hf.py" "$assets/models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf" "$out.tmp"
mv "$out.tmp" "$out"
