"""The Python API: README's example (qtool.quantize, qtool.load with generate and transformers.pipeline) runs as
written on stories260K, on CPU."""

from __future__ import annotations

import re

import pytest

from conftest import ROOT, STORIES

pytestmark = pytest.mark.skipif(not STORIES.is_dir(), reason="stories260K assets not found")


def readme_example() -> str:
    text = (ROOT / "README.md").read_text()
    m = re.search(r"<!-- example: python-api[^>]*-->\n```python\n(.*?)```", text, re.S)
    assert m, "README's python-api example block is missing"
    return m.group(1)


def test_readme_python_example_runs(tmp_path, monkeypatch, capsys):
    code = readme_example()
    assert 'output="out/stories260k-api"' in code
    monkeypatch.chdir(
        ROOT
    )  # the example's recipe path is relative to the checkout, as in every README command
    exec(compile(code.replace('"out/stories260k-api"', repr(str(tmp_path / "api"))), "README.md", "exec"), {})
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(str(tmp_path / "api")) and 4.0 < float(lines[0].split()[1]) < 6.0
    generated, piped = lines[1], lines[2]
    assert generated.startswith("Once upon a time") and len(generated) > len("Once upon a time") + 10
    assert piped == generated  # greedy: the pipeline and generate produce the same story


def test_quantize_refuses_an_unknown_override():
    import qtool
    from qtool.errors import UsageError

    with pytest.raises(UsageError, match="unknown override 'samples'"):
        qtool.quantize(ROOT / "recipes" / "quickstart-stories260k.yaml", samples=8)
