"""SIGINT, SIGTERM and SIGHUP, handled alike: a command that gets one stops, cleans up what it was writing, prints
one line and exits 128 + the signal's number (130, 143, 129), as shells report a process a signal ended.

Python's own SIGINT handler raises KeyboardInterrupt wherever the main thread happens to be. Where that is a
finalizer (a `__del__`, a weakref callback, a generator closed by the garbage collector), the interpreter prints
"Exception ignored" and carries on: the interrupt is lost and the run can finish with exit 0. So the signal is
also recorded, and `check()` raises it again at the points that matter (before an output is published, at each
block, when the command ends); a run that received a signal never reports success.

Some steps must not stop halfway (the swap of an old output for a new one): inside `deferred()` a signal is only
recorded, and raised when the step is done. A signal the parent process set to be ignored (`nohup`, a background
job) stays ignored."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))


class Interrupt(KeyboardInterrupt):
    """A signal that stops the command (a KeyboardInterrupt, so every cleanup that Ctrl-C runs runs for it)."""

    def __init__(self, signum: int = signal.SIGINT) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def exit_code(e: BaseException) -> int:
    """128 + the number of the signal behind `e` (a plain KeyboardInterrupt is Ctrl-C's SIGINT)."""
    return 128 + int(getattr(e, "signum", signal.SIGINT))


_received: int | None = None
_deferring = 0
_held = (
    False  # the command's output is in place: what is left runs to the end, and the signal is reported then
)
_installed = False


def received() -> int | None:
    """The first signal this command received, if any."""
    return _received


def _handle(signum, frame) -> None:
    global _received
    if _received is None:
        _received = signum
    if not _deferring and not _held:
        raise Interrupt(signum)


def check() -> None:
    """Raise the signal this command received (and did not stop on yet, or whose exception was swallowed)."""
    if _received is not None and not _deferring and not _held:
        raise Interrupt(_received)


@contextmanager
def deferred(then_raise: bool = True) -> Iterator[None]:
    """A step that runs to its end: a signal during it is raised once it is done (`then_raise`), or only
    recorded (a cleanup that runs because the command is failing already)."""
    global _deferring
    _deferring += 1
    try:
        yield
    finally:
        _deferring -= 1
    if then_raise:
        check()


def hold_to_end() -> None:
    """The command's output is in place: from here a signal is recorded, the rest (removing work folders,
    printing the summary) runs, and the command then ends with the signal's exit code (`final_check`)."""
    global _held
    _held = True


def output_in_place() -> bool:
    """Whether this command published its output (`hold_to_end` was called)."""
    return _held


def final_check() -> None:
    """At the end of a command: raise the signal it received, wherever it came."""
    if _received is not None:
        raise Interrupt(_received)


@contextmanager
def handled() -> Iterator[None]:
    """The three signals stop the command as Ctrl-C does (outside the main thread, where Python cannot set
    handlers, nothing changes). The previous handlers come back at the end."""
    global _received, _installed, _held
    if _installed or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {}
    _received, _held = None, False
    for signum in SIGNALS:
        old = signal.getsignal(signum)
        if old is signal.SIG_IGN:
            continue
        previous[signum] = old
        signal.signal(signum, _handle)
    _installed = True
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)
        _installed, _held, _received = False, False, None
