"""Helpers for the GPU tests: random packed layers and a float64 reference."""

from __future__ import annotations

import torch

from qtool.packing.grouped_int import GroupedIntWeight
from qtool.quant.grid import GridSpec
from qtool.runtime.qlinear import GroupedIntLinear


def gpu_ready() -> str | None:
    """Reason to skip, or None when CUDA and cupy are both usable."""
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    try:
        import cupy  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        return f"cupy unusable: {exc}"
    return None


def random_layer(n: int, k: int, bits: int, group_size: int | None, symmetric: bool, *, seed: int,
                 bias: bool = False, device: str = "cuda") -> GroupedIntLinear:
    """Uniform random codes and zero points; scales sized so outputs are O(1) for unit-variance inputs."""
    gen = torch.Generator().manual_seed(seed)
    spec = GridSpec(bits=bits, symmetric=symmetric, group_size=group_size)
    g = spec.num_groups(k)
    codes = torch.randint(0, 1 << bits, (n, k), generator=gen)
    scale_mag = 2.0 / ((1 << bits) * k**0.5)
    scales = (torch.rand(n, g, generator=gen) + 0.5) * scale_mag
    zeros = torch.randint(0, 1 << bits, (n, g), generator=gen).float()
    w = GroupedIntWeight.from_codes(codes, scales, zeros, spec)
    b = (torch.randn(n, generator=gen) * 0.1).half() if bias else None
    return GroupedIntLinear(w, b).to(device)


def reference64(layer: GroupedIntLinear, x: torch.Tensor) -> torch.Tensor:
    """y in float64 on the CPU from the exact dequantized weight (before any fp16 rounding)."""
    w = layer.layout.dequantize(torch.float32).double().cpu()
    y = x.double().cpu() @ w.T
    if layer.bias is not None:
        y = y + layer.bias.double().cpu()
    return y


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    a = a.double().cpu()
    ref = ref.double().cpu()
    return float((a - ref).norm() / ref.norm().clamp_min(1e-30))


def synced(t: torch.Tensor) -> torch.Tensor:
    """Surface asynchronous CUDA errors right after the launch that caused them."""
    torch.cuda.synchronize()
    return t


def dependent_chain_runs(chain) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """`chain()` once with ordinary launches, then with dependent launches 4 times eagerly and 3 times replayed
    from one CUDA graph: (the ordinary output, the dependent outputs)."""
    from qtool.cuda import dependent_launch

    old = dependent_launch.ENABLED
    try:
        dependent_launch.ENABLED = False
        plain = synced(chain())
        dependent_launch.ENABLED = True
        outs = [synced(chain()) for _ in range(4)]
        assert dependent_launch.available(), dependent_launch.fallback_reason()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = chain()
        for _ in range(3):
            graph.replay()
            outs.append(synced(replayed.clone()))
    finally:
        dependent_launch.ENABLED = old
    return plain, outs
