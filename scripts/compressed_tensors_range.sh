#!/usr/bin/env bash
# The compressed-tensors export against the lowest and the highest compressed-tensors that pyproject.toml allows
# (0.17.0: what vLLM's CPU build pins; the newest on the index), beside the installed transformers: each version is
# put in a folder of its own (pip --target, no dependencies) ahead of the environment's, and the export tests run
# against it. Prints one line per version and exits non-zero when one fails.
#   scripts/compressed_tensors_range.sh [VERSION ...]   (default: 0.17.0 and the newest)
set -euo pipefail
cd "$(dirname "$0")/.."
versions=("$@")
if [ ${#versions[@]} -eq 0 ]; then
    newest=$(python -m pip index versions compressed-tensors 2>/dev/null | sed -n 's/^compressed-tensors (\(.*\))$/\1/p')
    versions=(0.17.0 "${newest:?cannot find the newest compressed-tensors on the index}")
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
status=0
for v in "${versions[@]}"; do
    python -m pip install -q --no-deps --target "$work/$v" "compressed-tensors==$v" 2>/dev/null
    if PYTHONPATH="$work/$v:$PWD" python -m pytest -q -p no:cacheprovider tests/test_export_compressed_tensors.py \
        -k "not smollm2" > "$work/$v.log" 2>&1; then
        echo "compressed-tensors $v: $(tail -1 "$work/$v.log")"
    else
        echo "compressed-tensors $v: FAILED"; tail -30 "$work/$v.log"; status=1
    fi
done
exit "$status"
