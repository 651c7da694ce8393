"""Helpers for the GPU tests: random packed layers and a float64 reference."""

from __future__ import annotations

import torch

from qtool.packing.bitpack import pack_codes
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


def tinystories_perplexity(ckpt, device: str, dtype: torch.dtype) -> dict:
    """Perplexity of a stories260K checkpoint on 32 TinyStories windows of 512 tokens (BOS per story), loaded on
    `device` in `dtype`: the protocol the checkpoint GPU tests compare the CPU reference and the kernels with."""
    import qtool
    from qtool.checkpoint.loader import load_tokenizer
    from qtool.eval.perplexity import perplexity
    from qtool.recipe import EvalSpec

    from conftest import TINYSTORIES

    spec = EvalSpec(text=str(TINYSTORIES), seq_len=512, max_windows=32, separator="<|endoftext|>", batch_size=4)
    model = qtool.load(ckpt, device=device, dtype=dtype).eval()
    return perplexity(model, load_tokenizer(ckpt), spec, device)


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


class QoQFieldLayer(torch.nn.Module):
    """A random layer holding the qoq layout's fields under their names (what QoQLinear holds: formats/qoq.md; W8:
    Q8 + 128 byte streams; W4: nibble streams with per-channel s, z or progressive s0, s1, z), plus its integer weight
    Wint [N, K] for the checks. Some rows take the extremes (Q8 = ±127; s1 = 16, z = 8 with q = 0 and 15)."""

    def __init__(self, n: int, k: int, bits: int, group_size: int | None, bias: bool,
                 generator: torch.Generator | None = None) -> None:
        super().__init__()
        gen = generator
        self.in_features, self.out_features, self.bits, self.group_size = k, n, bits, group_size
        if bits == 8:
            q8 = torch.randint(-127, 128, (n, k), generator=gen)
            q8[0, : min(k, 4)] = torch.tensor([-127, 127, -127, 127])[: min(k, 4)]
            self.register_buffer("qweight", pack_codes(q8 + 128, 8))
            wint = q8
        elif group_size is None:
            q = torch.randint(0, 16, (n, k), generator=gen)
            z = torch.randint(0, 16, (n,), generator=gen)
            self.register_buffer("qweight", pack_codes(q, 4))
            self.register_buffer("zeros", z.to(torch.uint8))
            wint = q - z[:, None]
        else:
            g = k // group_size
            s1 = torch.randint(1, 17, (n, g), generator=gen)
            # z so that s1·(q - z) stays in [-128, 127] for every q in [0, 15] (the layout's guarantee)
            lo = (15 - torch.div(127, s1, rounding_mode="floor")).clamp(min=0)
            hi = torch.div(128, s1, rounding_mode="floor").clamp(max=15)
            z = lo + (torch.rand(n, g, generator=gen) * (hi - lo + 1).float()).long().clamp(max=hi - lo)
            s1[0, 0], z[0, 0] = 16, 8  # the extremes: -128 and 112
            q = torch.randint(0, 16, (n, k), generator=gen)
            q[0, :2] = torch.tensor([0, 15])
            self.register_buffer("qweight", pack_codes(q, 4))
            self.register_buffer("group_scales", s1.to(torch.uint8))
            self.register_buffer("zeros", z.to(torch.uint8))
            wint = s1.repeat_interleave(group_size, 1) * (q - z.repeat_interleave(group_size, 1))
            assert int(wint.min()) >= -128 and int(wint.max()) <= 127
        self.register_buffer("scales", ((torch.rand(n, generator=gen) + 0.5) / (127 * 16 * k**0.5)).half())
        self.register_buffer("bias", (torch.randn(n, generator=gen) * 0.1).half() if bias else None)
        self.wint = wint.to(torch.int32)
