"""`--json` means one thing on every command: a flag that prints JSON on stdout (bench writes a file with
`--json-out PATH`; tests/test_bench_plot.py checks what each writes)."""

from __future__ import annotations

import json

import click

from qtool.cli import cli as group


def _commands(g: click.Group, prefix: str = ""):
    for name, cmd in g.commands.items():
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, f"{prefix}{name} ")
        else:
            yield f"{prefix}{name}", cmd


def test_every_command_has_a_json_flag():
    found = dict(_commands(group))
    assert {"quantize", "eval", "pack", "export", "bench kernels", "bench e2e", "bench quik"} <= set(found)
    for name, cmd in found.items():
        opts = [p for p in cmd.params if "--json" in p.opts]
        assert len(opts) == 1 and opts[0].is_flag, name


def test_bench_json_is_a_flag(cli, tmp_path, monkeypatch):
    # Without a GPU the bench stops at once; with --json its error is a JSON object on stdout.
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    res = cli("bench", "kernels", "--json")
    assert res.exit_code == 6 and json.loads(res.stdout)["error"]["kind"] == "resource", res.output
    assert (
        cli("bench", "e2e", "--json", str(tmp_path / "r.json")).exit_code == 2
    )  # a path is no longer its value


def test_json_keeps_progress_on_stderr(cli, tmp_path):
    """With --json, stdout is the summary alone and the progress lines still reach stderr (a CI log shows the
    run); -q silences them."""
    from conftest import STORIES, write_recipe

    recipe = write_recipe(
        tmp_path / "r.yaml",
        f"model: {STORIES}\nstages:\n  - stage: rtn\n    bits: 4\n    group_size: 4\noutput: {tmp_path / 'o'}\n",
    )
    res = cli("quantize", recipe, "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["quantized_linears"] == 35
    assert "quantizing blocks" in res.stderr and f"wrote {tmp_path / 'o'}" in res.stderr, res.stderr
    res = cli("quantize", recipe, "--json", "-q", "--overwrite")
    assert res.exit_code == 0 and json.loads(res.stdout)["quantized_linears"] == 35
    assert not res.stderr.strip(), res.stderr
