"""Locate the data folders shipped with qtool: `kernels/` (CUDA sources) and `formats/` (layout specs).

In an installed wheel they live inside the package (qtool/kernels, qtool/formats); in a checkout or an
editable install they are at the repository root, one level above the package.
"""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


def _data_dir(name: str) -> Path:
    for candidate in (_PACKAGE / name, _PACKAGE.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"qtool data folder '{name}' not found in {_PACKAGE} or {_PACKAGE.parent}")


def kernels_dir() -> Path:
    return _data_dir("kernels")


def formats_dir() -> Path:
    return _data_dir("formats")
