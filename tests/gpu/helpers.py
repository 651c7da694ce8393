"""Helpers for the GPU tests: random packed layers, a float64 reference, and the checks the KV cache tests share."""

from __future__ import annotations

import torch

from qtool.layouts.bitpack import pack_codes
from qtool.layouts.grouped_int.layout import GroupedIntWeight
from qtool.layouts.grouped_int.module import GroupedIntLinear
from qtool.layouts.qoq.layout import QoQWeight
from qtool.layouts.qoq.module import QoQLinear
from qtool.quant.grid import GridSpec


def gpu_ready() -> str | None:
    """Reason to skip, or None when CUDA and cupy are both usable."""
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    try:
        import cupy  # noqa: F401
    except Exception as exc:
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

    spec = EvalSpec(
        text=str(TINYSTORIES), seq_len=512, max_windows=32, separator="<|endoftext|>", batch_size=4
    )
    model = qtool.load(ckpt, device=device, dtype=dtype).eval()
    return perplexity(model, load_tokenizer(ckpt), spec, device)


def random_layer(
    n: int,
    k: int,
    bits: int,
    group_size: int | None,
    symmetric: bool,
    *,
    seed: int,
    bias: bool = False,
    device: str = "cuda",
) -> GroupedIntLinear:
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


class QoQFieldLayer(QoQLinear):
    """A QoQLinear over random tensors built from the qoq layout's field definitions (formats/qoq.md; W8: Q8 + 128
    byte streams; W4: nibble streams with per-channel s, z or progressive s0, s1, z), not by the quantizer, plus its
    integer weight Wint [N, K] for the checks. Some rows take the extremes (Q8 = ±127; s1 = 16, z = 8 with q = 0
    and 15)."""

    def __init__(
        self,
        n: int,
        k: int,
        bits: int,
        group_size: int | None,
        bias: bool,
        generator: torch.Generator | None = None,
    ) -> None:
        gen = generator
        group_scales = zeros = None
        if bits == 8:
            q8 = torch.randint(-127, 128, (n, k), generator=gen)
            q8[0, : min(k, 4)] = torch.tensor([-127, 127, -127, 127])[: min(k, 4)]
            qweight = pack_codes(q8 + 128, 8)
            wint = q8
        elif group_size is None:
            q = torch.randint(0, 16, (n, k), generator=gen)
            z = torch.randint(0, 16, (n,), generator=gen)
            qweight = pack_codes(q, 4)
            zeros = z.to(torch.uint8)
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
            qweight = pack_codes(q, 4)
            group_scales = s1.to(torch.uint8)
            zeros = z.to(torch.uint8)
            wint = s1.repeat_interleave(group_size, 1) * (q - z.repeat_interleave(group_size, 1))
            assert int(wint.min()) >= -128 and int(wint.max()) <= 127
        scales = ((torch.rand(n, generator=gen) + 0.5) / (127 * 16 * k**0.5)).half()
        b = (torch.randn(n, generator=gen) * 0.1).half() if bias else None
        super().__init__(QoQWeight(bits, group_size, k, n, qweight, scales, group_scales, zeros), b)
        self.wint = wint.to(torch.int32)


# The quantized KV caches (tests/gpu/test_kv_cache_kernels.py, test_vq_attention.py): cache bytes are filled with
# KV_POISON before a write, so a position the write should not touch still holds it afterwards.
KV_POISON = 0xA5


def rope_tables(length: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary cos, sin [length, d / 2] in float16 on the GPU (base 10000)."""
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device="cuda", dtype=torch.float32) / d))
    ang = torch.arange(length, device="cuda", dtype=torch.float32)[:, None] * inv[None]
    return ang.cos().half(), ang.sin().half()


def attention_excess(got: torch.Tensor, ref: torch.Tensor) -> float:
    """The worst amount by which float16 attention outputs `got` lie beyond float16 rounding of the float64
    reference `ref` (2e-3 of each value plus 1e-3 of the largest): <= 0 when every output is within it."""
    tol = 2e-3 * ref.abs() + 1e-3 * float(ref.abs().max())
    return float(((got.double() - ref).abs() - tol).max())


def check_write_then_attention_chain(kv, new_cache) -> None:
    """The decode step's pair (write at pos, attend to 0..pos) chained as the runtime runs it, by a cache module
    `kv` (qtool.kv_cache.cuda, qtool.kv_cache.vq_cuda: write, attention, reference_attention) on the cache that
    `new_cache(gen, b, kvh, length, d)` makes, after a 40-token prompt: dependent launches and graph replays give
    the ordinary launches' output, within float16 rounding of float64 attention."""
    from qtool.kv_cache.cuda import rope_half

    b, h, kvh, d, length = 4, 8, 2, 128, 96
    gen = torch.Generator(device="cuda").manual_seed(7)
    cos, sin = rope_tables(length, d)
    cache = new_cache(gen, b, kvh, length, d)
    prompt = (torch.randn(b, 40, h + 2 * kvh, d, device="cuda", generator=gen)).half()
    kv.write(prompt, cos, sin, torch.arange(40, device="cuda"), cache, h)
    step = (torch.randn(b, 1, h + 2 * kvh, d, device="cuda", generator=gen)).half()
    pos = torch.tensor([40], device="cuda")

    def chain():
        q, _, _ = kv.write(step, cos, sin, pos, cache, h)
        return kv.attention(q, cache, pos)

    plain, outs = dependent_chain_runs(chain)
    for o in outs:
        assert torch.equal(o, plain)
    q_ref = rope_half(step.transpose(1, 2)[:, :h], cos[pos], sin[pos])
    ref = kv.reference_attention(q_ref, cache, 40)
    assert attention_excess(plain, ref) <= 0


def check_bench_decoder_under_graphs(variant: str, tokens_last) -> None:
    """The throughput bench's decoder (qtool/bench/throughput.py) with `variant`'s linears and caches: prefill then
    decode steps, eagerly and replayed from CUDA graphs, give the same tokens; the prompt's key codes are written
    (no position left all KV_POISON), later positions untouched. `tokens_last(cache.k)`: the key codes with the
    positions in the last dimension."""
    from qtool.bench.e2e import Decoder, dims_for
    from qtool.bench.throughput import _caches, make_linear
    from qtool.cuda.graphs import GraphedStep

    d = dims_for("tiny")
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(3)
    # W4A8 per channel: 688 is no multiple of 128
    model = Decoder(d, make_linear(variant, dev, None, gen), dev).eval()
    tables = model.rope_tables(65, dev)
    eager, graphed = _caches(variant, model, 3, 64, dev), _caches(variant, model, 3, 64, dev)
    for c in eager + graphed:
        c.k.fill_(KV_POISON)
    ids = torch.randint(0, d.vocab, (3, 20), device=dev, generator=gen)
    with torch.inference_mode():
        t_eager = model(ids, torch.arange(20, device=dev), eager, tables, decode=False)
        fn = lambda ids, pos: model(ids, pos, graphed, tables, decode=False)  # noqa: E731
        t_graph = GraphedStep(fn, [ids, torch.arange(20, device=dev)])(ids, torch.arange(20, device=dev))
        assert torch.equal(t_eager, t_graph)
        for c in eager:
            k = tokens_last(c.k)
            assert not bool((k[..., :20] == KV_POISON).all(-2).any()) and bool(
                (k[..., 20:] == KV_POISON).all()
            )
        step_ids, pos = t_eager[:, None].clone(), torch.tensor([20], device=dev)
        step = GraphedStep(lambda i, p: model(i, p, graphed, tables, decode=True), [step_ids, pos])
        for p in range(20, 24):
            pos.fill_(p)
            a = model(step_ids, pos, eager, tables, decode=True)
            b = step(step_ids, pos)
            assert torch.equal(a, b), f"graph replay differs from eager at position {p}"
            step_ids.copy_(a[:, None])
