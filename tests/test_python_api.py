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
    assert 'output="out/stories260k-api"' in code and "model=" in code and "recipe=recipe" in code
    monkeypatch.chdir(ROOT)  # the example's paths are relative to the checkout, as in every README command
    code = code.replace('"out/stories260k-api', '"' + str(tmp_path / "api"))
    exec(compile(code, "README.md", "exec"), {})
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(str(tmp_path / "api")) and 4.0 < float(lines[0].split()[1]) < 6.0
    passed, ppl = lines[1].split()
    assert passed == "True" and 1.0 < float(ppl) < 20.0
    assert lines[2] == "pack-quantized"
    generated, piped = lines[3], lines[4]
    assert generated.startswith("Once upon a time") and len(generated) > len("Once upon a time") + 10
    assert piped == generated  # greedy: the pipeline and generate produce the same story


def test_readme_doctest_examples(tmp_path, monkeypatch):
    """The `>>>` examples of README's Python API section, in order, as doctest runs them."""
    import doctest

    import qtool

    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Python API") : text.index("## CI pipeline")]
    blocks = [b for b in re.findall(r"```python\n(.*?)```", section, re.S) if b.lstrip().startswith(">>>")]
    assert len(blocks) >= 4
    monkeypatch.chdir(ROOT)
    source = "".join(blocks).replace('"out/q', '"' + str(tmp_path / "q"))
    test = doctest.DocTestParser().get_doctest(source, {"qtool": qtool}, "README", "README.md", 0)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    runner.run(test)
    assert runner.failures == 0 and runner.tries >= 6


def test_in_memory_model_and_texts_and_a_recipe_object(tmp_path):
    """quantize takes a transformers model object, calibration texts and a qtool.Recipe (as llm-compressor's
    oneshot takes a model and a recipe), and writes what the same run from files writes."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import qtool

    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"model: {STORIES}\nstages:\n  - stage: gptq\n    bits: 4\n    group_size: 4\n"
        "calibration:\n  source: cal.txt\n  num_samples: 2\n  seq_len: 32\n"
    )
    texts = ["Once upon a time there was a cat. " * 20, "The dog ran to the park and played all day. " * 20]
    (tmp_path / "cal.txt").write_text("\n\n".join(texts))
    from_files, _ = qtool.quantize(
        qtool.load_recipe(recipe, calibration=str(tmp_path / "cal.txt")),
        output=tmp_path / "a",
        run_eval=False,
    )
    model = AutoModelForCausalLM.from_pretrained(STORIES)
    in_memory, _ = qtool.quantize(
        qtool.load_recipe(recipe),
        model=model,
        tokenizer=AutoTokenizer.from_pretrained(STORIES),
        calibration=texts,
        output=tmp_path / "b",
        run_eval=False,
    )
    assert (from_files / "model.safetensors").read_bytes() == (in_memory / "model.safetensors").read_bytes()


def test_quantize_refuses_an_unknown_override():
    import qtool
    from qtool.errors import UsageError

    with pytest.raises(UsageError, match="unknown override 'samples'"):
        qtool.quantize(ROOT / "recipes" / "quickstart-stories260k.yaml", samples=8)


def test_package_namespace_is_the_api():
    """dir(qtool) is `__all__`; qtool.evaluate and qtool.export stay callable after their submodules (the modules
    of the same names) are imported, and those modules' own names stay reachable."""
    import os
    import subprocess
    import sys

    code = (
        "import qtool, sys; print(dir(qtool) == sorted(qtool.__all__), 'torch' in sys.modules); "
        "import qtool.evaluate, qtool.export.compressed_tensors; "
        "print(callable(qtool.evaluate), callable(qtool.export), qtool.evaluate.run_eval.__name__)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=True,
    ).stdout.split()
    assert out == ["True", "False", "True", "True", "run_eval"]
    import qtool

    assert set(qtool.__all__) == {
        "Recipe",
        "__version__",
        "evaluate",
        "export",
        "load",
        "load_recipe",
        "load_tokenizer",
        "quantize",
    }
