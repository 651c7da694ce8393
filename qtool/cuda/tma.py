"""Tensor maps for Hopper's bulk tensor copy engine (TMA): the CUDA driver encodes them on the host
(`cuTensorMapEncodeTiled`) and kernels take them by value as `__grid_constant__` parameters
(kernels/common/ptx_common.cuh, `TmaMap`).

Every map here describes a 2-D tensor as bytes: rows of `row_bytes` at a `stride` in bytes, copied in boxes of
`box_bytes` x `box_rows` with a shared-memory swizzle of `swizzle` bytes. Rows or bytes past the tensor's end
arrive as zeros.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from qtool.cuda.compile import CudaUnavailableError

_SWIZZLE = {0: 0, 32: 1, 64: 2, 128: 3}  # CUtensorMapSwizzle
_UINT8 = 0  # CU_TENSOR_MAP_DATA_TYPE_UINT8
_L2_256B = 3  # CU_TENSOR_MAP_L2_PROMOTION_L2_256B
_MAP_BYTES = 128

_ENCODE: Any = None


def _encoder() -> Any:
    global _ENCODE
    if _ENCODE is None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
            fn = lib.cuTensorMapEncodeTiled
        except (OSError, AttributeError) as exc:
            raise CudaUnavailableError(
                f"tensor maps: the CUDA driver has no cuTensorMapEncodeTiled ({exc}); "
                "a driver for CUDA 12 or newer is needed"
            ) from None
        u64p, u32p = ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint32)
        fn.restype = ctypes.c_int
        fn.argtypes = [
            ctypes.c_void_p,
            ctypes.c_int,
            ctypes.c_uint32,
            ctypes.c_void_p,
            u64p,
            u64p,
            u32p,
            u32p,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
        ]
        _ENCODE = fn
    return _ENCODE


class TensorMap:
    """One encoded map (128 bytes, 64-byte aligned host memory) and its launch argument."""

    __slots__ = ("_buf", "address", "arg", "key")

    def __init__(self, key: tuple) -> None:
        self._buf = ctypes.create_string_buffer(_MAP_BYTES + 64)
        self.address = (ctypes.addressof(self._buf) + 63) & ~63
        self.key = key
        self.arg: Any = None  # set once the driver has written the map

    def raw(self) -> bytes:
        return ctypes.string_at(self.address, _MAP_BYTES)


def _launch_arg(m: TensorMap) -> Any:
    """A kernel argument whose 128 bytes the launch copies into the parameter: a raw pointer to the map where this
    CuPy has one, else the map as a NumPy structured scalar."""
    try:
        from cupy.cuda.function import CPointer  # cupy stays a lazy import

        return CPointer(m.address)
    except (ImportError, TypeError):
        import numpy as np

        return np.frombuffer(m.raw(), dtype=np.dtype([("map", "<u8", (16,))]))[0]


def usable(t: torch.Tensor) -> bool:
    """Whether the copy engine can address `t` as rows: 16-byte aligned start and row stride, rows contiguous."""
    es = t.element_size()
    return (
        t.dim() == 2
        and t.is_cuda
        and t.stride(1) == 1
        and t.data_ptr() % 16 == 0
        and (t.stride(0) * es) % 16 == 0
        and t.shape[0] > 0
        and t.shape[1] > 0
    )


def tiled(t: torch.Tensor, box_bytes: int, box_rows: int, swizzle: int) -> TensorMap:
    """Map of the 2-D tensor `t` (rows contiguous) as bytes, copied in boxes of box_bytes x box_rows."""
    if not usable(t):
        raise CudaUnavailableError(
            f"tensor map: found a tensor of shape {tuple(t.shape)}, strides {t.stride()}, address {t.data_ptr():#x}; "
            "expected 2-D CUDA rows, contiguous, 16-byte aligned start and stride"
        )
    if swizzle not in _SWIZZLE or (swizzle and box_bytes > swizzle) or not 0 < box_rows <= 256:
        raise ValueError(f"tensor map box: found {box_bytes} bytes x {box_rows} rows, swizzle {swizzle}")
    es = t.element_size()
    rows, row_bytes, stride = t.shape[0], t.shape[1] * es, t.stride(0) * es
    key = (t.data_ptr(), rows, row_bytes, stride, box_bytes, box_rows, swizzle)
    m = TensorMap(key)
    dims = (ctypes.c_uint64 * 2)(row_bytes, rows)
    strides = (ctypes.c_uint64 * 1)(stride)
    box = (ctypes.c_uint32 * 2)(box_bytes, box_rows)
    elem = (ctypes.c_uint32 * 2)(1, 1)
    rc = _encoder()(
        m.address, _UINT8, 2, t.data_ptr(), dims, strides, box, elem, 0, _SWIZZLE[swizzle], _L2_256B, 0
    )
    if rc != 0:
        raise CudaUnavailableError(
            f"tensor map: cuTensorMapEncodeTiled returned CUresult {rc} for rows {rows} x "
            f"{row_bytes} bytes (stride {stride}), box {box_bytes} x {box_rows}"
        )
    m.arg = _launch_arg(m)
    return m


def padded_rows(t: torch.Tensor, multiple: int) -> torch.Tensor:
    """`t` (2-D, rows contiguous) with its row count rounded up to `multiple` where its storage already holds those
    rows, else `t`: a view for a tensor map only. Boxes of `multiple` rows then never cross the tensor's last row;
    a box that does is filled with zeros past it, which the copy engine serves more slowly (an H200 W4A8 GEMM on 16
    tokens in 64-token boxes: 44.2 against 55.1 us at 8192 x 28672). What the extra rows hold must not matter to
    the kernel reading them."""
    rows = -(-t.shape[0] // multiple) * multiple
    if rows == t.shape[0] or t.dim() != 2:
        return t
    es = t.element_size()
    room = t.untyped_storage().nbytes() - t.storage_offset() * es
    if (rows - 1) * t.stride(0) * es + t.shape[1] * es > room:
        return t
    return t.as_strided((rows, t.shape[1]), t.stride())


class MapCache:
    """Maps by tensor (address, shape, stride) and box: re-encoded only when a tensor moves. Small and bounded,
    because activation buffers come and go with the allocator."""

    def __init__(self, limit: int = 64) -> None:
        self._maps: dict[tuple, TensorMap] = {}
        self.limit = limit

    def get(self, t: torch.Tensor, box_bytes: int, box_rows: int, swizzle: int) -> TensorMap:
        es = t.element_size()
        key = (t.data_ptr(), t.shape[0], t.shape[1] * es, t.stride(0) * es, box_bytes, box_rows, swizzle)
        m = self._maps.get(key)
        if m is None:
            if len(self._maps) >= self.limit:
                self._maps.pop(next(iter(self._maps)))
            m = tiled(t, box_bytes, box_rows, swizzle)
            self._maps[key] = m
        return m
