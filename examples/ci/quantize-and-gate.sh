#!/usr/bin/env bash
# Quantize a model in CI and keep it only if it passes a quality gate: quantize the recipe, verify the checkpoint,
# evaluate it against the original on the same protocol, and leave everything in one artifact folder.
#
# Settings (environment):
#   RECIPE              recipe to run (required)
#   ARTIFACT            folder to collect into (default: artifact); replaced if it holds an earlier artifact
#   EVAL_TEXT           perplexity text for the gate (required)
#   EVAL_SEQ_LEN        tokens per window (default 512), EVAL_WINDOWS: first N windows (default: all)
#   MAX_PPL_INCREASE    gate on perplexity, e.g. 5% (default 5%)
#   TASKS, MAX_ACC_DROP zero-shot tasks and the gate on their accuracy, e.g. piqa,arc_easy and 1.5 (optional)
#   INSTALL             pip requirement to install first, e.g. '-e .[dev]' (optional; the workflow sets it)
#
# Exit code: qtool's (README); 8 when the model was measured and missed its gate. The artifact folder holds
# checkpoint/ (tensors, config, tokenizer, recipe.yaml as run, qtool-manifest.json), quantize.json (the run's
# report), pack.json (the verification) and eval.json (both models' results and the gate), also when the gate fails.
set -euo pipefail

: "${RECIPE:?set RECIPE to the recipe to run}"
: "${EVAL_TEXT:?set EVAL_TEXT to the perplexity text of the gate}"
ARTIFACT=${ARTIFACT:-artifact}
MAX_PPL_INCREASE=${MAX_PPL_INCREASE:-5%}

if [ -n "${INSTALL:-}" ]; then
    # shellcheck disable=SC2086  # INSTALL is a list of pip arguments
    python -m pip install $INSTALL
fi

if [ -e "$ARTIFACT" ]; then
    [ -f "$ARTIFACT/quantize.json" ] || { echo "quantize-and-gate: $ARTIFACT exists and is not an artifact" >&2; exit 2; }
    rm -rf "$ARTIFACT"
fi
mkdir -p "$ARTIFACT"

qtool quantize "$RECIPE" -o "$ARTIFACT/checkpoint" --no-eval --json > "$ARTIFACT/quantize.json"
qtool pack "$ARTIFACT/checkpoint" --verify --json > "$ARTIFACT/pack.json"

# The baseline is the model the recipe ran on, as the report names it.
baseline=$(python -c 'import json, sys; print(json.load(open(sys.argv[1]))["model"])' "$ARTIFACT/quantize.json")
gate=(--max-ppl-increase "$MAX_PPL_INCREASE")
if [ -n "${TASKS:-}" ]; then
    gate+=(--tasks "$TASKS")
    if [ -n "${MAX_ACC_DROP:-}" ]; then gate+=(--max-acc-drop "$MAX_ACC_DROP"); fi
fi
windows=()
if [ -n "${EVAL_WINDOWS:-}" ]; then windows=(--windows "$EVAL_WINDOWS"); fi

status=0
qtool eval "$ARTIFACT/checkpoint" --baseline "$baseline" --text "$EVAL_TEXT" --seq-len "${EVAL_SEQ_LEN:-512}" \
    "${windows[@]}" "${gate[@]}" --json > "$ARTIFACT/eval.json" || status=$?
exit "$status"
