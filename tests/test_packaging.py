"""kernels/ and formats/ ship inside the wheel and are found from it; README and CI run the same commands."""

from __future__ import annotations

import subprocess
import sys
import zipfile

import pytest

from conftest import ROOT


def test_data_folders_found_from_checkout():
    from qtool.resources import formats_dir, kernels_dir

    assert (formats_dir() / "grouped-int.md").is_file()
    assert kernels_dir().is_dir()


@pytest.mark.slow
def test_wheel_contains_kernels_and_formats(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(ROOT),
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            "-q",
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("qtool-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "qtool/formats/grouped-int.md" in names and "qtool/formats/checkpoint.md" in names
    assert any(n.startswith("qtool/kernels/") and n.endswith(".cu") for n in names)
    assert "qtool/kernels/common/ptx_common.cuh" in names  # the shared header the sources include
    # Installed elsewhere, the package finds its data inside itself.
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    out = subprocess.run(
        [sys.executable, "-c", "import qtool.resources as r; print(r.formats_dir(), r.kernels_dir())"],
        cwd=tmp_path,
        env={"PYTHONPATH": str(site)},
        check=True,
        capture_output=True,
        text=True,
    )
    assert str(site / "qtool" / "formats") in out.stdout and str(site / "qtool" / "kernels") in out.stdout


def test_every_included_kernel_header_is_handed_to_nvrtc():
    """A source's `#include "dir/x.cuh"` resolves only if the compiler hands NVRTC that header under that name
    (qtool/cuda/compile.py passes every kernels/**/*.cuh by its path relative to kernels/; CUDA's own headers are
    never included)."""
    import re

    from qtool.cuda.compile import _headers
    from qtool.resources import kernels_dir

    headers = _headers()
    assert "common/ptx_common.cuh" in headers
    sources = sorted(kernels_dir().rglob("*.cu*"))
    assert any(s.parent != kernels_dir() for s in sources)
    for src in sources:
        for name in re.findall(r'^#include\s+[<"]([^>"]+)[>"]', src.read_text(), flags=re.M):
            rel = src.relative_to(kernels_dir()).as_posix()
            assert name in headers, f"{rel} includes {name}, which is not a header under kernels/"


def test_every_kernel_source_a_launcher_names_exists():
    """The launchers name their sources by path relative to kernels/ (`SOURCE = "quik/gemm.cu"`); a stale name
    would only fail on a GPU."""
    import re

    from qtool.resources import kernels_dir

    named = set()
    for py in (ROOT / "qtool").rglob("*.py"):
        named |= set(re.findall(r'^\w*SOURCE\s*=\s*"([^"]+)"', py.read_text(), flags=re.M))
    assert "quik/gemm.cu" in named and "qoq/gemm.cu" in named
    for name in sorted(named):
        assert (kernels_dir() / name).is_file(), f"{name}: no such source under kernels/"


def test_readme_commands_are_what_ci_runs():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    block = readme.split("```bash", 1)[1].split("```", 1)[0]
    commands = [ln for ln in block.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    assert len(commands) == 2
    for cmd in commands:
        assert cmd in ci.splitlines(), cmd


def test_optional_extras_fail_in_one_line_naming_the_extra(monkeypatch, tmp_path):
    """lm-eval and matplotlib are extras (`qtool[eval]`, `qtool[plot]`): without them, what needs them is one
    line naming the extra, and nothing else needs them."""
    import importlib.util

    import tomllib

    from bad_input import assert_one_line_error, run_cli
    from conftest import STORIES, TINY_SAMPLE

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = " ".join(project["dependencies"])
    assert "lm-eval" not in base and "matplotlib" not in base
    assert project["optional-dependencies"]["eval"] == ["lm-eval>=0.4.13"]
    assert "compressed-tensors>=0.17" in project["dependencies"]
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "lm_eval" else real(name, *a)
    )
    res = run_cli(["eval", str(STORIES), "--tasks", "piqa", "--limit", "1", "--device", "cpu"])
    assert_one_line_error(res, 6, "--tasks", "qtool[eval]")
    res = run_cli(["eval", str(STORIES), "--text", str(TINY_SAMPLE), "--seq-len", "32", "--max-windows", "1"])
    assert res.exit_code == 0, res.output
