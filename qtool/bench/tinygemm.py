"""torchao's int4 weight-only matmul (tinygemm, `torch._weight_int4pack_mm`), the W4A16 peer the bench times
beside ours: the kernel torchao's `Int4WeightOnlyConfig` runs, called through torch's own operators.

Its layout: 4-bit codes q in [0, 15] per (output row, input column), one (scale, zero) pair per group of
`group_size` input columns, w = (q - 8) * scale + zero; activations, scales and zeros in bfloat16 (the CUDA
kernel takes no other type). CUDA packs the codes from uint8 [N, K/2] (even column in the high nibble) into its
tensor-core tile order; the CPU operators take int32 [N, K] codes. Every packed layer is checked against its
dequantized weight before the bench times it (`check`): a peer that computes something else is not a peer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP_SIZES = (32, 64, 128, 256)
INNER_K_TILES = 8  # 16-byte loads of codes, as torchao packs for CUDA
K_MULTIPLE = INNER_K_TILES * 16
# bfloat16 activations and output against float32 math on the same inputs: about 2**-9 of relative error;
# a wrong layout or formula is off by order 1
TOLERANCE = 1e-2


@dataclass
class Packed:
    weight: torch.Tensor
    scales_and_zeros: torch.Tensor  # [K / group_size, N, 2] bfloat16
    group_size: int
    in_features: int
    out_features: int


def unsupported_reason(k: int, n: int, group_size: int | None) -> str | None:
    if group_size not in GROUP_SIZES:
        return f"torchao int4 takes group sizes {', '.join(map(str, GROUP_SIZES))}, found {group_size or 'channel'}"
    if k % K_MULTIPLE or k % group_size:
        return f"torchao int4 needs K a multiple of {max(K_MULTIPLE, group_size)}, found {k}"
    if n % 8:
        return f"torchao int4 needs N a multiple of 8, found {n}"
    return None


def available(device: torch.device) -> str | None:
    """Why this torch cannot run the kernel on `device` (None: it can)."""
    if device.type == "cuda":
        if not hasattr(torch, "_weight_int4pack_mm"):
            return f"torch {torch.__version__} has no _weight_int4pack_mm"
        if torch.cuda.get_device_capability(device) < (8, 0):
            return "torchao int4 needs compute capability 8.0+"
        return None
    if device.type == "cpu":
        return (
            None
            if hasattr(torch, "_weight_int4pack_mm_for_cpu")
            else f"torch {torch.__version__} has no _weight_int4pack_mm_for_cpu"
        )
    return f"torchao int4 runs on CUDA and CPU, found {device.type}"


def random_layer(
    k: int, n: int, group_size: int, device: torch.device, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes uint8 [N, K], scales [N, G], zeros [N, G]) of a random layer with weights of order 0.01."""
    groups = k // group_size
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, device=device, generator=gen)
    scales = (torch.rand(n, groups, device=device, generator=gen) * 0.004 + 0.002).to(torch.bfloat16)
    zeros = ((torch.rand(n, groups, device=device, generator=gen) - 0.5) * 0.01).to(torch.bfloat16)
    return codes, scales, zeros


def pack(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> Packed:
    n, k = codes.shape
    reason = unsupported_reason(k, n, group_size)
    if reason is not None:
        raise ValueError(reason)
    sz = torch.stack([scales, zeros], dim=-1).to(torch.bfloat16).transpose(0, 1).contiguous()
    if codes.device.type == "cuda":
        u8 = ((codes[:, ::2] << 4) | codes[:, 1::2]).contiguous()
        weight = torch._convert_weight_to_int4pack(u8, INNER_K_TILES)
    else:
        weight = torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), INNER_K_TILES)
    return Packed(weight, sz, group_size, k, n)


def matmul(x: torch.Tensor, p: Packed) -> torch.Tensor:
    """x [M, K] bfloat16 -> [M, N] bfloat16."""
    if x.device.type == "cuda":
        return torch._weight_int4pack_mm(x, p.weight, p.group_size, p.scales_and_zeros)
    return torch._weight_int4pack_mm_for_cpu(x, p.weight, p.group_size, p.scales_and_zeros)


def dequantize(
    codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    """The float32 weight [N, K] of codes [N, K], scales and zeros [N, K / group_size] (rounded to bfloat16, as
    the kernel holds them)."""

    def per_column(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.bfloat16).float().repeat_interleave(group_size, dim=1)

    return (codes.float() - 8.0) * per_column(scales) + per_column(zeros)


def check(
    p: Packed, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, x: torch.Tensor
) -> float:
    """Relative error (Frobenius) of the kernel's x @ W^T against float32 math on the weight dequantized from the
    layer's own codes, scales and zeros (not from the packed tensors); ValueError beyond bfloat16 rounding."""
    ref = x.float() @ dequantize(codes, scales, zeros, p.group_size).t()
    y = matmul(x, p).float()
    err = float((y - ref).norm() / ref.norm().clamp_min(1e-30)) if torch.isfinite(y).all() else float("inf")
    if not err <= TOLERANCE:
        raise ValueError(
            f"torchao int4 output differs from the dequantized reference by {err:.3g} (relative), "
            f"expected at most {TOLERANCE:g}"
        )
    return err
