"""The work folder of a quantize run (`.NAME.partial` beside the output): what a later `--resume` needs to go on
from the last finished block after the run was killed or interrupted.

It holds each finished block's tensors as they go into the checkpoint (`block-NNNNN.safetensors`), the
activations entering the next block (`inputs-NNNNN.bin`, raw, so writing them takes no second copy in memory; a
run over several processes writes one part per rank, `inputs-NNNNN.bin` then `inputs-NNNNN.R.bin`, each rank its
samples, and state.json counts the samples of each part, so a resumed run may use any number of processes)
and `state.json`: what the run is (recipe, model files, calibration data, seed, compute dtype and device), the
next block and what each finished block recorded. Every file is written under a temporary name and renamed, and
state.json is renamed last: it is the commit point, so a kill at any moment leaves the state of one block boundary
(files the state does not name are leftovers of the block that was cut short, and are removed on resume).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import threading
from pathlib import Path

import torch
from safetensors.torch import save_file

from qtool import interrupts
from qtool.checkpoint.manifest import file_sha256
from qtool.errors import CheckpointError, UsageError, shown
from qtool.models.integrity import (
    INDEX_NAME,
    SAFETENSORS_DTYPES,
    TensorInfo,
    check_finite,
    describe,
    read_header,
    read_tensor,
)

STATE = "state.json"

# What must match for a resumed run to write the checkpoint the uninterrupted run would have written; the most
# specific first (the recipe as run covers the seed and the data source too).
IDENTITY = {
    "model": "model files",
    "data": "calibration data",
    "seed": "calibration seed",
    "dtype": "compute dtype",
    "device": "compute device",
    "versions": "qtool/torch version",
    "num_blocks": "number of blocks",
    "recipe": "recipe",
}


def partial_path(out: Path) -> Path:
    return out.with_name(f".{out.name}.partial")


def model_fingerprint(folder: str | Path) -> str:
    """sha256 over the model's config.json, shard index and, per weight file, its name, size, modification time
    and safetensors header: a rewritten or replaced file changes it, without reading the weights (hashing the
    data of a 140 GB model would take minutes on every start)."""
    folder = Path(folder)
    h = hashlib.sha256()
    if not folder.is_dir():
        h.update(str(folder).encode())  # a hub id: its name and revision are all there is to compare
        return h.hexdigest()
    for name in ("config.json", INDEX_NAME):
        p = folder / name
        if p.is_file():
            h.update(name.encode() + b"\0" + p.read_bytes())
    for p in sorted(folder.glob("*.safetensors")):
        st = p.stat()
        h.update(f"{p.name}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
        with open(p, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            h.update(f.read(min(n, 100_000_000)))
    return h.hexdigest()


def recipe_hash(as_run: dict) -> str:
    return hashlib.sha256(json.dumps(as_run, sort_keys=True, default=str).encode()).hexdigest()


def _atomic_write(path: Path, write):
    tmp = path.with_name(path.name + ".tmp")
    result = write(tmp)
    os.replace(tmp, path)
    return result


def _record_digest(block: dict) -> str:
    """sha256 of what a finished block recorded (its linears' summaries go into the manifest's figures)."""
    what = {k: block.get(k) for k in ("records", "linears")}
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()


_SHA256 = re.compile(r"[0-9a-f]{64}")
_DTYPES = ("float32", "float16", "bfloat16", "float64")


def _nonneg_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def state_problem(state) -> str | None:
    """What is wrong with a parsed state.json (the key, what was found), else None."""
    if not isinstance(state, dict):
        return f"found a JSON {type(state).__name__}, expected an object"
    identity = state.get("identity")
    if not isinstance(identity, dict) or any(k not in identity for k in IDENTITY):
        return f"identity: found {shown(identity)}, expected an object with {', '.join(IDENTITY)}"
    total = identity["num_blocks"]
    if not _nonneg_int(total):
        return f"identity.num_blocks: found {shown(total)}, expected a number of blocks"
    k = state.get("next_block")
    if not _nonneg_int(k) or k > total:
        return f"next_block: found {shown(k)}, expected an integer in 0..{total}"
    if not isinstance(state.get("overwrite"), bool):
        return f"overwrite: found {shown(state.get('overwrite'))}, expected true or false"
    blocks = state.get("blocks")
    if not isinstance(blocks, list) or len(blocks) != k:
        return f"blocks: found {shown(blocks)}, expected a list of the {k} finished blocks"
    for i, b in enumerate(blocks):
        f = b.get("file") if isinstance(b, dict) else None
        if (
            not isinstance(b, dict)
            or not isinstance(b.get("records"), list)
            or not isinstance(b.get("linears"), dict)
            or not isinstance(f, dict)
            or not _nonneg_int(f.get("size"))
            or not all(
                isinstance(f.get(h), str) and _SHA256.fullmatch(f[h]) for h in ("sha256", "record_sha256")
            )
        ):
            return f"blocks[{i}]: found {shown(b)}, expected records, linears and the block file's size and sha256"
    spec = state.get("inputs")
    if spec is None:
        return None
    if not isinstance(spec, dict):
        return f"inputs: found {shown(spec)}, expected null or an object"
    if spec.get("dtype") not in _DTYPES:
        return f"inputs.dtype: found {shown(spec.get('dtype'))}, expected one of {', '.join(_DTYPES)}"
    shapes = spec.get("shapes")
    if (
        not isinstance(shapes, list)
        or not shapes
        or not all(isinstance(x, list) and x and all(_nonneg_int(d) for d in x) for x in shapes)
    ):
        return f"inputs.shapes: found {shown(shapes)}, expected a list of tensor shapes"
    parts = spec.get("parts")
    if (
        not isinstance(parts, list)
        or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in parts)
        or sum(parts) != len(shapes)
    ):
        return f"inputs.parts: found {shown(parts)}, expected the samples of each part, {len(shapes)} in all"
    digests = spec.get("sha256")
    if (
        not isinstance(digests, list)
        or len(digests) != len(parts)
        or not all(isinstance(d, str) and _SHA256.fullmatch(d) for d in digests)
    ):
        return f"inputs.sha256: found {shown(digests)}, expected the sha256 of each of the {len(parts)} parts"
    return None


class Work:
    """An open work folder. `next_block` blocks are finished; `blocks[i]` is what block i recorded."""

    def __init__(self, folder: Path, state: dict, world=None) -> None:
        """`world` (qtool/distributed.py): rank 0 writes the block files and the state, every rank its part of
        the activations."""
        from qtool.distributed import World

        self.folder = folder
        self.state = state
        self.world = world or World()
        # A block committed while its activations are still being written (see `commit`), and the pinned host
        # buffer they are copied into.
        self._pending: _Pending | None = None
        self._pinned: torch.Tensor | None = None
        # Rank 0 deletes the activations the state no longer names from a thread: deleting a file of a few GB
        # takes tens of ms, which every rank would wait for in its next collective.
        self._deleting: threading.Thread | None = None

    # ---- opening --------------------------------------------------------------------------------------------

    @staticmethod
    def read_state(folder: Path) -> dict | None:
        """The state of `folder` when it is one this version wrote, else None (for messages; `load_state` says
        what is wrong)."""
        try:
            state = json.loads((folder / STATE).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return state if state_problem(state) is None else None

    @staticmethod
    def load_state(folder: Path) -> dict | None:
        """The state of the work folder `folder`; None when the run that left it was killed before writing its
        first state (the folder then holds nothing else). A state that does not parse or is not what this
        version writes is refused, naming the key: resuming from it could only start over silently or go on from
        what is not there."""
        path = folder / STATE
        if not path.is_file():
            others = sorted(p.name for p in folder.iterdir() if not p.name.endswith(".tmp"))
            if not others:
                return None
            raise CheckpointError(
                f"--resume: '{folder}' holds {others[0]} but no {STATE}; expected the work folder as the "
                f"interrupted run left it (or --overwrite to start over)"
            )
        try:
            state = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise CheckpointError(
                f"--resume: {path}: not readable JSON ({describe(e)}); expected the state the interrupted run "
                f"wrote (or --overwrite to start over)"
            ) from None
        problem = state_problem(state)
        if problem is not None:
            raise CheckpointError(
                f"--resume: {path}: {problem}; expected the state the interrupted run wrote (or --overwrite "
                f"to start over)"
            )
        return state

    @classmethod
    def start(cls, folder: Path, identity: dict, overwrite: bool = False) -> Work:
        """`overwrite`: the run may replace an existing output (so may a --resume of it)."""
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir()
        state = {"identity": identity, "next_block": 0, "blocks": [], "inputs": None, "overwrite": overwrite}
        work = cls(folder, state)
        work._write_state()
        return work

    @classmethod
    def verify(cls, folder: Path) -> dict | None:
        """The state of `folder`, after checking it and every finished block's file against it (size, safetensors
        header, sha256): a --resume goes on from nothing that is not as the interrupted run wrote it. None:
        nothing was done. Reads no model and no text, so it runs before anything else of the run."""
        state = cls.load_state(folder)
        if state is not None:
            work = cls(folder, state)
            for i, block in enumerate(state["blocks"]):
                work._check_block(i, block)
            work._check_inputs()
        return state

    def _check_inputs(self) -> None:
        spec = self.state["inputs"]
        if spec is None:
            return
        itemsize = torch.empty((), dtype=getattr(torch, spec["dtype"])).element_size()
        first = 0
        for part, count in enumerate(spec["parts"]):
            path = self.inputs_file(self.next_block, part)
            expected = (
                sum(int(torch.Size(s).numel()) for s in spec["shapes"][first : first + count]) * itemsize
            )
            first += count
            found = (
                f"missing, its {STATE} names it"
                if not path.is_file()
                else f"{path.stat().st_size} bytes, its {STATE} says {expected}"
                if path.stat().st_size != expected
                else f"sha256 does not match the one its {STATE} records (the file was modified)"
                if file_sha256(path) != spec["sha256"][part]
                else None
            )
            if found is not None:
                raise CheckpointError(
                    f"--resume: {path}: {found}; expected the work folder as the interrupted "
                    f"run left it (or --overwrite to start over)"
                )

    @staticmethod
    def check_identity(folder: Path, state: dict | None, identity: dict) -> None:
        """Refuse (one line naming what differs) to resume the run that left `folder` (its `state`) as another."""
        if state is None:
            return  # killed before its first state was written: nothing was done, nothing can disagree
        found = state["identity"]
        for key, what in IDENTITY.items():
            if found.get(key) != identity.get(key):
                old, new = (str(v)[:16] for v in (found.get(key), identity.get(key)))
                raise UsageError(
                    f"--resume: '{folder}' was left by a run with another {what} ({old} there, {new} "
                    f"now); expected the same recipe, model, calibration data and settings (or "
                    f"--overwrite to start over)"
                )

    @classmethod
    def check(cls, folder: Path, identity: dict) -> dict | None:
        """`verify`, then `check_identity`; returns the state."""
        state = cls.verify(folder)
        cls.check_identity(folder, state, identity)
        return state

    @classmethod
    def resume(cls, folder: Path, identity: dict, overwrite: bool = False, checked: bool = False) -> Work:
        """`checked`: `check` passed for this folder already in this process (its files were hashed)."""
        state = cls.load_state(folder) if checked else cls.check(folder, identity)
        if state is None:
            return cls.start(folder, identity, overwrite)
        work = cls(folder, state)
        work._check_files()
        return work

    def _check_block(self, i: int, block: dict) -> None:
        path = self.block_file(i)
        recorded = block["file"]

        def refuse(found: str) -> CheckpointError:
            return CheckpointError(
                f"--resume: {path}: {found}; expected the block as the interrupted run wrote it (or "
                f"--overwrite to start over)"
            )

        if _record_digest(block) != recorded["record_sha256"]:
            raise refuse(f"block {i}'s record in {STATE} does not match its record_sha256")
        if not path.is_file():
            raise refuse(f"missing, {STATE} names it")
        size = path.stat().st_size
        if size != recorded["size"]:
            raise refuse(f"{size} bytes, {STATE} records {recorded['size']}")
        try:
            read_header(path, CheckpointError)
        except CheckpointError as e:
            raise refuse(str(e).removeprefix(f"{path}: ").partition("; expected")[0]) from None
        if file_sha256(path) != recorded["sha256"]:
            raise refuse(f"sha256 does not match the one {STATE} records (the file was modified)")

    def _check_files(self) -> None:
        k = self.next_block
        keep = {self.block_file(i).name for i in range(k)} | {STATE}
        if self.state.get("inputs"):
            keep.update(self.inputs_file(k, part).name for part in range(len(self._parts())))
        for name in sorted(keep - {STATE}):
            if not (self.folder / name).is_file():
                raise CheckpointError(
                    f"--resume: '{self.folder}' has lost {name}, which its {STATE} names; "
                    f"expected the work folder as the interrupted run left it (or --overwrite "
                    f"to start over)"
                )
        for p in self.folder.iterdir():
            if p.name not in keep:  # a block that was cut short
                p.unlink()

    # ---- what it holds --------------------------------------------------------------------------------------

    @property
    def next_block(self) -> int:
        return self.state["next_block"]

    @property
    def blocks(self) -> list[dict]:
        return self.state["blocks"]

    def block_file(self, i: int) -> Path:
        return self.folder / f"block-{i:05d}.safetensors"

    def inputs_file(self, i: int, part: int = 0) -> Path:
        return self.folder / (f"inputs-{i:05d}.bin" if part == 0 else f"inputs-{i:05d}.{part}.bin")

    def _parts(self) -> list[int]:
        spec = self.state.get("inputs") or {}
        return spec.get("parts") or []

    def inputs(self, device: torch.device, share: range | None = None) -> list[torch.Tensor] | None:
        """The activations entering block `next_block`, as the interrupted run held them (the samples in `share`
        alone: this rank's, whatever number of parts the interrupted run wrote)."""
        spec = self.state.get("inputs")
        if not spec:
            return None
        dtype = getattr(torch, spec["dtype"])
        shapes = [tuple(s) for s in spec["shapes"]]
        share = range(len(shapes)) if share is None else share
        out: list[torch.Tensor] = []
        first = 0
        for part, count in enumerate(self._parts()):
            mine = range(max(first, share.start), min(first + count, share.stop))
            part_shapes = shapes[first : first + count]
            first += count
            if not mine:
                continue
            sizes = [int(torch.Size(s).numel()) for s in part_shapes]
            path = self.inputs_file(self.next_block, part)
            expected = sum(sizes) * torch.empty((), dtype=dtype).element_size()
            if path.stat().st_size != expected:  # `verify` checked it; the file changed since
                raise CheckpointError(
                    f"--resume: {path}: {path.stat().st_size} bytes, its {STATE} says {expected}; "
                    f"expected the work folder as the interrupted run left it (or --overwrite)"
                )
            flat = torch.from_file(str(path), shared=False, size=sum(sizes), dtype=dtype)
            check_finite([(path.name, flat)], CheckpointError)
            xs = [x.view(s) for x, s in zip(flat.split(sizes), part_shapes, strict=True)]
            start = first - count
            out.extend(xs[j - start].to(device) for j in mine)
            del flat, xs
        return out

    def tensor_files(self) -> list[Path]:
        return [self.block_file(i) for i in range(self.next_block)]

    # ---- a finished block -----------------------------------------------------------------------------------

    def commit(
        self, i: int, tensors: dict[str, torch.Tensor], record: dict, inputs: list[torch.Tensor] | None
    ) -> None:
        """Block `i` is finished: its checkpoint tensors, what it recorded and the activations entering block
        i + 1 (None when no later block needs them).

        Activations on a GPU are copied to pinned host memory and written by a thread while the next block is
        quantized (for a 7B model and 128 x 2048 calibration tokens that is 2 GB per block); the block counts as
        finished in the state only once they are on disk, at the next `commit` or at `flush`. Activations kept in
        host memory or on disk are written before this returns (a second copy of them may not fit).

        A signal during a commit is raised once the commit is done: the run stops at this block's boundary."""
        with interrupts.deferred():
            self._commit(i, tensors, record, inputs)

    def _commit(
        self, i: int, tensors: dict[str, torch.Tensor], record: dict, inputs: list[torch.Tensor] | None
    ) -> None:
        self.flush()
        assert i == self.next_block, (i, self.next_block)
        world = self.world
        if world.is_main:
            path = self.block_file(i)
            _atomic_write(path, lambda p: save_file(tensors, str(p), metadata={"format": "pt"}))
            record = {**record}
            record["file"] = {
                "size": path.stat().st_size,
                "sha256": file_sha256(path),
                "record_sha256": _record_digest(record),
            }
        spec, pending = None, _Pending(i, record)
        if inputs is not None:
            spec = {
                "dtype": str(inputs[0].dtype).removeprefix("torch."),
                "shapes": [list(x.shape) for x in inputs],
            }
            path = self.inputs_file(i + 1, world.rank)
            host = self._host_copy(inputs)
            if host is None:
                spec["sha256"] = _atomic_write(path, lambda p: _write_raw(p, inputs))
            else:
                pending.start(lambda: _atomic_write(path, lambda p: _write_raw(p, host)))
        pending.spec = spec
        self._pending = pending
        if pending.thread is None:
            self.flush()

    def flush(self) -> None:
        """Wait for the last committed block's activations to be on disk, then name them in the state (every
        rank's part is on disk before rank 0 names them all: the commit point)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        written = pending.wait()
        world, spec = self.world, pending.spec
        if spec is not None and written is not None:
            spec["sha256"] = written
        old_parts = len(self._parts())
        specs = world.all_gather_object(spec)
        if spec is not None:
            spec = {
                "dtype": spec["dtype"],
                "shapes": [s for p in specs for s in p["shapes"]],
                "parts": [len(p["shapes"]) for p in specs],
                "sha256": [p["sha256"] for p in specs],
            }
        self.state = {
            **self.state,
            "next_block": pending.block + 1,
            "blocks": [*self.blocks, pending.record],
            "inputs": spec,
        }
        if world.is_main:
            self._write_state()
            self._wait_deleting()
            stale = [self.inputs_file(pending.block, part) for part in range(old_parts)]
            self._deleting = threading.Thread(
                target=_delete, args=(stale,), name="qtool-delete", daemon=False
            )
            self._deleting.start()

    def _wait_deleting(self) -> None:
        if self._deleting is not None:
            self._deleting.join()
            self._deleting = None

    def _host_copy(self, inputs) -> list[torch.Tensor] | None:
        """`inputs` copied into a pinned host buffer (reused from block to block) when they are on a GPU and the
        buffer takes at most a quarter of the host memory available; else None."""
        from qtool.calibration.store import ActivationStore, available_host

        if isinstance(inputs, ActivationStore) and inputs.place != "device":
            return None  # handing them out would copy each to the device
        xs = [x.detach() for x in inputs]
        if not xs or any(x.device.type != "cuda" for x in xs):
            return None
        sizes = [x.numel() * x.element_size() for x in xs]
        total = sum(sizes)
        if self._pinned is None or self._pinned.numel() < total:
            self._pinned = None
            if total > available_host() // 4:
                return None
            self._pinned = torch.empty(total, dtype=torch.uint8, pin_memory=True)
        out, off = [], 0
        for x, n in zip(xs, sizes, strict=True):
            dst = self._pinned[off : off + n]
            dst.copy_(x.contiguous().reshape(-1).view(torch.uint8), non_blocking=True)
            out.append(dst)
            off += n
        for dev in {x.device for x in xs}:
            torch.cuda.current_stream(dev).synchronize()
        return out

    def _write_state(self) -> None:
        if not self.world.is_main:
            return
        text = json.dumps(self.state, indent=1, sort_keys=True, default=str)
        _atomic_write(self.folder / STATE, lambda p: p.write_text(text, encoding="utf-8"))

    def remove(self) -> None:
        self._wait_deleting()
        shutil.rmtree(self.folder, ignore_errors=True)


def _delete(paths: list[Path]) -> None:
    for p in paths:
        try:
            p.unlink(missing_ok=True)
        except OSError:
            pass  # a file the state does not name: a resumed run removes it


def _write_raw(path: Path, xs) -> str:
    """Write the tensors' bytes one after another; return their sha256."""
    h = hashlib.sha256()
    with open(path, "wb") as f:
        for x in xs:
            data = x.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().data
            h.update(data)
            f.write(data)
    return h.hexdigest()


class _Pending:
    """A committed block whose activations a thread is writing; `wait` re-raises what the thread raised."""

    def __init__(self, block: int, record: dict) -> None:
        self.block, self.record, self.spec = block, record, None
        self.thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._result = None

    def start(self, write) -> None:
        def run() -> None:
            try:
                self._result = write()
            except BaseException as e:  # handed to the main thread by `wait`
                self._error = e

        self.thread = threading.Thread(target=run, name="qtool-activations", daemon=False)
        self.thread.start()

    def wait(self):
        """What the write returned (None when nothing was written by the thread)."""
        if self.thread is not None:
            self.thread.join()
        if self._error is not None:
            raise self._error
        return self._result


class LazyTensors:
    """The finished blocks' tensors by name, each read from its block file when asked for (the writer takes one
    shard's worth at a time), and the `resident` ones (outside the blocks) held in memory."""

    def __init__(self, files: list[Path], resident: dict[str, torch.Tensor]) -> None:
        self._resident = resident
        self._where: dict[str, TensorInfo | None] = dict.fromkeys(resident)
        self.meta: dict[str, torch.Tensor] = {n: t.to("meta") for n, t in resident.items()}
        for f in files:
            for name, info in read_header(f, CheckpointError).items():
                self._where[name] = info
                self.meta[name] = torch.empty(info.shape, dtype=SAFETENSORS_DTYPES[info.dtype], device="meta")

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def nbytes(self, name: str) -> int:
        t = self.meta[name]
        return t.numel() * t.element_size()

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self._resident:
            return self._resident[name]
        info = self._where[name]
        try:
            t = read_tensor(info)
        except OSError as e:
            raise CheckpointError(
                f"tensor {name} ({info.file}): cannot be read ({describe(e)}); expected the work "
                f"folder as this run wrote it"
            ) from None
        check_finite(
            [(name, t)], CheckpointError, self._where
        )  # a packed field of a quantized block is finite
        return t
