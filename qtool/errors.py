"""Errors a user can act on: each prints as one line (`qtool: error: ...`) and exits with its class's code, never
as a traceback. The codes are documented in the README and are part of the command-line contract: a CI pipeline
tells "fix the recipe" from "the disk is full" from "someone pressed Ctrl-C" by the exit code alone."""

from __future__ import annotations

import reprlib

# Exit codes, one per class of failure. 2 is click's own usage code (bad option or argument).
EXIT_USAGE = 2
EXIT_RECIPE = 3
EXIT_INPUT = 4
EXIT_CHECKPOINT = 5
EXIT_RESOURCE = 6
EXIT_NOT_IMPLEMENTED = 7
EXIT_GATE = (
    8  # `qtool eval --baseline` measured the model and it is worse than its gate allows (qtool/gate.py)
)
EXIT_INTERNAL = 70  # sysexits' EX_SOFTWARE: a bug in qtool, not in the user's input
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for Ctrl-C

EXIT_CODES = {
    "usage": EXIT_USAGE,
    "recipe": EXIT_RECIPE,
    "input": EXIT_INPUT,
    "checkpoint": EXIT_CHECKPOINT,
    "resource": EXIT_RESOURCE,
    "not_implemented": EXIT_NOT_IMPLEMENTED,
    "gate": EXIT_GATE,
    "internal": EXIT_INTERNAL,
    "interrupted": EXIT_INTERRUPTED,
}


class QtoolError(Exception):
    """A problem with the user's input (file, key or tensor named in the message). Raise a subclass: the base
    class means a bad input file (model, calibration text, stats file)."""

    exit_code = EXIT_INPUT
    kind = "input"


class UsageError(QtoolError):
    """Options that contradict each other or a value a command cannot take (beyond what click checks)."""

    exit_code = EXIT_USAGE
    kind = "usage"


class RecipeError(QtoolError):
    """The recipe is invalid; raised before any model is loaded."""

    exit_code = EXIT_RECIPE
    kind = "recipe"


class InputError(QtoolError):
    """A model, calibration text, stats file or evaluation text is missing, unreadable or inconsistent."""

    exit_code = EXIT_INPUT
    kind = "input"


class CheckpointError(QtoolError):
    """A packed checkpoint is corrupt, incomplete or of an unknown version."""

    exit_code = EXIT_CHECKPOINT
    kind = "checkpoint"


class ResourceError(QtoolError):
    """The machine cannot do the work: output not writable, disk or memory too small, no GPU."""

    exit_code = EXIT_RESOURCE
    kind = "resource"


class NotImplementedYet(QtoolError):
    """A documented command or option that this version does not implement."""

    exit_code = EXIT_NOT_IMPLEMENTED
    kind = "not_implemented"


class Interrupted(QtoolError):
    """A signal (Ctrl-C's SIGINT, SIGTERM, SIGHUP: exit 128 + its number) after some work was kept for a later
    `--resume` (the message says where and how to go on)."""

    exit_code = EXIT_INTERRUPTED
    kind = "interrupted"

    def __init__(self, message: str, cause: BaseException | None = None) -> None:
        """`cause`: the KeyboardInterrupt (or qtool.interrupts.Interrupt) that stopped the work."""
        super().__init__(message)
        self.exit_code = 128 + int(getattr(cause, "signum", EXIT_INTERRUPTED - 128))


class GateFailed(QtoolError):
    """The evaluation ran and the quantized model missed its quality gate; the message names every metric that
    failed. Not a broken input: the measurement is complete (and printed) before this is raised."""

    exit_code = EXIT_GATE
    kind = "gate"


_SHOWN = reprlib.Repr()
_SHOWN.maxstring = _SHOWN.maxother = 80
_SHOWN.maxlist = _SHOWN.maxdict = _SHOWN.maxtuple = _SHOWN.maxset = 8
_SHOWN.maxlevel = 3


def shown(value: object) -> str:
    """`value` as an error message quotes it: its repr, cut short. A value from a file can be huge (a YAML alias
    expands to millions of items that share one object), and a message must cost no more than the check."""
    return _SHOWN.repr(value)
