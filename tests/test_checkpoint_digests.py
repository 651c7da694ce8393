"""Every shipped recipe writes the same tensors as the code that recorded tests/data/checkpoint_digests.json: the
packed safetensors of the checkpoint, of its compressed-tensors export and of `qtool pack`'s copy, and the logits of
the loaded checkpoint, on stories260K and a random 256-wide Llama (or the same one-line refusal). A change that
moves code must leave them equal; a change that means to alter a checkpoint records the file again with
`python scripts/checkpoint_digests.py --tensors-only --models stories260k,llama-256 --out tests/data/checkpoint_digests.json`
and says so in its commit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, STORIES

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not STORIES.is_dir(), reason="stories260K assets not found"),
]


def test_shipped_recipes_write_the_recorded_tensors(tmp_path: Path):
    recorded = json.loads((ROOT / "tests" / "data" / "checkpoint_digests.json").read_text())
    out = tmp_path / "digests.json"
    cmd = [sys.executable, str(ROOT / "scripts" / "checkpoint_digests.py"), "--tensors-only"]
    cmd += ["--models", "stories260k,llama-256", "--out", str(out), "--work", str(tmp_path / "work")]
    try:  # about 100 s on a 2-core machine; the limit only keeps a stuck run from holding the suite
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=900)
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        pytest.fail(
            f"the digests script ran past {e.timeout} s; its last lines: {err.strip().splitlines()[-3:]}"
        )
    assert done.returncode == 0, done.stderr[-2000:]
    now = json.loads(out.read_text())
    assert sorted(now) == sorted(recorded)
    written = [k for k, v in recorded.items() if "files" in v]
    assert len(written) >= 20, "most recipes should write a checkpoint on one of the two models"
    differ = [k for k in recorded if now[k] != recorded[k]]
    assert not differ, {k: (recorded[k], now[k]) for k in differ[:3]}
