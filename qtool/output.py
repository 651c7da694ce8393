"""Where a command writes (a checkpoint folder, a stats file): checked before any work, written into a hidden
sibling (`.NAME.tmp-PID`) created up front, and published by rename, so the output appears only when complete.

Checking by creating the temporary sibling is the one test of writability that cannot disagree with the write
itself (permissions, read-only mounts, a parent that is a file). A run that fails or is interrupted removes its
temporary and the parent folders it created; a run that is killed leaves the temporary, and the next run on the
same output finds it by name and by its dead PID."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from qtool import interrupts
from qtool.checkpoint.manifest import MANIFEST_NAME
from qtool.errors import ResourceError, UsageError
from qtool.units import format_size

_TMP, _OLD = ".tmp-", ".old-"
# Files that mark a folder as qtool's own output, which --overwrite may replace: a checkpoint's manifest, an
# export's provenance record (qtool/export/).
EXPORT_RECORD = "qtool-export.json"
_MARKS = (MANIFEST_NAME, EXPORT_RECORD)


def temp_sibling(path: Path, kind: str = _TMP) -> Path:
    return path.with_name(f".{path.name}{kind}{os.getpid()}")


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return (
            False  # this process has not started writing this output yet: a leftover of an earlier run in it
        )
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def find_leftovers(path: Path) -> tuple[list[Path], list[tuple[Path, int]]]:
    """(stale, in use): the hidden siblings of earlier writes of `path`, split by whether their process lives."""
    stale, live = [], []
    if not path.parent.is_dir():
        return stale, live
    for p in sorted(path.parent.iterdir()):
        for kind in (_TMP, _OLD):
            prefix = f".{path.name}{kind}"
            if p.name.startswith(prefix) and p.name[len(prefix) :].isdigit():
                pid = int(p.name[len(prefix) :])
                if _pid_alive(pid):
                    live.append((p, pid))
                else:
                    stale.append(p)
    return stale, live


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)
    else:
        p.unlink(missing_ok=True)


class Output:
    """A reserved output: its temporary sibling exists. Use as a context manager; `publish()` moves the temporary
    into place. Leaving the block any other way (error, Ctrl-C) removes the temporary and the created parents."""

    def __init__(
        self, path: Path, tmp: Path, directory: bool, created: list[Path], removed: list[Path]
    ) -> None:
        self.path, self.tmp, self.directory = path, tmp, directory
        self.created_parents = created
        self.removed_leftovers = removed
        self.published = False

    def __enter__(self) -> Output:
        return self

    def __exit__(self, *exc) -> None:
        if not self.published:
            self.discard()

    def discard(self) -> None:
        # Runs because the command is failing: a second Ctrl-C must not leave half of the temporary behind.
        with interrupts.deferred(then_raise=False):
            if self.tmp.exists() or self.tmp.is_symlink():
                _remove(self.tmp)
            for d in reversed(
                self.created_parents
            ):  # deepest first; only folders this run made and left empty
                try:
                    d.rmdir()
                except OSError:
                    break

    def publish(self) -> None:
        path = self.path
        interrupts.check()  # a signal whose exception was lost on the way: nothing is published
        if self.directory and (path.exists() or path.is_symlink()):
            # Checked again: the output may have changed during a long run, and a file is never replaced.
            _check_existing(path, overwrite=True)
        # From the first rename on, the output is this run's: a signal now is reported when the command ends,
        # never halfway through the swap (the old output gone, the new one not yet in place).
        interrupts.hold_to_end()
        if not self.directory:
            os.replace(self.tmp, path)
        elif path.exists() or path.is_symlink():
            trash = temp_sibling(path, _OLD)
            path.rename(trash)
            self.tmp.rename(path)
            _remove(trash)
        else:
            self.tmp.rename(path)
        self.published = True


def _check_existing(path: Path, *, overwrite: bool, directory: bool = True) -> None:
    if directory and path.is_symlink():
        raise UsageError(
            f"output '{path}': is a symbolic link; expected a new directory path (a link is never "
            f"replaced, even with --overwrite)"
        )
    if directory and not path.is_dir():
        raise UsageError(
            f"output '{path}': is an existing file; expected a directory path for the checkpoint (a "
            f"file is never replaced, even with --overwrite)"
        )
    if not directory and path.is_dir():
        raise UsageError(f"output '{path}': is a directory; expected a file path")
    if directory and not overwrite:
        raise UsageError(f"output '{path}': already exists; expected a new path (or pass --overwrite)")
    if directory and any(path.iterdir()) and not any((path / m).is_file() for m in _MARKS):
        # --overwrite replaces a checkpoint or an export; a folder of other files (the working directory, a model)
        # is the user's.
        raise UsageError(
            f"output '{path}': is a directory that is not a qtool checkpoint (no {MANIFEST_NAME})"
            f"; expected a new path (--overwrite replaces only a checkpoint, an export or an empty "
            f"folder)"
        )


def check_apart(path: str | Path, inputs: dict[str, str | Path | None]) -> None:
    """Refuse an output that is one of the command's inputs (`inputs`: what each is, its path), lies inside one,
    or holds one: writing it (with --overwrite, replacing it) would destroy what the command reads. Inputs that
    are not local paths (hub ids, datasets names) are not compared."""
    out = Path(os.path.realpath(path))
    for label, ref in inputs.items():
        if ref is None or not Path(ref).exists():
            continue
        inp = Path(os.path.realpath(ref))
        if out == inp or inp in out.parents:
            where = "is" if out == inp else "is inside"
        elif out in inp.parents:
            where = "holds"
        else:
            continue
        raise UsageError(
            f"output '{path}': {where} the {label} '{ref}'; expected an output apart from what the command "
            f"reads (it would be written over)"
        )


def check_output(
    path: str | Path,
    *,
    directory: bool,
    overwrite: bool,
    resume: bool = False,
    inputs: dict[str, str | Path | None] | None = None,
) -> list[Path]:
    """What `reserve_output` refuses, without creating anything: a command runs it before it reads a model or a
    text, so a run whose output is refused fails in a second. Returns the stale leftovers it would remove."""
    path = Path(os.path.abspath(path))
    check_apart(path, inputs or {})
    if path.exists() or path.is_symlink():
        _check_existing(path, overwrite=overwrite, directory=directory)

    stale, live = find_leftovers(path)
    if live:
        p, pid = live[0]
        raise ResourceError(
            f"output '{path}': '{p.name}' is being written by process {pid}, which is running; "
            f"expected one run per output (wait for it or stop it)"
        )
    if stale and not (overwrite or resume):
        raise UsageError(
            f"output '{path}': leftovers of an interrupted run beside it: "
            f"{', '.join(p.name for p in stale)}; --overwrite removes them"
        )
    parent = path.parent
    while not parent.exists() and not parent.is_symlink():
        parent = parent.parent
    if not parent.is_dir():
        raise ResourceError(f"output '{path}': '{parent}' is a file; expected a directory to hold the output")
    return stale


def reserve_output(
    path: str | Path,
    *,
    directory: bool,
    overwrite: bool,
    needs_bytes: int | None = None,
    log: Callable[[str], None] | None = None,
    resume: bool = False,
    inputs: dict[str, str | Path | None] | None = None,
) -> Output:
    """Check `path` as the output of a command and create its temporary sibling; refuse (one line) when it is a
    file where a folder is expected or the reverse, exists without `overwrite`, lies under a file or in a folder
    that cannot be written, another live run writes it, it is, holds or lies inside one of `inputs`, or the free
    space is below `needs_bytes`. Stale leftovers of killed runs are refused without `overwrite` and removed with
    it (or with `resume`: a resumed run goes on from the killed run's work folder, and its half-written output is of
    no use)."""
    path = Path(os.path.abspath(path))
    stale = check_output(path, directory=directory, overwrite=overwrite, resume=resume, inputs=inputs)

    created: list[Path] = []
    parent = path.parent
    missing = []
    while not parent.exists() and not parent.is_symlink():
        missing.append(parent)
        parent = parent.parent
    removed: list[Path] = []
    try:
        for d in reversed(missing):
            d.mkdir()
            created.append(d)
        for p in stale:  # only reached with --overwrite or --resume
            _remove(p)
            removed.append(p)
            if log is not None:
                log(f"removed '{p}', left by an interrupted run ({'--resume' if resume else '--overwrite'})")
        tmp = temp_sibling(path)
        if directory:
            tmp.mkdir()
        else:
            tmp.touch(exist_ok=False)
    except OSError as e:
        Output(path, temp_sibling(path), directory, created, removed).discard()
        where = e.filename or parent
        raise ResourceError(
            f"output '{path}': cannot write '{where}' ({e.strerror or e}); expected a writable location"
        ) from None
    out = Output(path, tmp, directory, created, removed)
    if needs_bytes:
        free = shutil.disk_usage(tmp.parent).free
        if free < needs_bytes:
            out.discard()
            raise ResourceError(
                f"output '{path}': needs at least {format_size(needs_bytes)}, but its file system "
                f"has {format_size(free)} free"
            )
    return out


# ---- size estimates: lower bounds, so a run that fits is never refused ------------------------------------------


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).iterdir() if p.is_file())
