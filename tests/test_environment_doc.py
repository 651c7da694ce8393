"""docs/environment.md lists every QTOOL_* environment variable that the package, its kernels, scripts, examples and
tests read, and nothing else: a new setting is documented when it lands, a removed one leaves the table with it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "environment.md"
NAME = re.compile(r"\bQTOOL_[A-Z0-9_]*[A-Z0-9]\b")
SOURCES = ("qtool", "kernels", "scripts", "examples", "tests")
SUFFIXES = {".py", ".sh", ".cu", ".cuh"}


def _used() -> dict[str, str]:
    """Each name -> one file that mentions it."""
    found: dict[str, str] = {}
    for top in SOURCES:
        for path in sorted((ROOT / top).rglob("*")):
            if path.suffix not in SUFFIXES or path == Path(__file__).resolve() or not path.is_file():
                continue
            for name in NAME.findall(path.read_text(errors="replace")):
                found.setdefault(name, str(path.relative_to(ROOT)))
    return found


def _documented() -> set[str]:
    """The names in the first column of the page's tables."""
    return {m.group(1) for m in re.finditer(r"^\| `(QTOOL_[A-Z0-9_]+)` \|", DOC.read_text(), re.M)}


# an sdist ships neither docs/ nor scripts/
@pytest.mark.skipif(not (ROOT / "scripts").is_dir(), reason="not a checkout: no scripts/ or docs/")
def test_every_environment_variable_is_in_the_table_and_no_other():
    used, documented = _used(), _documented()
    missing = sorted(f"{name} ({where})" for name, where in used.items() if name not in documented)
    stale = sorted(documented - set(used))
    assert not missing, f"read but not in docs/environment.md: {', '.join(missing)}"
    assert not stale, f"in docs/environment.md but read nowhere: {', '.join(stale)}"
