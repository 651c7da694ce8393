#!/usr/bin/env bash
# One command for the qoq W4A8 kernels on a Hopper GPU: their GPU tests, the quik GPU tests (both GEMMs instantiate
# kernels/common/int8_wgmma.cuh), then the kernel bench on Llama-2-7B shapes at M = 1..8192 with the W4A8 rows
# (per-channel and g128, activation quantization included; GEMM alone as the alternative) beside W4A16 g128, cuBLAS
# FP16, INT8 _int_mm and FP8 _scaled_mm. Full logs go to the output folder; a short summary is printed last.
#
#   scripts/qoq_gpu_check.sh [OUTPUT_DIR]        (default: $TMPDIR/qtool-qoq-check; PYTHON=... picks the interpreter)
set -u -o pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT_DIR="${1:-${TMPDIR:-/tmp}/qtool-qoq-check}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT_DIR" && OUT_DIR="$(cd "$OUT_DIR" && pwd)" || exit 2
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
cd "$ROOT" || exit 2

"$PY" -m pytest tests/gpu/test_qoq_kernels.py tests/test_qoq_kernel_layout.py -q -rfE -p no:cacheprovider \
    --maxfail=20 >"$OUT_DIR/qoq-tests.log" 2>&1
qoq_rc=$?

"$PY" -m pytest tests/gpu/test_quik_kernels.py tests/gpu/test_quik_fused_quantize.py -q -rfE -p no:cacheprovider \
    --maxfail=20 >"$OUT_DIR/quik-tests.log" 2>&1
quik_rc=$?

"$PY" -m qtool.bench.command kernels --model-config llama-2-7b --m 1,16,32,64,128,256,512,1024,2048,4096,8192 \
    --bits 4 --group-size 128 --w4a8 ch,128 --json-out "$OUT_DIR/kernels.json" --plot "$OUT_DIR/kernels.png" \
    >"$OUT_DIR/kernels.txt" 2>"$OUT_DIR/kernels.log"
bench_rc=$?

echo
echo "================================ qoq GPU check summary ================================"
echo "qoq tests (rc=$qoq_rc): $(grep -E '(passed|failed|error)' "$OUT_DIR/qoq-tests.log" | tail -1)"
grep -E '^(FAILED|ERROR)' "$OUT_DIR/qoq-tests.log" | head -10
echo "quik tests (rc=$quik_rc): $(grep -E '(passed|failed|error)' "$OUT_DIR/quik-tests.log" | tail -1)"
grep -E '^(FAILED|ERROR)' "$OUT_DIR/quik-tests.log" | head -10
echo "--- bench kernels (rc=$bench_rc): W4A16 g128 ('gemv'/'mma'/...) and W4A8 ('w4a8': quantize + GEMM) rows ---"
if [ "$bench_rc" -eq 0 ]; then
    head -4 "$OUT_DIR/kernels.txt"
    grep -E '^ *[0-9]+x' "$OUT_DIR/kernels.txt"
else
    tail -5 "$OUT_DIR/kernels.log"
fi
status=PASS
[ "$qoq_rc" -ne 0 ] || [ "$quik_rc" -ne 0 ] || [ "$bench_rc" -ne 0 ] && status=FAIL
echo "overall: $status  (logs and JSON in $OUT_DIR)"
[ "$status" = PASS ]
