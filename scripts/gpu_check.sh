#!/usr/bin/env bash
# One command for the GPU check: every GPU test (the stories260K checkpoint perplexity test included: it needs the
# assets under $QTOOL_ASSETS, default ../shared/assets beside the checkout), the standard kernel bench (Llama-2-7B
# shapes, W4 and W8 g128, M = 1, 16, 32, 64, 128, 256, 2048), the end-to-end bench and the QUIK bench (fusion ladder,
# outlier sweep, W8A8, at M = 2048), each with its PNG; full logs, JSON reports and pictures go to the output folder,
# a short summary is printed last.
#
#   scripts/gpu_check.sh [OUTPUT_DIR]        (default: $TMPDIR/qtool-gpu-check; PYTHON=... picks the interpreter)
set -u -o pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT_DIR="${1:-${TMPDIR:-/tmp}/qtool-gpu-check}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT_DIR" && OUT_DIR="$(cd "$OUT_DIR" && pwd)" || exit 2
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
cd "$ROOT" || exit 2

# -s keeps the tests' printed measurements (CPU vs GPU perplexity) in the log for the summary.
"$PY" -m pytest tests/gpu -q -s -rfE -p no:cacheprovider --maxfail=20 \
    >"$OUT_DIR/gpu-tests.log" 2>&1
tests_rc=$?

"$PY" -m qtool.bench.command kernels --model-config llama-2-7b --m 1,16,32,64,128,256,2048 --bits 4,8 --group-size 128 \
    --json-out "$OUT_DIR/kernels.json" --plot "$OUT_DIR/kernels.png" >"$OUT_DIR/kernels.txt" 2>"$OUT_DIR/kernels.log"
kernels_rc=$?

"$PY" -m qtool.bench.command e2e --model-config llama-2-7b --bits 4 --group-size 128 \
    --json-out "$OUT_DIR/e2e.json" --plot "$OUT_DIR/e2e.png" >"$OUT_DIR/e2e.txt" 2>"$OUT_DIR/e2e.log"
e2e_rc=$?

"$PY" -m qtool.bench.command quik --model-config llama-2-7b --m 2048 --json-out "$OUT_DIR/quik.json" \
    --plot "$OUT_DIR/quik.png" >"$OUT_DIR/quik.txt" 2>"$OUT_DIR/quik.log"
quik_rc=$?

echo
echo "================================ GPU check summary ================================"
echo "GPU tests (rc=$tests_rc): $(grep -E '(passed|failed|error)' "$OUT_DIR/gpu-tests.log" | tail -1)"
grep -E '^(FAILED|ERROR)' "$OUT_DIR/gpu-tests.log" | head -10
grep -E '^(perplexity cpu|decode batch)' "$OUT_DIR/gpu-tests.log" | head -6
echo "--- bench kernels (rc=$kernels_rc) ---"
if [ "$kernels_rc" -eq 0 ]; then cat "$OUT_DIR/kernels.txt"; else tail -5 "$OUT_DIR/kernels.log"; fi
echo "--- bench e2e (rc=$e2e_rc) ---"
if [ "$e2e_rc" -eq 0 ]; then cat "$OUT_DIR/e2e.txt"; else tail -5 "$OUT_DIR/e2e.log"; fi
echo "--- bench quik (rc=$quik_rc) ---"
if [ "$quik_rc" -eq 0 ]; then cat "$OUT_DIR/quik.txt"; else tail -5 "$OUT_DIR/quik.log"; fi
status=PASS
[ "$tests_rc" -ne 0 ] || [ "$kernels_rc" -ne 0 ] || [ "$e2e_rc" -ne 0 ] || [ "$quik_rc" -ne 0 ] && status=FAIL
echo "overall: $status  (logs and JSON in $OUT_DIR)"
[ "$status" = PASS ]
