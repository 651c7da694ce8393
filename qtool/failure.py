"""How every qtool command ends when it fails: one printer, used by the `qtool` group and by `qtool bench`.

A failure is one line on stderr, `qtool: error: MESSAGE`, and its class's exit code (qtool/errors.py); with
`--json` the same error is also a JSON object on stdout, so a script reading stdout never has to parse stderr.
click's own usage errors keep click's format and exit code 2. A bug is one line too, with exit code 70, unless
QTOOL_TRACEBACK=1 asks for the traceback."""

from __future__ import annotations

import errno
import json
import os
import sys
from typing import NoReturn

import click

from qtool.errors import EXIT_INTERNAL, EXIT_RESOURCE, EXIT_USAGE, QtoolError

JSON_KEY = (
    "qtool.json"  # in click's ctx.meta (shared by a context and its children): whether --json was given
)
TRACEBACK_ENV = "QTOOL_TRACEBACK"

# OS errors that say the machine cannot do the work; any other escaping OSError is a bug in qtool's checks.
_RESOURCE_ERRNOS = {
    errno.ENOSPC,
    errno.EDQUOT,
    errno.EROFS,
    errno.EACCES,
    errno.EPERM,
    errno.ENOMEM,
    errno.EMFILE,
    errno.ENFILE,
    errno.EFBIG,
}


# Longest message printed: past it a line is cut, so that no input can make the error itself huge.
MAX_MESSAGE = 2000


def one_line(text: str) -> str:
    line = " ".join(part.strip() for part in str(text).splitlines() if part.strip())
    if len(line) > MAX_MESSAGE:
        line = f"{line[:MAX_MESSAGE]}... ({len(line) - MAX_MESSAGE} more characters)"
    return line


def fail(ctx: click.Context, kind: str, code: int, message: str) -> NoReturn:
    message = one_line(message)
    click.echo(f"qtool: error: {message}", err=True)
    if ctx.meta.get(JSON_KEY):
        click.echo(json.dumps({"error": {"kind": kind, "exit_code": code, "message": message}}))
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        # A rank that failed leaves its process group undestroyed (a peer may be gone); tearing the group's C++
        # threads down with the interpreter can abort the process after the line above ("terminate called
        # without an active exception", exit -6 instead of `code`). Leave without that teardown.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    ctx.exit(code)


def _resource_message(e: BaseException) -> str | None:
    if (
        isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError"
    ):  # torch's, without importing torch
        return f"out of memory ({one_line(e) or type(e).__name__})"
    if isinstance(e, OSError) and e.errno in _RESOURCE_ERRNOS:
        where = f"'{e.filename}': " if e.filename else ""
        return f"{where}{e.strerror or e}"
    return None


def wants_json(args: list[str]) -> bool:
    return "--json" in (args[: args.index("--")] if "--" in args else args)


def _usage_error(e: click.exceptions.UsageError, json_mode: bool):
    """click's own usage errors (unknown option, missing argument, a value of the wrong type) in qtool's one-line
    form, exit 2, with a pointer to the command's -h; with --json also as the JSON error object on stdout."""
    message = one_line(e.format_message())
    path = e.ctx.command_path if e.ctx is not None else "qtool"
    if json_mode:
        click.echo(json.dumps({"error": {"kind": "usage", "exit_code": EXIT_USAGE, "message": message}}))
    click.echo(f"qtool: error: {message} ({path} -h lists the options)", err=True)
    raise click.exceptions.Exit(EXIT_USAGE)


class QtoolGroup(click.Group):
    """A click group whose commands' failures all go through `fail`."""

    def resolve_command(self, ctx: click.Context, args: list[str]):
        name, cmd, rest = super().resolve_command(ctx, args)
        # A usage error stops the subcommand's parse before --json is read, so the raw arguments decide whether
        # that error is also printed as JSON; a successful parse then records the parsed flag (output_options).
        if cmd is not None and getattr(cmd.callback, "qtool_json_option", False):
            ctx.meta[JSON_KEY] = wants_json(rest)
        return name, cmd, rest

    def make_context(self, info_name, args, parent=None, **extra):
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except click.exceptions.UsageError as e:  # an unknown command or a bad option of `qtool` itself
            _usage_error(e, json_mode=False)

    def invoke(self, ctx: click.Context):
        from qtool import interrupts

        # The handlers stay in place until the failure is printed: it reads what they recorded.
        with interrupts.handled():
            return self._invoke(ctx, interrupts)

    def _invoke(self, ctx: click.Context, interrupts):
        try:
            result = super().invoke(ctx)
            interrupts.final_check()  # a signal during the last steps, or one whose exception was lost
            return result
        except click.exceptions.UsageError as e:
            _usage_error(e, json_mode=bool(ctx.meta.get(JSON_KEY)))
        except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except QtoolError as e:
            fail(ctx, e.kind, e.exit_code, str(e))
        except KeyboardInterrupt as e:
            message = "interrupted"
            if interrupts.output_in_place():
                message = f"interrupted by {e} after the command's work was done (what it wrote is complete)"
            fail(ctx, "interrupted", interrupts.exit_code(e), message)
        except BrokenPipeError:
            raise  # stdout closed by the reader (`| head`): click ends quietly
        except Exception as e:
            message = _resource_message(e)
            if message is not None:
                fail(ctx, "resource", EXIT_RESOURCE, message)
            if os.environ.get(TRACEBACK_ENV, "").strip() not in ("", "0"):
                raise
            detail = one_line(e)
            fail(
                ctx,
                "internal",
                EXIT_INTERNAL,
                f"internal error: {type(e).__name__}{': ' + detail if detail else ''} "
                f"(set {TRACEBACK_ENV}=1 for the traceback)",
            )
