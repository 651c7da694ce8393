"""The checkpoint manifest (formats/checkpoint.md): file hashes, bits per weight, provenance."""

from __future__ import annotations

import hashlib
import json
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
    return {p.name: file_sha256(p) for p in sorted(folder.iterdir()) if p.is_file() and p.name != MANIFEST_NAME}


def package_versions() -> dict[str, str]:
    import safetensors
    import torch
    import transformers

    import qtool

    return {"qtool": qtool.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "safetensors": safetensors.__version__}


def dumps(obj: dict) -> str:
    """Deterministic JSON: sorted keys, fixed indentation, trailing newline."""
    return json.dumps(obj, indent=2, sort_keys=True) + "\n"
