"""Errors a user can act on: each prints as one line and exits non-zero, never as a traceback."""

from __future__ import annotations


class QtoolError(Exception):
    """A problem with the user's input (file, key or tensor named in the message)."""

    exit_code = 1


class RecipeError(QtoolError):
    """The recipe is invalid; raised before any model is loaded."""

    exit_code = 2


class CheckpointError(QtoolError):
    """A packed checkpoint is corrupt, incomplete or of an unknown version."""

    exit_code = 1


class NotImplementedYet(QtoolError):
    """A documented command or option that this version does not implement."""

    exit_code = 3
