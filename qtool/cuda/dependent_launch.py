"""Programmatic dependent launch (Hopper): a kernel launched here may start while the kernel ahead of it in the
stream is still running, so its launch, its prologue and whatever it reads that the kernel ahead does not write
overlap that kernel's tail. The kernel itself must call `grid_dependency_wait()` (kernels/common/ptx_common.cuh) before it
reads anything the kernel ahead writes; the kernel ahead may call `launch_dependents()` to let it start early.

CuPy launches without launch attributes, so this goes through the driver's `cuLaunchKernelEx` with the
programmatic-stream-serialization attribute. Where the driver lacks it or refuses the launch, the kernel is
launched the ordinary way (the wait is then a no-op) and the attribute is not tried again.
"""

from __future__ import annotations

import ctypes
import math
from typing import Any

import torch

from qtool.cuda import compile as cc
from qtool.cuda.tma import TensorMap

_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
_CLUSTER_DIMENSION = 4  # CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14  # CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED
PORTABLE_CLUSTER = 8  # larger clusters (up to 16 on Hopper) need the non-portable attribute


class _Attribute(ctypes.Structure):
    # CUlaunchAttribute: the id, padding to 8 bytes, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class _Config(ctypes.Structure):
    # CUlaunchConfig
    _fields_ = [
        ("grid_x", ctypes.c_uint),
        ("grid_y", ctypes.c_uint),
        ("grid_z", ctypes.c_uint),
        ("block_x", ctypes.c_uint),
        ("block_y", ctypes.c_uint),
        ("block_z", ctypes.c_uint),
        ("shared_mem", ctypes.c_uint),
        ("stream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(_Attribute)),
        ("num_attrs", ctypes.c_uint),
    ]


_STATE: dict[str, Any] = {
    "fn": None,
    "ok": True,
    "why": "",
    "cluster_max": 16,
    "cluster_why": "",
    "set_attr": None,
}
_NON_PORTABLE: set[int] = set()
# The quik and grouped_int kernels and the decode step's fused kernels (norm, rotary, attention, SwiGLU) start as
# programmatic dependents of the kernel ahead; False launches them the ordinary way (the tests' and the bench's A/B).
ENABLED = True


def _driver_launch() -> Any:
    if _STATE["fn"] is None and _STATE["ok"]:
        try:
            fn = ctypes.CDLL("libcuda.so.1").cuLaunchKernelEx
        except (OSError, AttributeError) as exc:
            _STATE.update(ok=False, why=f"no cuLaunchKernelEx in the driver ({exc})")
            return None
        fn.restype = ctypes.c_int
        fn.argtypes = [
            ctypes.POINTER(_Config),
            ctypes.c_void_p,
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.c_void_p,
        ]
        _STATE["fn"] = fn
    return _STATE["fn"]


def _plain(args: tuple) -> tuple:
    return tuple(a.arg if isinstance(a, TensorMap) else a for a in args)


def _function_handle(kernel: Any) -> int | None:
    """The CUfunction behind a CuPy kernel (a RawKernel holds it as `.kernel.ptr`, a module Function as `.ptr`)."""
    for obj in (kernel, getattr(kernel, "kernel", None)):
        ptr = getattr(obj, "ptr", None)
        if isinstance(ptr, int) and ptr:
            return ptr
    _STATE.update(ok=False, why=f"no CUfunction handle on {type(kernel).__name__}")
    return None


def available() -> bool:
    """Whether dependent launches are still tried (False after the driver lacked or refused one)."""
    return bool(_STATE["ok"])


def fallback_reason() -> str:
    return str(_STATE["why"])


# The one attribute every dependent launch carries: programmatic stream serialization allowed.
_ATTRIBUTE = _Attribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION)
_ATTRIBUTE.value[0] = 1


def cluster_limit() -> int:
    """The largest cluster still tried: 16 (Hopper's non-portable maximum) until the driver refuses one, then 8
    (the portable size) or 1 (none) after a portable one was refused."""
    return int(_STATE["cluster_max"])


def _cluster_refused(size: int, why: str) -> None:
    _STATE.update(cluster_max=PORTABLE_CLUSTER if size > PORTABLE_CLUSTER else 1, cluster_why=why)


def cluster_fallback_reason() -> str:
    return str(_STATE["cluster_why"])


def _allow_non_portable(handle: int) -> bool:
    if handle in _NON_PORTABLE:
        return True
    if _STATE["set_attr"] is None:
        fn = ctypes.CDLL("libcuda.so.1").cuFuncSetAttribute
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
        _STATE["set_attr"] = fn
    rc = _STATE["set_attr"](ctypes.c_void_p(handle), _NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1)
    if rc != 0:
        return False
    _NON_PORTABLE.add(handle)
    return True


def launch(
    kernel: Any,
    grid: tuple[int, ...],
    block: tuple[int, ...],
    args: tuple,
    shared_mem: int = 0,
    device: int | None = None,
    dependent: bool | None = None,
    cluster: tuple[int, int, int] | None = None,
) -> None:
    """`compile.launch`, with the programmatic-stream-serialization attribute where the driver takes it and
    `dependent` (by default ENABLED) asks for it, and in thread-block clusters of `cluster` (x, y, z) blocks where
    given (each grid dimension a multiple of it). `args` are numpy scalars (what `compile.ptr` and `compile.i32`
    give) or tensor maps (`tma.TensorMap`, passed by value: the driver copies their 128 bytes). A cluster launch
    the driver refuses runs as an ordinary launch: a kernel launched in clusters must also work without them."""
    want_dep = (ENABLED if dependent is None else dependent) and _STATE["ok"]
    if cluster is not None and not 1 < math.prod(cluster) <= _STATE["cluster_max"]:
        cluster = None
    fn = _driver_launch() if want_dep or cluster is not None else None
    handle = _function_handle(kernel) if fn is not None else None
    if handle is None:
        cc.launch(kernel, grid, block, _plain(args), shared_mem=shared_mem, device=device)
        return
    dev = torch.cuda.current_device() if device is None else device
    g = tuple(grid) + (1,) * (3 - len(grid))
    b = tuple(block) + (1,) * (3 - len(block))
    attrs = [_ATTRIBUTE] if want_dep else []
    if cluster is not None:
        if math.prod(cluster) > PORTABLE_CLUSTER and not _allow_non_portable(handle):
            _cluster_refused(math.prod(cluster), f"non-portable cluster of {math.prod(cluster)} refused")
            launch(kernel, grid, block, args, shared_mem, device, dependent)
            return
        c = _Attribute(id=_CLUSTER_DIMENSION)
        c.value[0], c.value[1], c.value[2] = (tuple(cluster) + (1, 1))[:3]
        attrs.append(c)
    arr = (_Attribute * len(attrs))(*attrs)
    cfg = _Config(
        g[0],
        g[1],
        g[2],
        b[0],
        b[1],
        b[2],
        shared_mem,
        ctypes.c_void_p(torch.cuda.current_stream(dev).cuda_stream),
        arr,
        len(attrs),
    )
    values = [None if isinstance(a, TensorMap) else ctypes.create_string_buffer(a.tobytes()) for a in args]
    params = (ctypes.c_void_p * len(args))(
        *[a.address if v is None else ctypes.addressof(v) for a, v in zip(args, values, strict=True)]
    )
    with torch.cuda.device(dev):  # the driver launches in the current context
        rc = fn(ctypes.byref(cfg), ctypes.c_void_p(handle), params, None)
    if rc != 0:
        if cluster is not None:  # the cluster is what a launch that got this far most likely lacks
            _cluster_refused(
                math.prod(cluster), f"cuLaunchKernelEx with cluster {cluster} returned CUresult {rc}"
            )
            launch(kernel, grid, block, args, shared_mem, device, dependent)
            return
        # CUDA_ERROR_NOT_SUPPORTED and the like: the ordinary launch runs the same kernel (and reports a real
        # argument error itself)
        _STATE.update(ok=False, why=f"cuLaunchKernelEx returned CUresult {rc}")
        cc.launch(kernel, grid, block, _plain(args), shared_mem=shared_mem, device=device)
