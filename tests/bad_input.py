"""Harness of the bad-input tests: run the CLI on a malformed input, then check that it failed the way the README
promises (its class's exit code, one line on stderr, no traceback) and left nothing at the output.

In-process through click's CliRunner by default (torch is imported once per session); `subprocess=True` runs a
child Python process, for what needs a real exit or signal."""

from __future__ import annotations

import json
import os
import subprocess as sp
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The exit code of each failure class (qtool/errors.py); the tests spell the numbers out, so a renumbering is
# noticed here rather than followed silently.
KINDS = {
    2: "usage",
    3: "recipe",
    4: "input",
    5: "checkpoint",
    6: "resource",
    7: "not_implemented",
    8: "gate",
    70: "internal",
    130: "interrupted",
}


@dataclass
class Run:
    exit_code: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def run_cli(
    args: Sequence[object],
    *,
    env: dict[str, str] | None = None,
    subprocess: bool = False,
    cwd: Path | None = None,
    timeout: float = 120,
) -> Run:
    """Run `qtool ARGS` (in this process, or with `subprocess` in a child); `env` adds to the environment."""
    args = [str(a) for a in args]
    if subprocess:
        proc = sp.run(
            [sys.executable, "-c", "from qtool.cli import main; main()", *args],
            cwd=cwd or ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        return Run(proc.returncode, proc.stdout, proc.stderr)
    from click.testing import CliRunner

    from qtool.cli import cli

    old = os.getcwd()
    if cwd is not None:
        os.chdir(cwd)
    try:
        res = CliRunner().invoke(cli, args, env=env, catch_exceptions=False, prog_name="qtool")
    finally:
        os.chdir(old)
    return Run(res.exit_code, res.stdout, res.stderr)


# The first lines of a child process's Python code that must take SIGINT as a process started by a shell does:
# pytest-xdist workers ignore SIGINT and a child inherits that. Set in the child's code, not in a preexec_fn, which
# can deadlock a child forked from a process with threads.
SIGINT_AS_FROM_A_SHELL = """import signal
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.SIG_DFL)
"""


def reap(*procs: sp.Popen) -> None:
    """Kill and collect the child processes a test started that are still running: a child left behind would
    outlive the test (on a GPU it would hold the device)."""
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.communicate()


def leftovers(path: Path) -> list[Path]:
    """The hidden siblings a write of `path` uses (`.NAME.tmp-PID`, `.NAME.old-PID`) that still exist."""
    path = Path(path)
    if not path.parent.is_dir():
        return []
    return sorted(
        p for p in path.parent.iterdir() if p.name.startswith((f".{path.name}.tmp-", f".{path.name}.old-"))
    )


def assert_nothing_at(paths: Path | Iterable[Path]) -> None:
    for p in [paths] if isinstance(paths, (str, Path)) else paths:
        p = Path(p)
        assert not p.exists() and not p.is_symlink(), f"{p} was written"
        assert not leftovers(p), f"leftovers beside {p}: {leftovers(p)}"


def assert_one_line_error(
    result: Run, code: int, *words: str, output: Path | Iterable[Path] | None = None, json_error: bool = False
) -> str:
    """The failure contract: exit `code`, no traceback, one non-empty line on stderr (`qtool: error: ...`, click's
    own usage errors included) holding every one of `words`; nothing at
    `output`. With `json_error`, stdout is exactly the JSON error object of that line. Returns the error line."""
    assert result.exit_code == code, f"exit {result.exit_code}, expected {code}\n{result.output}"
    assert "Traceback" not in result.output, result.output
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("qtool: error: "), result.stderr
    line = lines[0]
    for w in words:
        assert w in line, f"{w!r} not in {line!r}"
    if json_error:
        err = json.loads(result.stdout)["error"]
        assert err == {"kind": KINDS[code], "exit_code": code, "message": err["message"]}, err
        assert err["message"] in line, (line, err)
    else:
        assert not result.stdout.strip(), f"stdout of a failed run: {result.stdout!r}"
    if output is not None:
        assert_nothing_at(output)
    return line
