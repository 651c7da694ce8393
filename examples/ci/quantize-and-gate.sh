#!/usr/bin/env bash
# Quantize a model in CI and keep it only if it passes a quality gate: quantize the recipe, verify the checkpoint,
# evaluate it against the original on the recipe's own protocol, and leave everything in one artifact folder.
#
# Settings (environment):
#   RECIPE              recipe to run (required); its `eval` section is the gate's protocol (text, windows, separator)
#                       and its `model` the baseline (`qtool eval --recipe`)
#   ARTIFACT            folder to collect into (default: artifact); replaced if it holds an earlier artifact
#   MAX_PPL_INCREASE    gate on perplexity, e.g. 5% (default 5%)
#   TASKS, MAX_ACC_DROP zero-shot tasks and the gate on their accuracy, e.g. piqa,arc_easy and 1.5 (optional)
#   EVAL_TEXT, EVAL_SEQ_LEN, EVAL_WINDOWS   override the recipe's eval text, window length and window count (optional)
#   INSTALL             pip requirement to install first, e.g. '-e .' (optional; the workflow sets it)
#
# Progress goes to stderr (the job's log); each command's JSON summary goes to its file. Exit code: qtool's (README);
# 8 when the model was measured and missed its gate. The artifact folder holds checkpoint/ (tensors, config,
# tokenizer, recipe.yaml as run, qtool-manifest.json, model card), quantize.json (the run's report), pack.json (the
# verification) and eval.json (both models' results and the gate), also when the gate fails.
set -euo pipefail

: "${RECIPE:?set RECIPE to the recipe to run}"
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

gate=(--recipe "$RECIPE" --max-ppl-increase "$MAX_PPL_INCREASE")
if [ -n "${TASKS:-}" ]; then
    gate+=(--tasks "$TASKS")
    if [ -n "${MAX_ACC_DROP:-}" ]; then gate+=(--max-acc-drop "$MAX_ACC_DROP"); fi
fi
if [ -n "${EVAL_TEXT:-}" ]; then gate+=(--text "$EVAL_TEXT"); fi
if [ -n "${EVAL_SEQ_LEN:-}" ]; then gate+=(--seq-len "$EVAL_SEQ_LEN"); fi
if [ -n "${EVAL_WINDOWS:-}" ]; then gate+=(--max-windows "$EVAL_WINDOWS"); fi

status=0
qtool eval "$ARTIFACT/checkpoint" "${gate[@]}" --json > "$ARTIFACT/eval.json" || status=$?
exit "$status"
