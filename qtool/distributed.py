"""Data-parallel quantization over several processes (`torchrun --nproc-per-node N` or `accelerate launch`, one
process per GPU): every rank runs the same block on its share of the calibration samples, and what a block's
stages accumulate over samples is combined here, so each rank computes what one process seeing every sample would.

- Sums and maxima of per-linear statistics (token counts, Hessians, mean squares, max |x|): `all_reduce`.
- Tensors captured per sample (inputs of a linear for smoothing, keys and values for k-means): `gather`, in
  sample order, so a stage that fits on them sees exactly the single-process list.
- Quantized weights (`plan`, `share_rows`): the linears of a group go to the ranks in whole rounds, one linear
  per rank; each of the rest (all of a group of one, such as o_proj or down_proj) goes to a team of ranks that
  split its output rows, when its stage solves rows apart (GPTQ and the stages built on it: every row is solved
  with the same Hessian, column order and inverse-Hessian factor, and its own group scales and zeros; what a
  stage chooses from the whole matrix, every rank of the team chooses alike), else to the team's first rank.
  Each rank's dequantized rows are sent to every rank and its packed rows to rank 0, which joins them in row
  order and writes. The packed rows travel from a thread of each rank over a gloo group of their own
  (`_Courier`), while the ranks go on with the block; rank 0 takes them when it writes the block (`collect`).
  The whole block is then sent from rank 0 (`sync_module`), so every rank goes on with bit-identical weights.

Tensors go over the process group's backend (NCCL on GPUs); objects and waits over a gloo group of their own.

Samples are split in contiguous ranges, the first `n % world` ranks taking one more (`share`): rank order is
sample order, so gathered lists need no reordering.

Failures: each rank beats a counter in the rendezvous store once a second from a thread of its own; a rank whose
counter stops for `QTOOL_DIST_TIMEOUT` seconds (default 60) is taken for dead, and a rank that fails posts its
error there. The others then stop with one line naming the rank (the collective they wait in may never return on
NCCL, so the watching thread ends the process when the main thread cannot). The process group's own timeout is
long (rank 0 alone evaluates and writes while the others wait), death is what the heartbeats detect.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import queue
import sys
import threading
import time
from concurrent.futures import Future
from contextlib import contextmanager
from datetime import timedelta

import torch
from torch import nn

from qtool.errors import EXIT_CODES, EXIT_RESOURCE, QtoolError, ResourceError, UsageError

TIMEOUT_ENV = "QTOOL_DIST_TIMEOUT"
DEFAULT_TIMEOUT = 60.0
BEAT_SECONDS = 1.0
GRACE_SECONDS = 5.0  # after a peer is found dead: time the main thread has to stop on its own
GROUP_TIMEOUT = timedelta(hours=24)
JOIN_SECONDS = 300.0
# A linear split by rows is split at multiples of 16 rows, so each slice's matrix products run on whole 16-row
# tiles, as the whole matrix's do (and a GPU layout's 16-row tiles are never cut).
ROW_ALIGN = 16


def launched() -> bool:
    """Whether this process was started by a launcher of ranks (torchrun, accelerate launch): it then joins
    their process group, even a group of one."""
    return all(os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def env_rank() -> int:
    return int(os.environ.get("RANK", "0") or 0)


def local_rank() -> int | None:
    raw = os.environ.get("LOCAL_RANK")
    return int(raw) if raw not in (None, "") and launched() else None


def heartbeat_timeout() -> float:
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise UsageError(f"{TIMEOUT_ENV}: found {raw!r}, expected a number of seconds > 0")
    return value


class World:
    """This process's place among the ranks; outside a process group (`joined` false) every operation is the
    identity."""

    def __init__(
        self, rank: int = 0, size: int = 1, device: torch.device | None = None, joined: bool = False
    ) -> None:
        self.rank, self.size, self.joined = rank, size, joined
        self.device = device  # where NCCL's tensors must be (None: gloo, tensors on the CPU)
        self.ctl = None  # a gloo group for objects and waits (None: the default group is gloo)
        self.courier: _Courier | None = None  # packed layouts to rank 0, in the background
        self.monitor: _Monitor | None = None
        self.store = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # ---- splitting the work -----------------------------------------------------------------------------------

    def share(self, n: int) -> range:
        """The samples of this rank: a contiguous range, the first n % size ranks taking one more."""
        base, extra = divmod(n, self.size)
        start = self.rank * base + min(self.rank, extra)
        return range(start, start + base + (self.rank < extra))

    def teams(self, m: int) -> list[range]:
        """The ranks that solve each of the `m` linears of a group: whole rounds of one linear per rank (linear j
        on rank j mod size), then each of the last m mod size linears on a team of consecutive ranks, the teams
        as even as possible (all ranks on one linear when the group has one)."""
        rounds, rest = divmod(m, self.size)
        out = [range(j % self.size, j % self.size + 1) for j in range(rounds * self.size)]
        base, extra = divmod(self.size, rest) if rest else (0, 0)
        at = 0
        for i in range(rest):
            out.append(range(at, at + base + (i < extra)))
            at += base + (i < extra)
        return out

    def rows(self, n: int, granularity: int = 1, parts: int | None = None) -> list[range]:
        """An `n`-row linear's rows split in `parts` (default: the world size) contiguous ranges in order, as even
        as whole units of lcm(ROW_ALIGN, `granularity`) rows allow (the last range takes the remainder; a range
        may be empty when `n` is small)."""
        parts = parts or self.size
        unit = math.lcm(ROW_ALIGN, granularity)
        base, extra = divmod(-(-n // unit), parts)
        out, at = [], 0
        for r in range(parts):
            units = base + (r < extra)
            out.append(range(min(at * unit, n), min((at + units) * unit, n)))
            at += units
        return out

    def plan(self, linears: list[tuple[int, int | None]]) -> list[list[range]]:
        """For each linear of a group, given as (output rows, row granularity of its stage or None when its rows
        are solved together), the rows each rank solves: on its team (`teams`), split by `rows` when the stage
        allows, else whole on the team's first rank. GPTQ's column loop takes as many steps for a slice as for
        the whole matrix, so rows are split only over ranks that would otherwise have no linear of the group."""
        out = []
        for (n, granularity), team in zip(linears, self.teams(len(linears)), strict=True):
            ranges = [range(0)] * self.size
            if granularity is None or len(team) == 1:
                ranges[team.start] = range(n)
            else:
                for r, rows in zip(team, self.rows(n, granularity, len(team)), strict=True):
                    ranges[r] = rows
            out.append(ranges)
        return out

    # ---- collectives ------------------------------------------------------------------------------------------

    def _call(self, fn, *args, **kwargs):
        import torch.distributed as dist

        try:
            return fn(*args, **kwargs)
        except (RuntimeError, dist.DistError) as e:
            raise self._lost(e) from None

    def _lost(self, e: BaseException) -> QtoolError:
        """The error to raise when a collective failed: the peer the heartbeats found stopped, once they have."""
        monitor = self.monitor
        end = time.monotonic() + (monitor.timeout + 2 * BEAT_SECONDS if monitor else 0)
        while monitor is not None and monitor.reason is None and time.monotonic() < end:
            time.sleep(0.1)
        if monitor is not None and monitor.reason is not None:
            monitor.handled = True
            return monitor.error()
        return ResourceError(
            f"rank {self.rank}: a collective operation with the other ranks failed "
            f"({str(e).splitlines()[0] if str(e) else type(e).__name__})"
        )

    def _dev(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.device is None or t.device == self.device else t.to(self.device)

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """`t` reduced over the ranks (sum or max), in place when it is on the backend's device."""
        if not self.joined:
            return t
        import torch.distributed as dist

        x = self._dev(t)
        self._call(dist.all_reduce, x, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])
        if x is not t:
            t.copy_(x)
        return t

    def gather(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Every rank's list of tensors (one dtype), concatenated in rank order (= sample order), on every rank."""
        if not self.joined:
            return tensors
        import torch.distributed as dist

        dtype, device = tensors[0].dtype, tensors[0].device
        shapes = self.all_gather_object([tuple(t.shape) for t in tensors])
        sizes = [sum(int(torch.Size(s).numel()) for s in part) for part in shapes]
        flat = torch.zeros(max(sizes), dtype=dtype, device=self.device or "cpu")
        if tensors:
            mine = torch.cat([t.reshape(-1) for t in tensors])
            flat[: mine.numel()] = mine.to(flat.device)
        parts = [torch.empty_like(flat) for _ in range(self.size)]
        self._call(dist.all_gather, parts, flat)
        out: list[torch.Tensor] = []
        for part, part_shapes in zip(parts, shapes, strict=True):
            at = 0
            for s in part_shapes:
                n = int(torch.Size(s).numel())
                out.append(part[at : at + n].view(s).to(device))
                at += n
        return out

    def all_gather_object(self, obj) -> list:
        if not self.joined:
            return [obj]
        import torch.distributed as dist

        got: list = [None] * self.size
        self._call(dist.all_gather_object, got, obj, group=self.ctl)
        return got

    def broadcast_object(self, obj, src: int = 0):
        """`obj` of rank `src` on every rank; tensors in it come back on this rank's compute device."""
        if not self.joined:
            return obj
        import torch.distributed as dist

        return self._object(obj, src, lambda t: self._call(dist.broadcast, t, src, group=self.ctl))

    def _object(self, obj, src: int, move, device: torch.device | str | None = None):
        """`obj` (torch.save'd, so tensors keep their dtype) moved by `move` from rank `src`: size, then bytes;
        received tensors go to `device` (default: this rank's compute device)."""
        if self.rank == src:
            buf = io.BytesIO()
            torch.save(obj, buf)
            data = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
            size = torch.tensor([data.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        move(size)
        if self.rank != src:
            data = torch.empty(int(size[0]), dtype=torch.uint8)
        move(data)
        if self.rank == src:
            return obj
        return torch.load(
            io.BytesIO(data.numpy().tobytes()),
            map_location=device or self.device or "cpu",
            weights_only=False,
        )

    def broadcast(self, t: torch.Tensor, src: int = 0) -> None:
        """`t` (same shape and dtype on every rank) set to rank `src`'s values, in place."""
        if not self.joined:
            return
        import torch.distributed as dist

        x = self._dev(t)
        self._call(dist.broadcast, x, src)
        if x is not t:
            t.copy_(x)

    def sync_module(self, module: nn.Module, src: int = 0) -> None:
        """Every parameter and buffer of `module` set to rank `src`'s."""
        for t in [*module.parameters(), *module.buffers()]:
            self.broadcast(t.data, src)

    def share_rows(self, ranges: list[range], result, shape: tuple[int, ...]):
        """A quantizer's result solved by rows, rank r's `result` holding the rows `ranges[r]` of the weight (None
        where its range is empty): the dequantized weight (float32 of `shape`) on every rank, each slice sent from
        its rank; the packed layout on rank 0 (None on the others), its slices joined in row order by the
        layout's `concat_rows`."""
        if not self.joined:
            return result
        from qtool.stages.base import QuantResult  # stages sit above this module

        weight = torch.empty(shape, dtype=torch.float32, device=self.device or "cpu")
        for src, rows in enumerate(ranges):
            if len(rows):
                part = weight[rows.start : rows.stop]
                if self.rank == src:
                    part.copy_(result.dequantized)
                self.broadcast(part, src)
        # Packed layouts are kept on the host (rank 0's own parts are there): the others' parts come there too,
        # by the courier; rank 0 gets a promise of the joined layout (`collect`).
        if not self.is_main:
            if len(ranges[self.rank]):
                self.courier.send(result.packed)
            return QuantResult(None, weight)
        pieces = [
            result.packed if src == 0 else self.courier.expect(src)
            for src, rows in enumerate(ranges)
            if len(rows)
        ]
        return QuantResult(_Joined(pieces), weight)

    def collect(self, packed: dict) -> dict:
        """`packed` (layouts by name, as `share_rows` gave them to rank 0) with every layout whose row slices were
        still on their way joined: waits for them."""
        if not self.joined or not self.is_main:
            return packed
        return {
            name: layout.join(self) if isinstance(layout, _Joined) else layout
            for name, layout in packed.items()
        }

    def barrier(self) -> None:
        if self.joined:
            self.all_gather_object(None)

    # ---- agreement --------------------------------------------------------------------------------------------

    def check_same(self, what: dict) -> None:
        """Refuse (on every rank, naming the first rank that differs from rank 0) ranks started with different
        recipes, models or options."""
        digest = hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()
        digests = self.all_gather_object(digest)
        differ = [r for r, d in enumerate(digests) if d != digests[0]]
        if differ:
            raise UsageError(
                f"rank {differ[0]}: its recipe, model config or options differ from rank 0's (sha256 "
                f"{digests[differ[0]][:12]} against {digests[0][:12]}); expected every rank started "
                f"with the same command"
            )


class _Joined:
    """Rank 0's promise of a layout solved by rows on several ranks: its slices in row order, each a layout or a
    Future of the courier."""

    def __init__(self, pieces: list) -> None:
        self.pieces = pieces

    def join(self, world: World):
        parts = []
        for p in self.pieces:
            if isinstance(p, Future):
                try:
                    p = p.result()
                except (RuntimeError, OSError) as e:
                    raise world._lost(e) from None
            parts.append(p)
        return parts[0] if len(parts) == 1 else type(parts[0]).concat_rows(parts)


class _Courier(threading.Thread):
    """Sends this rank's packed layouts to rank 0 (or, on rank 0, receives them) over a gloo group that nothing
    else uses, in the order the main thread hands them over, so the transfer overlaps the block's next
    statistics: on 4 GPUs rank 0 took each slice in turn while every rank waited, 4-6 s of a 7B run."""

    def __init__(self, world: World, group) -> None:
        super().__init__(daemon=True, name="qtool-courier")
        self.world, self.group = world, group
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.start()

    def send(self, obj) -> None:
        self.jobs.put((obj, None, None))

    def expect(self, src: int) -> Future:
        done: Future = Future()
        self.jobs.put((None, src, done))
        return done

    def close(self) -> None:
        """Wait until everything handed over has been sent (or received)."""
        self.jobs.put(None)
        self.join()

    def run(self) -> None:
        import torch.distributed as dist

        failed: BaseException | None = None
        while (job := self.jobs.get()) is not None:
            obj, src, done = job
            if failed is not None:
                if done is not None:
                    done.set_exception(failed)
                continue
            try:
                if done is None:
                    self.world._object(obj, self.world.rank, lambda t: dist.send(t, 0, group=self.group))
                else:
                    done.set_result(
                        self.world._object(
                            None, src, lambda t, src=src: dist.recv(t, src, group=self.group), "cpu"
                        )
                    )
            except (RuntimeError, OSError, dist.DistError) as e:  # a peer is gone: the main thread finds out
                failed = e
                if done is not None:
                    done.set_exception(e)


_WORLD = World()
# What the run's error path would clean up (the output's temporary folder), run by the heartbeat thread when it
# ends a process whose main thread cannot stop (`on_abort`).
_ABORT_HOOKS: list = []


@contextmanager
def on_abort(fn):
    """Run `fn` if the heartbeat thread ends this process (a peer died while this rank's main thread waits where
    it cannot raise, such as an NCCL collective)."""
    _ABORT_HOOKS.append(fn)
    try:
        yield
    finally:
        _ABORT_HOOKS.remove(fn)


def current() -> World:
    return _WORLD


def describe_device(device: torch.device) -> torch.device:
    """The compute device of this rank: cuda becomes cuda:LOCAL_RANK under a launcher."""
    lr = local_rank()
    if lr is None or device.type != "cuda":
        return device
    if device.index not in (None, lr):
        raise UsageError(
            f"settings.device: found '{device}' under a launcher with several processes; expected "
            f"cuda or auto (rank {env_rank()} takes cuda:{lr}, its LOCAL_RANK)"
        )
    return torch.device("cuda", lr)


@contextmanager
def session(device: torch.device):
    """The world of this process for the duration of a run: joined when started by a launcher (NCCL when
    `device` is CUDA, else gloo), left at the end; an error on this rank is posted for the others."""
    global _WORLD
    if not launched():
        yield _WORLD
        return
    world = _join(device)
    _WORLD = world
    try:
        yield world
    except BaseException as e:
        from qtool.failure import one_line

        code = getattr(e, "exit_code", EXIT_RESOURCE)
        world.monitor.post_failure(code, one_line(str(e)) or type(e).__name__)
        raise
    else:
        world.courier.close()
        world.barrier()
        world.monitor.stop(done=True)
        import torch.distributed as dist

        dist.destroy_process_group()
    finally:
        _WORLD = World()


def _prefix() -> str:
    # A launcher that restarts its workers keeps its store: each attempt has keys of its own.
    return f"qtool/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def _join(device: torch.device) -> World:
    import torch.distributed as dist

    timeout = heartbeat_timeout()
    rank, size = env_rank(), int(os.environ["WORLD_SIZE"])
    nccl = device.type == "cuda"
    if nccl:
        torch.cuda.set_device(device)
    # A rank that never arrives is not watched by any heartbeat yet: the rendezvous waits a bounded time.
    store, rank, size = next(
        dist.rendezvous("env://", rank, size, timeout=timedelta(seconds=max(5 * timeout, JOIN_SECONDS)))
    )
    store = dist.PrefixStore(_prefix(), store)
    dist.init_process_group(
        "nccl" if nccl else "gloo",
        store=dist.PrefixStore("pg", store),
        rank=rank,
        world_size=size,
        timeout=GROUP_TIMEOUT,
        **({"device_id": device} if nccl else {}),
    )
    world = World(rank, size, device if nccl else None, joined=True)
    world.ctl = dist.new_group(backend="gloo", timeout=GROUP_TIMEOUT) if nccl else None
    world.courier = _Courier(world, dist.new_group(backend="gloo", timeout=GROUP_TIMEOUT))
    world.store = store
    world.monitor = _Monitor(rank, size, timeout)
    world.monitor.start()
    return world


class _Monitor(threading.Thread):
    """Beats this rank's counter and watches the others' (and their posted failures) over its own connection to
    the rendezvous store."""

    def __init__(self, rank: int, size: int, timeout: float) -> None:
        super().__init__(daemon=True, name="qtool-heartbeat")
        import torch.distributed as dist

        self.rank, self.size, self.timeout = rank, size, timeout
        self.store = dist.PrefixStore(
            _prefix(),
            dist.TCPStore(
                os.environ["MASTER_ADDR"],
                int(os.environ["MASTER_PORT"]),
                is_master=False,
                timeout=timedelta(seconds=max(timeout, 30)),
                wait_for_workers=False,
            ),
        )
        self.reason: str | None = None
        self.code = EXIT_RESOURCE
        self.handled = False
        self._stopped = threading.Event()
        self.store.add(f"beat/{rank}", 1)

    def error(self) -> QtoolError:
        e = QtoolError(self.reason)
        e.exit_code = self.code
        e.kind = {code: kind for kind, code in EXIT_CODES.items()}.get(self.code, "resource")
        return e

    def post_failure(self, code: int, message: str) -> None:
        if self.reason is not None:
            return  # this rank stops because another did: that one posted
        try:
            self.store.set(f"failed/{self.rank}", f"{code}|{message}")
        except RuntimeError:
            pass
        self.stop(done=False)

    def stop(self, done: bool) -> None:
        if done:
            try:
                self.store.set(f"done/{self.rank}", "1")
            except RuntimeError:
                pass
        self._stopped.set()

    def run(self) -> None:
        others = [r for r in range(self.size) if r != self.rank]
        seen = {r: (-1, time.monotonic()) for r in others}
        while not self._stopped.wait(BEAT_SECONDS):
            try:
                self.store.add(f"beat/{self.rank}", 1)
                for r in others:
                    if self.store.check([f"failed/{r}"]):
                        code, _, message = self.store.get(f"failed/{r}").decode().partition("|")
                        self.code = int(code) if code.isdigit() else EXIT_RESOURCE
                        self._give_up(f"rank {r} stopped: {message}")
                        return
                    if self.store.check([f"done/{r}"]):
                        continue
                    count = self.store.add(f"beat/{r}", 0)
                    now = time.monotonic()
                    if count != seen[r][0]:
                        seen[r] = (count, now)
                    elif now - seen[r][1] > self.timeout:
                        self._give_up(
                            f"rank {r} sent no heartbeat for {self.timeout:g} s (its process died or "
                            f"hangs); stopping rank {self.rank} ({TIMEOUT_ENV} sets the timeout)"
                        )
                        return
            except RuntimeError as e:  # the store itself is gone: its host (the launcher or rank 0) stopped
                if self._stopped.is_set():
                    return
                self._give_up(
                    f"rank {self.rank} lost the rendezvous store ({str(e).splitlines()[0]}): the launcher "
                    f"or rank 0 stopped"
                )
                return

    def _give_up(self, reason: str) -> None:
        self.reason = reason
        # The main thread stops on its own when its collective fails (gloo); one blocked in NCCL never returns, nor
        # does one that took the error but then waits for the GPU behind an NCCL kernel that waits for the dead
        # peer. The process is ended here once the main thread had its time (more when it is on its way out).
        if self._stopped.wait(GRACE_SECONDS):
            return
        if self.handled and self._stopped.wait(GRACE_SECONDS):
            return
        for fn in list(_ABORT_HOOKS):
            try:
                fn()
            except Exception:  # leaving anyway: a leftover is refused, naming it, by the next run
                pass
        sys.stderr.write(f"qtool: error: {reason}\n")
        sys.stderr.flush()
        os._exit(self.code)
