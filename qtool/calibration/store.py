"""Where the hidden states between decoder blocks live: on the compute device while they fit, else in host memory,
else on disk, in the dtype they were computed in (the bytes are the same in every place, so a run's numbers do
not depend on where its activations were kept).

The pipeline's estimate (qtool/estimate.py, with `choose_place`) decides the place before the first block; a
perplexity evaluation block by block decides it the same way from the size of its windows.
`QTOOL_ACTIVATION_BUDGET` (a size such as 2GB, or 0) caps the memory the activations may take, on the device and
in host memory: above it they go to the next place.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch

from qtool.errors import UsageError
from qtool.units import available_host, parse_size

PLACES = ("device", "host", "disk")
BUDGET_ENV = "QTOOL_ACTIVATION_BUDGET"


def budget_cap() -> int | None:
    """The cap `QTOOL_ACTIVATION_BUDGET` sets, in bytes (None when unset)."""
    raw = os.environ.get(BUDGET_ENV)
    if raw is None or not raw.strip():
        return None
    try:
        return 0 if raw.strip() == "0" else parse_size(raw)
    except ValueError:
        raise UsageError(f"{BUDGET_ENV}: found {raw!r}, expected a size such as 2GB, or 0") from None


def choose_place(need: int, device: torch.device, device_room: int, host_room: int) -> str:
    """The first place that holds `need` bytes of activations: the device when `device_room` (its memory left
    for them) allows, then host memory (`host_room`), then disk; `QTOOL_ACTIVATION_BUDGET` caps both rooms."""
    cap = budget_cap()
    if cap is not None:
        device_room, host_room = min(device_room, cap), min(host_room, cap)
    if need <= device_room:
        return "device"
    if device.type != "cpu" and need <= host_room:
        return "host"
    return "disk"


class ActivationStore(Sequence):
    """One tensor per sample (or per group of windows), each handed out on the compute device when asked for.
    `place` is where they are kept between uses: "device", "host" (CPU memory) or "disk" (one raw file per
    tensor in `folder`, removed by `close`)."""

    def __init__(
        self, device: torch.device, place: str = "device", folder: Path | None = None, owned: bool = False
    ) -> None:
        """`owned`: `folder` is this store's own, removed by `close`."""
        assert place in PLACES, place
        self.device, self.place = torch.device(device), place
        self._items: list = []
        self._tmp = folder if owned else None
        if place == "disk":
            if folder is None:
                self._tmp = folder = Path(
                    tempfile.mkdtemp(prefix="qtool-activations-", dir=os.environ.get("QTOOL_OFFLOAD_DIR"))
                )
            folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder

    @classmethod
    def for_budget(
        cls, need: int, device: torch.device, folder: Path | None = None, device_room: int | None = None
    ) -> ActivationStore:
        """A store in the first place that holds `need` bytes (`device_room`: what the device may give them;
        default its free memory, or the host's on the CPU)."""
        device = torch.device(device)
        host = available_host()
        if device_room is None:
            device_room = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else host
        return cls(device, choose_place(need, device, device_room, host), folder)

    @property
    def where(self) -> str:
        return self.place

    def __len__(self) -> int:
        return len(self._items)

    def _keep(self, i: int, t: torch.Tensor):
        t = t.detach()
        if self.place == "device":
            return t.to(self.device)
        if self.place == "host":
            return t.to("cpu")
        path = self.folder / f"{i:06d}.bin"
        with open(path, "wb") as f:
            f.write(t.contiguous().cpu().reshape(-1).view(torch.uint8).numpy().data)
        return path, tuple(t.shape), t.dtype

    def append(self, t: torch.Tensor) -> None:
        self._items.append(self._keep(len(self._items), t))

    def put(self, i: int, t: torch.Tensor) -> None:
        """Replace tensor `i` (a block's output over its input)."""
        self._items[i] = None
        self._items[i] = self._keep(i, t)

    def take(self, i: int, device: torch.device | None = None) -> torch.Tensor:
        item = self._items[i]
        if self.place == "disk":
            path, shape, dtype = item
            item = torch.from_file(str(path), shared=False, size=int(torch.Size(shape).numel()), dtype=dtype)
            item = item.view(shape)
        return item.to(device or self.device)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self.take(j) for j in range(len(self))[i]]
        return self.take(i)

    def __iter__(self) -> Iterator[torch.Tensor]:
        for i in range(len(self)):
            yield self.take(i)

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> ActivationStore:
        """fn over every tensor, in place (a block's outputs replace its inputs one sample at a time)."""
        for i in range(len(self)):
            self.put(i, fn(self.take(i)))
        return self

    def close(self) -> None:
        self._items.clear()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
        elif self.folder is not None:
            for p in self.folder.glob("*.bin"):
                p.unlink(missing_ok=True)
