"""`qtool bench e2e --throughput`: batched generation throughput (QServe's protocol: 1024 prompt tokens and 512
generated tokens per sequence) of one Llama-shaped decoder with random weights in several formats, each at the
batch sizes asked for and at the largest batch whose KV cache fits in the GPU's free memory.

Formats: `fp16` (cuBLAS linears, FP16 cache), `fp8` (`torch._scaled_mm` linears with static per-tensor scales,
FP8 cache), `fp8-sdpa` (the same linears, FP16 cache), `w4a16` (grouped_int g128 kernels, FP16 cache), `w4a8kv4`
(qoq W4A8 kernels, KV4 cache) and `w4a8cq2` (qoq W4A8 kernels, CQ-2 vector-quantized cache over random codebooks).
An FP16 cache is read by torch's `scaled_dot_product_attention`, the others by qtool's kernels for their codes
(qtool/kv_cache/cuda.py, qtool/kv_cache/vq_cuda.py); each row of the report names its attention. The FP8
baseline is the better of `fp8` and `fp8-sdpa`: the FP8 cache holds twice the sequences, but its kernel runs on the
CUDA cores, slow where several query heads share a KV head, while SDPA on the FP16 cache is what a torch user has.
Each format's throughput is also given over the better FP8 row's, at its best batch and at each batch. The same
decoder (qtool/bench/e2e.py) runs them all under CUDA graphs, or all eagerly for a mixture-of-experts shape (its
routing synchronizes with the host: qtool/bench/e2e.py says why), with Qwen3's q/k norms where the shape has them
(`--no-qk-norm` leaves them out, to measure what they cost) and Gemma 2's GeGLU and branch norms (`--llama-block`
runs Llama's block on the same shape instead, likewise).

Timing: the prefill of a few prompts is timed and scaled to the batch (prefill is compute-bound, so its time is
linear in the tokens); one decode step is timed at the middle position of the generated span, which is the mean
step time because attention is the only part that grows with the position, linearly. Generation time of a batch
is then prefill + new_tokens x step, and throughput the batch's generated tokens over it.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import torch
from torch import nn

from qtool.bench import plot, tables
from qtool.bench.e2e import (
    SDPA_ATTENTION,
    Decoder,
    _time_graph,
    dims_for,
    execution,
    fp16_linear,
    make_step,
    model_label,
    quant_linear,
    shape_notes,
    weight_bytes,
)

THROUGHPUT_SCHEMA = "qtool.bench.throughput/1"
VARIANTS = ("fp16", "fp8", "fp8-sdpa", "w4a16", "w4a8kv4", "w4a8cq2")
KV_MODE = {
    "fp16": "fp16",
    "fp8": "fp8",
    "fp8-sdpa": "fp16",
    "w4a16": "fp16",
    "w4a8kv4": "int4",
    "w4a8cq2": "cq2",
}
FP8_VARIANTS = ("fp8", "fp8-sdpa")  # FP8 weights; the baseline is the better of the two
CACHE_KERNEL = {"fp8": "qtool FP8-cache kernel", "int4": "qtool KV4 kernel", "cq2": "qtool CQ-2 kernel"}
CQ_VECTOR_SIZE = {"cq2": 4}
PREFILL_PROMPTS = 4
MEMORY_MARGIN = 3 * 2**30  # the decode step's activations, graph pools, allocator slack


class Fp8Linear(nn.Module):
    """y = x W^T through `torch._scaled_mm` in e4m3 with static per-tensor scales (1.0): the FP8 baseline's
    linear (rows padded to 16, as _scaled_mm requires)."""

    def __init__(self, k: int, n: int, device: torch.device) -> None:
        super().__init__()
        w = torch.randn(n, k, device=device) * 0.02
        self.register_buffer("weight", w.to(torch.float8_e4m3fn))
        self.register_buffer("one", torch.ones((), device=device, dtype=torch.float32))
        self.out_features = n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        m = x2.shape[0]
        pad = -m % 16
        if pad:
            x2 = torch.nn.functional.pad(x2, (0, 0, 0, pad))
        y = torch._scaled_mm(
            x2.to(torch.float8_e4m3fn),
            self.weight.t(),
            scale_a=self.one,
            scale_b=self.one,
            out_dtype=torch.float16,
        )
        return y[:m].reshape(*x.shape[:-1], self.out_features)


class W4A8Linear(nn.Module):
    """The qoq W4A8 layer (qtool/layouts/qoq/cuda.py) on random valid fields: per-token INT8 activations, 4-bit weights."""

    def __init__(
        self, k: int, n: int, group_size: int | None, device: torch.device, gen: torch.Generator
    ) -> None:
        super().__init__()
        from qtool.layouts.qoq import cuda as qoq

        groups = k // group_size if group_size else 1
        qw = torch.randint(-(2**31), 2**31, (n, k // 8), dtype=torch.int32, device=device, generator=gen)
        scales = (torch.rand(n, device=device, generator=gen) * 0.004 + 0.002).half()
        zeros = torch.randint(
            0, 16, (n, groups) if group_size else (n,), dtype=torch.uint8, device=device, generator=gen
        )
        s1 = (
            torch.randint(1, 9, (n, groups), dtype=torch.uint8, device=device, generator=gen)
            if group_size
            else None
        )
        self.prepared = qoq.build(4, group_size, k, qw, scales, zeros, s1, None)
        self.takes_codes = True
        # from one token: at decode sizes qoq.gemm runs the codes GEMV, which beat the GEMV that quantizes float16
        # rows itself (kernels/NOTES.md, qoq section)
        self.codes_min_tokens = 1
        # the packed tensors as buffers, so that weight_bytes counts them
        for name, t in self.prepared.__dict__.items():
            if isinstance(t, torch.Tensor):
                self.register_buffer(f"p_{name}", t, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from qtool.layouts.qoq import cuda as qoq

        return qoq.linear(x, self.prepared)

    def forward_codes(self, a, lead: tuple[int, ...]) -> torch.Tensor:
        """y from activation codes made by the kernel that produced the input (qtool/bench/e2e.py FUSED_QUANT)."""
        from qtool.layouts.qoq import cuda as qoq

        return qoq.gemm(a, self.prepared).reshape(*lead, self.prepared.out_features)


def head_dim_refusal(variant: str, head_dim: int) -> str | None:
    """Why the variant's KV cache cannot hold heads of `head_dim` (None: it can), said before any model is
    built rather than by the cache's allocation after the variants before it have run."""
    mode = KV_MODE[variant]
    if mode == "fp16":
        return None
    if mode in CQ_VECTOR_SIZE:
        from qtool.kv_cache.vq_cuda import HEAD_DIMS

        if head_dim in HEAD_DIMS:
            return None
        return f"the CQ-2 cache takes head_dim {' or '.join(map(str, HEAD_DIMS))}, found {head_dim}"
    from qtool.kv_cache.cuda import check_shape

    try:
        check_shape(mode, head_dim)
    except ValueError as e:
        return str(e)
    return None


def attention_name(variant: str, heads: int, kv_heads: int, head_dim: int) -> str:
    """The attention a variant's decode step runs, for the report: SDPA for an FP16 cache, else qtool's kernel
    for the cache's codes, with the form its dispatch picks for these heads (the CQ-2 kernel picks its form by
    the batch and the cache's length)."""
    mode = KV_MODE[variant]
    if mode == "fp16":
        return SDPA_ATTENTION
    if mode in CQ_VECTOR_SIZE:
        return CACHE_KERNEL[mode]
    from qtool.kv_cache.cuda import FORM_NAMES, attention_kernel

    return f"{CACHE_KERNEL[mode]} ({FORM_NAMES[attention_kernel(mode, heads // kv_heads, head_dim)]})"


def make_linear(variant: str, device: torch.device, group_size: int | None, gen: torch.Generator):
    if variant == "fp16":
        return fp16_linear(device)
    if variant in FP8_VARIANTS:
        return lambda k, n: Fp8Linear(k, n, device)
    if variant == "w4a16":
        return quant_linear(device, 4, group_size, gen)
    if variant in ("w4a8kv4", "w4a8cq2"):
        return lambda k, n: W4A8Linear(k, n, group_size, device, gen)
    raise ValueError(f"--variants: found {variant!r}, expected some of {', '.join(VARIANTS)}")


def cache_bytes_per_token(variant: str, layers: int, kv_heads: int, head_dim: int) -> int:
    mode = KV_MODE[variant]
    if mode == "fp16":
        return layers * 2 * kv_heads * head_dim * 2
    if mode in CQ_VECTOR_SIZE:
        from qtool.kv_cache.vq_cuda import bytes_per_token as vq_bytes

        return layers * vq_bytes(kv_heads, head_dim, CQ_VECTOR_SIZE[mode])
    from qtool.kv_cache.cuda import bytes_per_token

    return layers * bytes_per_token(mode, kv_heads, head_dim)


def _caches(variant: str, model: Decoder, batch: int, length: int, dev: torch.device) -> list:
    d = model.d
    mode = KV_MODE[variant]
    if mode == "fp16":
        shape = (batch, d.kv_heads, length, d.head_dim)
        return [
            (
                torch.zeros(shape, device=dev, dtype=torch.float16),
                torch.zeros(shape, device=dev, dtype=torch.float16),
            )
            for _ in range(d.layers)
        ]
    if mode in CQ_VECTOR_SIZE:
        from qtool.kv_cache import vq_cuda as vqa

        dv = CQ_VECTOR_SIZE[mode]
        gen = torch.Generator(device=dev).manual_seed(0)  # codebooks per layer: random, 256 entries
        shape = (d.kv_heads, d.head_dim // dv, 256, dv)
        return [
            vqa.allocate(
                torch.randn(shape, device=dev, generator=gen).half(),
                torch.randn(shape, device=dev, generator=gen).half(),
                batch,
                length,
                dev,
            )
            for _ in range(d.layers)
        ]
    from qtool.kv_cache import cuda as kvc

    return [kvc.allocate(mode, batch, d.kv_heads, length, d.head_dim, dev) for _ in range(d.layers)]


def measure_generation(
    model: Decoder,
    variant: str,
    prompt: int,
    new_tokens: int,
    batches: list[int | str],
    iters: int,
    log=lambda s: None,
) -> dict[str, Any]:
    dev = model.embed.weight.device
    d = model.d
    length = prompt + new_tokens
    tables = model.rope_tables(length + 1, dev)
    out: dict[str, Any] = {"decode": {}}
    with torch.inference_mode():
        cache = _caches(variant, model, PREFILL_PROMPTS, length, dev)
        ids = torch.randint(0, d.vocab, (PREFILL_PROMPTS, prompt), device=dev)
        pos = torch.arange(prompt, device=dev)
        fn = lambda ids, pos, cache=cache: model(ids, pos, cache, tables, decode=False)  # noqa: E731
        step = make_step(model, fn, [ids, pos])
        us = _time_graph(step, 5)
        out["prefill"] = {
            "prompts": PREFILL_PROMPTS,
            "tokens": PREFILL_PROMPTS * prompt,
            "us": us,
            "us_per_prompt": us / PREFILL_PROMPTS,
        }
        del step, cache, fn
        torch.cuda.empty_cache()
        per_seq = cache_bytes_per_token(variant, d.layers, d.kv_heads, d.head_dim) * length
        free = torch.cuda.mem_get_info(dev)[0]
        largest = max(0, (free - MEMORY_MARGIN) // per_seq) // 16 * 16
        out["largest_batch"] = int(largest)
        out["cache_bytes_per_sequence"] = per_seq
        sizes = sorted({int(largest) if b == "max" else int(b) for b in batches})
        span = prompt + new_tokens // 2 + 1  # the timed step's position + 1
        for b in sizes:
            if b <= 0 or b > largest:
                out["decode"][str(b)] = {"batch": b, "fits": False}
                log(f"{variant}: batch {b} does not fit (largest {largest})")
                continue
            cache = _caches(variant, model, b, length, dev)
            ids = torch.randint(0, d.vocab, (b, 1), device=dev)
            pos = torch.tensor([prompt + new_tokens // 2], device=dev)
            fn = lambda ids, pos, cache=cache: model(ids, pos, cache, tables, decode=True, span=span)  # noqa: E731
            step = make_step(model, fn, [ids, pos])
            step_us = _time_graph(step, iters)
            total_s = out["prefill"]["us_per_prompt"] * 1e-6 * b + new_tokens * step_us * 1e-6
            out["decode"][str(b)] = {
                "batch": b,
                "fits": True,
                "step_us": step_us,
                "generation_s": total_s,
                "tokens_per_s": b * new_tokens / total_s,
                "decode_tokens_per_s": b / (step_us * 1e-6),
                "largest": b == largest,
            }
            log(
                f"{variant}: batch {b}: step {step_us / 1e3:.2f} ms, {b * new_tokens / total_s:.0f} generated tok/s"
            )
            del step, cache, fn
            torch.cuda.empty_cache()
    return out


def run_throughput(
    model_name: str,
    variants: list[str],
    group_size: int | None,
    prompt: int,
    new_tokens: int,
    batches: list[int | str],
    iters: int,
    log=lambda s: None,
    qk_norm: bool = True,
    llama_block: bool = False,
) -> dict[str, Any]:
    d = dims_for(model_name, qk_norm, llama_block)
    dev = torch.device("cuda", torch.cuda.current_device())
    report: dict[str, Any] = {
        "schema": THROUGHPUT_SCHEMA,
        "model": model_name,
        "dims": asdict(d),
        "cuda_graphs": not d.experts,
        "group_size": group_size,
        "prompt_tokens": prompt,
        "new_tokens": new_tokens,
        "batches": [str(b) for b in batches],
        "device": torch.cuda.get_device_name(dev),
        "memory_bytes": torch.cuda.get_device_properties(dev).total_memory,
        "runs": {},
    }
    gen = torch.Generator(device=dev).manual_seed(0)
    for variant in variants:
        torch.cuda.empty_cache()
        model = Decoder(d, make_linear(variant, dev, group_size, gen), dev).eval()
        res = measure_generation(model, variant, prompt, new_tokens, batches, iters, log)
        res["weight_bytes"] = weight_bytes(model)
        res["kv_cache"] = KV_MODE[variant]
        res["attention"] = attention_name(variant, d.heads, d.kv_heads, d.head_dim)
        report["runs"][variant] = res
        del model
    report.update(ratios(report["runs"]))
    return report


def ratios(runs: dict[str, Any]) -> dict[str, Any]:
    """The report's comparisons of the measured `runs`: each variant's best batch (`best`); its best tokens/s
    over FP16's best (`speedup_vs_fp16_at_best`, where fp16 ran) and over the better FP8 row's best
    (`best_fp8`, `speedup_vs_best_fp8_at_best`, where fp8 or fp8-sdpa ran); and, at each batch that an FP8 row
    fits, each variant's tokens/s over the better FP8 row's there (`best_fp8_at_batch`,
    `speedup_vs_best_fp8_at_batch`: variant -> batch -> ratio, where the variant fits too)."""
    fits = {v: [e for e in run["decode"].values() if e.get("fits")] for v, run in runs.items()}
    best = {v: max(es, key=lambda e: e["tokens_per_s"]) for v, es in fits.items() if es}
    out: dict[str, Any] = {
        "best": {v: {"batch": e["batch"], "tokens_per_s": e["tokens_per_s"]} for v, e in best.items()}
    }
    if "fp16" in best:
        out["speedup_vs_fp16_at_best"] = {
            v: e["tokens_per_s"] / best["fp16"]["tokens_per_s"] for v, e in best.items()
        }
    fp8 = [v for v in FP8_VARIANTS if v in best]
    if not fp8:
        return out
    ref = max(fp8, key=lambda v: best[v]["tokens_per_s"])
    out["best_fp8"] = {"variant": ref, **out["best"][ref]}
    out["speedup_vs_best_fp8_at_best"] = {
        v: e["tokens_per_s"] / best[ref]["tokens_per_s"] for v, e in best.items()
    }
    at_batch: dict[str, dict[str, Any]] = {}
    per_variant: dict[str, dict[str, float]] = {v: {} for v in runs}
    for b in sorted({int(b) for run in runs.values() for b in run["decode"]}):
        here = {v: runs[v]["decode"].get(str(b), {}) for v in FP8_VARIANTS if v in runs}
        here = {v: e for v, e in here.items() if e.get("fits")}
        if not here:
            continue
        v_ref = max(here, key=lambda v: here[v]["tokens_per_s"])
        at_batch[str(b)] = {"variant": v_ref, "tokens_per_s": here[v_ref]["tokens_per_s"]}
        for v, run in runs.items():
            e = run["decode"].get(str(b), {})
            if e.get("fits"):
                per_variant[v][str(b)] = e["tokens_per_s"] / here[v_ref]["tokens_per_s"]
    out["best_fp8_at_batch"] = at_batch
    out["speedup_vs_best_fp8_at_batch"] = per_variant
    return out


def report_parts(r: dict[str, Any]) -> list[Any]:
    sizes = sorted({int(b) for run in r["runs"].values() for b in run["decode"]})
    vs_fp8 = r.get("speedup_vs_best_fp8_at_best")
    rows = []
    for v, run in r["runs"].items():
        cells = []
        for b in sizes:
            e = run["decode"].get(str(b))
            cells.append(
                ""
                if e is None
                else "-"
                if not e["fits"]
                else f"{e['tokens_per_s']:.0f}{'*' if e['largest'] else ''}"
            )
        best = r["best"].get(v, {})
        sp = r.get("speedup_vs_fp16_at_best", {}).get(v)
        rows.append(
            [
                v,
                # reports from before the attention was recorded: their FP16-cache rows ran qtool's own FP16
                # decode kernel, since removed
                run.get("attention", "not recorded"),
                *cells,
                str(run["largest_batch"]),
                f"{best.get('tokens_per_s', 0):.0f}",
                tables.num(sp, ".2f", "x"),
                *([tables.num(vs_fp8.get(v), ".2f", "x")] if vs_fp8 is not None else []),
                f"{run['weight_bytes'] / 2**30:.2f}",
            ]
        )
    parts: list[Any] = [
        tables.table(
            f"generation throughput, {model_label(r)} (random weights) on {r['device']}: {r['prompt_tokens']} "
            f"prompt + {r['new_tokens']} generated tokens per sequence, {execution(r)}, generated tokens/s "
            "(largest batch that fits marked *)",
            [
                "format",
                "attention",
                *[f"b{b}" for b in sizes],
                "largest",
                "best tok/s",
                "vs fp16",
                *(["vs best FP8"] if vs_fp8 is not None else []),
                "weights GiB",
            ],
            rows,
            left=2,
        )
    ]
    if vs_fp8 is not None:
        ref = r["best_fp8"]
        parts.append(
            f"vs best FP8: best tok/s over the better FP8 row's, {ref['variant']} at batch {ref['batch']} "
            f"({ref['tokens_per_s']:.0f} tok/s)"
        )
    parts += _fp8_by_batch(r)
    return [*parts, *shape_notes(r)]


def _fp8_by_batch(r: dict[str, Any]) -> list[Any]:
    """Each format's tokens/s over the better FP8 row's at the same batch, with that row named per batch."""
    at = r.get("best_fp8_at_batch")
    if not at:
        return []
    sizes = sorted(at, key=int)
    per = r["speedup_vs_best_fp8_at_batch"]
    rows = [[v, *[tables.num(per.get(v, {}).get(b), ".2f", "x") for b in sizes]] for v in r["runs"]]
    rows.append(["(better FP8 row)", *[at[b]["variant"] for b in sizes]])
    return [
        tables.table(
            "generated tokens/s over the better of fp8 and fp8-sdpa at the same batch",
            ["format", *[f"b{b}" for b in sizes]],
            rows,
        )
    ]


def format_throughput(r: dict[str, Any]) -> str:
    return tables.render(report_parts(r))


def figure(r: dict[str, Any]) -> plot.Figure:
    """Generated tokens/s of each format over FP16's at the same batch (where both fit), and at each one's best
    batch; where an FP8 row ran, the same over the better FP8 row's."""
    sizes = sorted({int(b) for run in r["runs"].values() for b in run["decode"]})
    fp16 = r["runs"].get("fp16", {}).get("decode", {})

    def ratio(e: dict[str, Any] | None, b: int) -> float | None:
        f = fp16.get(str(b))
        if not e or not e.get("fits") or not f or not f.get("fits"):
            return None
        return e["tokens_per_s"] / f["tokens_per_s"]

    series = {
        v: [ratio(run["decode"].get(str(b)), b) for b in sizes] for v, run in r["runs"].items() if v != "fp16"
    }
    best = r.get("speedup_vs_fp16_at_best", {})
    names = [v for v in r["runs"] if v != "fp16" and v in best]
    panels = [
        plot.Panel("same batch", sizes, series, xlabel="batch (sequences)"),
        plot.Panel(
            "each at its best batch", names, {"best / FP16 best": [best[v] for v in names]}, kind="bar"
        ),
    ]
    at = r.get("best_fp8_at_batch")
    if at:
        fp8_sizes = sorted(int(b) for b in at)
        per = r["speedup_vs_best_fp8_at_batch"]
        vs = r["speedup_vs_best_fp8_at_best"]
        reference = "better of fp8 / fp8-sdpa"
        ylabel = "tokens/s / best FP8 tokens/s"
        panels += [
            plot.Panel(
                "same batch, over the better FP8 row",
                fp8_sizes,
                {v: [per.get(v, {}).get(str(b)) for b in fp8_sizes] for v in r["runs"]},
                xlabel="batch (sequences)",
                reference=reference,
                ylabel=ylabel,
            ),
            plot.Panel(
                "each at its best batch, over the best FP8 row",
                list(vs),
                {"best / best FP8": list(vs.values())},
                kind="bar",
                reference=reference,
                ylabel=ylabel,
            ),
        ]
    fp16_attention = r["runs"].get("fp16", {}).get("attention")
    return plot.Figure(
        f"qtool bench e2e --throughput {model_label(r)} on {r['device']}",
        "tokens/s / FP16 tokens/s",
        f"FP16 (cuBLAS, {fp16_attention or 'FP16 cache'})",
        panels,
    )
