"""The checkpoint manifest (formats/checkpoint.md): file hashes, bits per weight, provenance."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

FORMAT_VERSION = 1
MANIFEST_NAME = "qtool-manifest.json"
QUANT_METHOD = "qtool"


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def hash_files(folder: Path) -> dict[str, str]:
    return {
        p.name: file_sha256(p) for p in sorted(folder.iterdir()) if p.is_file() and p.name != MANIFEST_NAME
    }


def file_sizes(folder: Path) -> dict[str, int]:
    """Bytes of every file `hash_files` hashes: loading checks these (fast), `qtool pack --verify` the hashes."""
    return {
        p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file() and p.name != MANIFEST_NAME
    }


def portable(obj):
    """`obj` (a recipe as run, a manifest record, a config) with every absolute path of the machine that wrote it
    replaced by its last component: a checkpoint names its model, data and text files but not where they were, so
    the same recipe and seed give the same bytes on every machine. Contents are identified by their hashes
    (`calibration.data_sha256`, the files' sha256)."""
    if isinstance(obj, dict):
        return {k: portable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(portable(v) for v in obj)
    if isinstance(obj, str) and os.path.isabs(obj) and "\n" not in obj:
        return Path(obj).name
    return obj


# Distributions whose versions can change what a run writes: the quantizer and its numerics (torch, numpy, the
# CUDA kernels' cupy), the model classes and tokenizers, the safetensors encoding, the calibration data's reading
# (datasets) and the recorded evaluation (lm-eval). Each is recorded when installed.
_SHAPING = (
    "torch",
    "transformers",
    "tokenizers",
    "safetensors",
    "numpy",
    "accelerate",
    "datasets",
    "lm-eval",
    "cupy-cuda12x",
    "cupy-cuda13x",
)


def package_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    from qtool.version import __version__

    out = {"qtool": __version__}
    for name in _SHAPING:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            continue
    return out


def dumps(obj: dict) -> str:
    """Deterministic JSON: sorted keys, fixed indentation, trailing newline."""
    return json.dumps(obj, indent=2, sort_keys=True) + "\n"
