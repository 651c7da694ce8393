"""Build `kernels/` sources with NVRTC through CuPy, cache the binaries on disk, and launch on torch's stream.

* Hopper (compute capability 9.0) builds for `sm_90a` so `wgmma`/`setmaxnreg` are available; other cards build
  for their own `sm_XY`.
* A source is named by its path relative to kernels/ (`"quik/gemm.cu"`), and so is every header it may include
  (`#include "common/ptx_common.cuh"`): NVRTC gets every `*.cuh` under kernels/ by that name.
* The cache key is a hash of the source, the headers, the options, the target architecture, the device name and
  the NVRTC version; binaries live in `$QTOOL_CACHE_DIR` or `~/.cache/qtool/kernels` and are written atomically.
* Tensors are passed zero-copy as raw device pointers; launches go to `torch.cuda.current_stream()` so they
  order correctly with torch work and are recorded by CUDA-graph capture.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from qtool.errors import ResourceError
from qtool.resources import kernels_dir

REFERENCE_HINT = "use the torch reference path instead (QTOOL_KERNELS=reference, or run on CPU)"


class CudaUnavailableError(ResourceError):
    """The CUDA kernel path was asked for but cannot run here."""


def require_cupy() -> Any:
    """Import cupy, or fail with one line naming the reference path as the alternative."""
    if not torch.cuda.is_available():
        raise CudaUnavailableError(f"CUDA kernels unavailable: torch sees no CUDA GPU; {REFERENCE_HINT}")
    try:
        import cupy  # deliberately lazy: nothing imports cupy at package import
    except Exception as exc:  # ImportError, or a cupy built for another CUDA failing to load its libraries
        raise CudaUnavailableError(
            f"CUDA kernels unavailable: cannot import cupy ({type(exc).__name__}: {exc}); install cupy-cuda12x or "
            f"cupy-cuda13x to match your CUDA, or {REFERENCE_HINT}"
        ) from None
    return cupy


_AVAILABLE: bool | None = None


def kernel_mode() -> str:
    """`QTOOL_KERNELS`: auto (kernels when usable, else reference), cuda (kernels or a one-line error), reference."""
    mode = os.environ.get("QTOOL_KERNELS", "auto").strip().lower()
    if mode not in ("auto", "cuda", "reference"):
        raise CudaUnavailableError(f"QTOOL_KERNELS: found {mode!r}, expected one of auto, cuda, reference")
    return mode


def env_int(name: str, default: int) -> int:
    """An integer setting from the environment (docs/environment.md lists every one); a value that is not an
    integer is a one-line error rather than silently the default."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise CudaUnavailableError(
            f"{name}: found {raw!r}, expected an integer (default {default})"
        ) from None


def use_kernels(layout: str, reason: str | None) -> bool:
    """Whether a layer of `layout` runs its CUDA kernels: `reason` says why it cannot (None when it can). Under
    QTOOL_KERNELS=cuda every fallback is a one-line error naming the layout and the reason instead."""
    mode = kernel_mode()
    if mode == "reference":
        return False
    if reason is not None:
        if mode == "cuda":
            raise CudaUnavailableError(f"{layout} layer: {reason}; {REFERENCE_HINT}")
        return False
    if mode == "cuda":
        require_cupy()
        return True
    return cupy_available()


def cupy_available() -> bool:
    """Whether the kernel path can run (answer cached: a failed import is slow to repeat)."""
    global _AVAILABLE
    if _AVAILABLE is None:
        try:
            require_cupy()
            _AVAILABLE = True
        except CudaUnavailableError:
            _AVAILABLE = False
    return _AVAILABLE


_ARCHS: dict[int, str] = {}


def device_index(device: torch.device) -> int:
    """The ordinal of a CUDA device ("cuda" without an index means the current one)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def check_f16(name: str, t: torch.Tensor, aligned: bool = False) -> None:
    """One-line error naming `name` unless `t` is a contiguous float16 CUDA tensor (with a 16-byte aligned start
    when `aligned`: the kernels' 16-byte loads)."""
    if t.dtype != torch.float16 or not t.is_cuda or not t.is_contiguous() or (aligned and t.data_ptr() % 16):
        raise ValueError(
            f"{name}: found {t.dtype} {list(t.shape)} on {t.device} (contiguous: {t.is_contiguous()}), "
            f"expected contiguous {'16-byte aligned ' if aligned else ''}float16 on CUDA"
        )


def f16_rows(x: torch.Tensor, in_features: int, layout: str) -> torch.Tensor:
    """`x` [..., in_features] float16 as contiguous rows [T, in_features] starting 16-byte aligned (the kernels'
    16-byte loads), copied only when it is not; one-line errors naming `x` otherwise."""
    if x.dtype != torch.float16:
        raise ValueError(f"x: found {x.dtype}, expected torch.float16 for the {layout} kernels")
    if x.shape[-1] != in_features:
        raise ValueError(f"x: found last dim {x.shape[-1]}, expected in_features={in_features}")
    x2 = x.reshape(-1, in_features).contiguous()
    return x2.clone() if x2.data_ptr() % 16 else x2


def f16_out(
    out: torch.Tensor | None, shape: tuple[int, ...], device: torch.device, aligned: bool = False
) -> torch.Tensor:
    """A kernel's float16 output: `out` checked against `shape` (one-line error), or a new tensor."""
    shape = tuple(shape)
    if out is None:
        return torch.empty(shape, dtype=torch.float16, device=device)
    if (
        out.dtype != torch.float16
        or tuple(out.shape) != shape
        or not out.is_contiguous()
        or (aligned and out.data_ptr() % 16)
    ):
        raise ValueError(
            f"out: found {out.dtype} {list(out.shape)}, expected contiguous "
            f"{'16-byte aligned ' if aligned else ''}float16 {list(shape)}"
        )
    return out


def target_arch(device: torch.device | int | None = None) -> str:
    """NVRTC target of a CUDA device (cached: the dispatch asks on every call)."""
    if device is None:
        idx = torch.cuda.current_device()
    elif isinstance(device, torch.device):
        idx = device_index(device)
    else:
        idx = int(device)
    arch = _ARCHS.get(idx)
    if arch is None:
        major, minor = torch.cuda.get_device_capability(idx)
        arch = "sm_90a" if (major, minor) == (9, 0) else f"sm_{major}{minor}"
        _ARCHS[idx] = arch
    return arch


_SMS: dict[int, int] = {}


def sm_count(device: int) -> int:
    """Multiprocessors of a device (cached: grid sizes ask on every launch)."""
    if device not in _SMS:
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SMS[device]


_RESIDENT: dict[tuple[int, int, int, int], int] = {}


def resident_blocks(fn: Any, threads: int, smem: int, device: int, cap: int = 8) -> int:
    """Blocks of `threads` threads and `smem` bytes of dynamic shared memory that fit on one multiprocessor at
    once, by threads, registers and shared memory (cached per kernel), at most `cap`."""
    key = (id(fn), threads, smem, device)
    if key not in _RESIDENT:
        props = torch.cuda.get_device_properties(device)
        regs = (int(fn.num_regs) + 7) // 8 * 8  # registers are allocated 256 per warp
        _RESIDENT[key] = max(
            1,
            min(
                cap,
                2048 // threads,
                65536 // max(1, regs * threads),
                int(props.shared_memory_per_multiprocessor) // (smem + 1024),
            ),
        )
    return _RESIDENT[key]


def cache_dir() -> Path:
    root = os.environ.get("QTOOL_CACHE_DIR")
    path = Path(root) if root else Path.home() / ".cache" / "qtool" / "kernels"
    path.mkdir(parents=True, exist_ok=True)
    return path


@dataclass
class BuildInfo:
    source: str
    arch: str
    key: str
    path: str | None  # cubin on disk, or None when CuPy's own cache was used
    from_cache: bool
    how: str  # "nvrtc-cubin" or "cupy-rawmodule"


class KernelModule:
    """One compiled `kernels/<family>/<name>.cu` on one device; `fn(name)` returns a launchable kernel."""

    def __init__(self, raw_module: Any, info: BuildInfo) -> None:
        self._raw = raw_module
        self._fns: dict[str, Any] = {}
        self.info = info

    def fn(self, name: str) -> Any:
        f = self._fns.get(name)
        if f is None:
            f = self._raw.get_function(name)
            self._fns[name] = f
        return f


_MODULES: dict[tuple[str, int, tuple[str, ...]], KernelModule] = {}
_LOCK = threading.Lock()
_BASE_OPTIONS = ("-std=c++17",)


def _nvrtc_version(cupy: Any) -> str:
    try:
        from cupy.cuda import nvrtc

        return ".".join(str(v) for v in nvrtc.getVersion())
    except Exception:
        return "unknown"


def _headers() -> dict[str, str]:
    """Every header under kernels/ (`*.cuh`, any depth) by its path relative to kernels/, the name the sources
    include it by: handed to NVRTC with every source, part of the cache key."""
    root = kernels_dir()
    return {p.relative_to(root).as_posix(): p.read_text() for p in sorted(root.rglob("*.cuh"))}


def _compile_cubin(
    cupy: Any, source: str, name: str, options: tuple[str, ...], headers: dict[str, str]
) -> bytes:
    from cupy.cuda import nvrtc

    try:
        prog = nvrtc.createProgram(source, name, tuple(headers.values()), tuple(headers.keys()))
    except TypeError:  # CuPy 14 takes the headers and their names as bytes
        prog = nvrtc.createProgram(
            source,
            name,
            tuple(t.encode() for t in headers.values()),
            tuple(n.encode() for n in headers.keys()),
        )
    try:
        try:
            nvrtc.compileProgram(prog, list(options))
        except Exception as exc:
            log = nvrtc.getProgramLog(prog)
            raise CudaUnavailableError(f"kernel {name}: NVRTC failed ({exc}): {log.strip()[:2000]}") from None
        return nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)


def load_module(
    source_name: str, extra_options: tuple[str, ...] = (), device: int | None = None
) -> KernelModule:
    """Compile (or load from the disk cache) `kernels/<source_name>` for the current CUDA device; `source_name` is
    the path relative to kernels/ (`"quik/gemm.cu"`)."""
    cupy = require_cupy()
    dev = torch.cuda.current_device() if device is None else int(device)
    options = _BASE_OPTIONS + tuple(extra_options)
    mkey = (source_name, dev, options)
    with _LOCK:
        mod = _MODULES.get(mkey)
        if mod is not None:
            return mod
        src_path = kernels_dir() / source_name
        if not src_path.is_file():
            raise CudaUnavailableError(
                f"kernel source {src_path}: not found; expected it under {kernels_dir()}"
            )
        source = src_path.read_text()
        headers = _headers()
        arch = target_arch(dev)
        all_opts = options + (f"--gpu-architecture={arch}",)
        ident = "\0".join(
            [
                source,
                *(f"{n}\0{t}" for n, t in headers.items()),
                *all_opts,
                torch.cuda.get_device_name(dev),
                _nvrtc_version(cupy),
            ]
        )
        key = hashlib.sha256(ident.encode()).hexdigest()[:24]
        stem = Path(source_name).with_suffix("").as_posix().replace("/", "-")  # one flat cache folder
        path = cache_dir() / f"{stem}-{arch}-{key}.cubin"
        with cupy.cuda.Device(dev):
            try:
                from_cache = path.is_file()
                if not from_cache:
                    cubin = _compile_cubin(cupy, source, source_name, all_opts, headers)
                    # Atomic: concurrent processes never load a half-written binary.
                    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
                    with os.fdopen(fd, "wb") as fh:
                        fh.write(cubin)
                    os.replace(tmp, path)
                raw = cupy.RawModule(path=str(path))
                info = BuildInfo(source_name, arch, key, str(path), from_cache, "nvrtc-cubin")
            except CudaUnavailableError:
                raise
            except Exception as exc:  # NVRTC bindings moved between cupy versions: fall back
                raw = cupy.RawModule(code=source, options=all_opts + (f"--include-path={kernels_dir()}",))
                raw.compile()
                info = BuildInfo(
                    source_name, arch, key, None, False, f"cupy-rawmodule ({type(exc).__name__})"
                )
        mod = KernelModule(raw, info)
        _MODULES[mkey] = mod
        return mod


class _StreamHandle:
    """What a CuPy launch reads from its `stream` argument: the raw CUDA stream handle, nothing else."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr


_STREAMS: dict[int, _StreamHandle] = {}
_HANDLE_OK = True
_SMEM_LIMITS: dict[int, int] = {}


def current_stream(device: int) -> _StreamHandle:
    """Torch's current stream on `device`, as a launch argument (cached: one small object per stream)."""
    ptr = torch.cuda.current_stream(device).cuda_stream
    s = _STREAMS.get(ptr)
    if s is None:
        s = _StreamHandle(ptr)
        _STREAMS[ptr] = s
    return s


def allow_shared_memory(kernel: Any, nbytes: int) -> None:
    """Raise a kernel's dynamic shared-memory limit above the default 48 KB (once per kernel and size)."""
    key = id(kernel)
    if _SMEM_LIMITS.get(key, 0) < nbytes:
        kernel.max_dynamic_shared_size_bytes = nbytes
        _SMEM_LIMITS[key] = nbytes


def ptr(t: torch.Tensor | None) -> Any:
    """A tensor as a kernel pointer argument (zero-copy); None becomes a null pointer."""
    import numpy as np

    return np.uint64(0 if t is None else t.data_ptr())


def i32(v: int) -> Any:
    import numpy as np

    return np.int32(v)


def f32(v: float) -> Any:
    import numpy as np

    return np.float32(v)


def launch(
    kernel: Any,
    grid: tuple[int, ...],
    block: tuple[int, ...],
    args: tuple,
    shared_mem: int = 0,
    device: int | None = None,
) -> None:
    global _HANDLE_OK
    dev = torch.cuda.current_device() if device is None else device
    if _HANDLE_OK:
        try:
            kernel(grid, block, args, shared_mem=shared_mem, stream=current_stream(dev))
            return
        except (TypeError, AttributeError):  # a CuPy that insists on its own stream type
            _HANDLE_OK = False
    cupy = require_cupy()
    ptr = torch.cuda.current_stream(dev).cuda_stream
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        stream = cupy.cuda.ExternalStream(ptr)
    kernel(grid, block, args, shared_mem=shared_mem, stream=stream)
