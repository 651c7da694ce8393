"""The `qtool bench` click group: `kernels`, `quik`, `e2e` (and `e2e --throughput`), `attention`. Each prints its
report as rich tables (or JSON with `--json`), writes it with `--json-out PATH` and draws it with `--plot PATH`.
Importing this module needs neither a GPU nor cupy."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

import click

from qtool.bench.stats import BenchError
from qtool.errors import ResourceError
from qtool.failure import JSON_KEY, QtoolGroup

__all__ = ["BenchError", "bench"]


def _need_gpu() -> None:
    import torch

    if not torch.cuda.is_available():
        raise ResourceError("bench: found no CUDA GPU, expected one (the bench times GPU kernels)")


def _group_sizes(text: str, option: str = "--group-size") -> list[int | None]:
    out: list[int | None] = []
    for part in text.split(","):
        part = part.strip().lower()
        if part in ("channel", "none", "ch"):
            out.append(None)
        elif part.isdigit() and int(part) > 0:
            out.append(int(part))
        else:
            raise BenchError(
                f"{option}: found {part!r}, expected positive integers or 'channel', comma-separated"
            )
    return out


def _fractions(text: str) -> list[float]:
    """--mixed: outlier fractions in [0, 0.005] (the layout's cap), or none."""
    if text.strip().lower() in ("", "none-rows"):
        return []
    out = []
    for part in text.split(","):
        try:
            v = float(part)
        except ValueError:
            v = -1.0
        if not 0.0 <= v <= 0.005:
            raise BenchError(
                f"--mixed: found {part.strip()!r}, expected fractions in [0, 0.005], comma-separated"
            )
        out.append(v)
    return out


def report_options(f):
    """--json, --json-out and --plot on every bench subcommand, passed on as `out`."""

    @click.option(
        "--json", "json_mode", is_flag=True, help="Print the report as JSON on stdout instead of tables."
    )
    @click.option(
        "--json-out", "json_out", default=None, metavar="PATH", help="Also write the report as JSON here."
    )
    @click.option(
        "--plot",
        "plot_path",
        default=None,
        metavar="PATH",
        help="Write a PNG of the ratios to cuBLAS FP16 (and the peers) here.",
    )
    @functools.wraps(f)
    def wrapper(*args, json_mode: bool, json_out: str | None, plot_path: str | None, **kwargs):
        click.get_current_context().meta[JSON_KEY] = json_mode  # errors are then also JSON objects on stdout
        return f(*args, out=ReportOutput(json_mode, json_out, plot_path), **kwargs)

    wrapper.qtool_json_option = True
    return wrapper


class ReportOutput:
    """The files a bench ends with. As a context manager it reserves them before the run (qtool/output.py: a
    folder at the path, a parent that is a file, an unwritable folder are refused before minutes of timing) and
    removes what it reserved unless the run got to write them."""

    def __init__(self, json_mode: bool, json_out: str | None, plot_path: str | None) -> None:
        self.json_mode, self.json_out, self.plot_path = json_mode, json_out, plot_path
        self.reserved: dict[str, Any] = {}

    def __enter__(self) -> ReportOutput:
        from qtool.bench import plot
        from qtool.output import reserve_output

        if self.plot_path:
            plot.pyplot()
        try:
            for key, path in (("json", self.json_out), ("plot", self.plot_path)):
                if path:
                    # a report or picture left by an earlier run is replaced, as the run's own output
                    self.reserved[key] = reserve_output(path, directory=False, overwrite=True)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for o in self.reserved.values():
            o.__exit__()

    def finish(
        self,
        report: dict[str, Any],
        problems: list[str],
        parts: Callable[[dict], list],
        figure: Callable[[dict], Any],
    ) -> None:
        """Refuse a report that breaks its own schema (a bug: exit code 70, one line), then write the JSON file
        and the PNG, then print the tables (or the JSON)."""
        from qtool.bench import plot, tables

        if problems:
            raise RuntimeError(f"report does not match its schema: {problems[0]}")
        if "json" in self.reserved:
            self.reserved["json"].tmp.write_text(json.dumps(report, indent=2) + "\n")
        if "plot" in self.reserved:
            plot.write(figure(report), str(self.reserved["plot"].tmp))
        for o in self.reserved.values():
            o.publish()
        if self.json_mode:
            click.echo(json.dumps(report, indent=2))
        else:
            tables.echo(parts(report))


def _torchao_group(text: str) -> int | None:
    from qtool.bench.tinygemm import GROUP_SIZES

    t = text.strip().lower()
    if t in ("", "none-rows"):
        return None
    if not t.isdigit() or int(t) not in GROUP_SIZES:
        raise BenchError(
            f"--torchao: found {text!r}, expected one of {', '.join(map(str, GROUP_SIZES))} or 'none-rows'"
        )
    return int(t)


def _vq_presets(text: str) -> list[str]:
    """--vq: presets of qtool.stages.vq.PRESETS, or none."""
    from qtool.stages.vq import PRESETS

    if text.strip().lower() in ("", "none-rows"):
        return []
    out = []
    for part in text.split(","):
        name = part.strip().lower()
        if name not in PRESETS:
            raise BenchError(
                f"--vq: found {part.strip()!r}, expected presets among {', '.join(PRESETS)}, comma-separated"
            )
        out.append(name)
    return list(dict.fromkeys(out))


@click.group(name="bench", cls=QtoolGroup)
def bench() -> None:
    """Measure the kernels (grouped_int, quik) and end-to-end decode/prefill against cuBLAS on this GPU."""


@bench.command("kernels")
@click.option(
    "--model-config",
    "model_config",
    default="llama-2-7b",
    show_default=True,
    help="Known model name (llama-2-7b, llama-3-8b, ...) or a config.json path; gives the KxN shapes.",
)
@click.option(
    "--shapes",
    default=None,
    help="Explicit KxN list (in_features x out_features), e.g. 4096x11008,11008x4096.",
)
@click.option("--m", "ms", default="1,16,64,2048", show_default=True, help="Token counts M, comma-separated.")
@click.option("--bits", default="4", show_default=True, help="Weight bits, comma-separated (4, 8).")
@click.option(
    "--group-size",
    "group_size",
    default="128",
    show_default=True,
    help="Group sizes, comma-separated; 'channel' for one group per row.",
)
@click.option("--asym", is_flag=True, help="Asymmetric (with zero points) instead of symmetric.")
@click.option(
    "--w4a8",
    "w4a8",
    default="ch,128",
    show_default=True,
    help="Group sizes of the qoq W4A8 rows ('ch': per-channel; 'none-rows' or empty: no W4A8 rows).",
)
@click.option(
    "--mixed",
    "mixed",
    default="0,0.002",
    show_default=True,
    help="Outlier fractions of the mixed-2-4-16 rows (2/4/16-bit, block4, g1 = g2 = 16; shapes with K a "
    "multiple of 64 and N of 16), comma-separated; 'none-rows' or empty: no mixed rows.",
)
@click.option(
    "--vq",
    "vq",
    default="gptvq-2,aqlm-3",
    show_default=True,
    help="Presets of the VQ rows: the GEMV at M <= 16 (each with the codebook in global memory, in shared "
    "memory and the tiered cache), the fused GEMM above (shapes with K a multiple of 64); "
    "comma-separated; 'none-rows' or empty: no VQ rows.",
)
@click.option("--warmup", default=10, show_default=True, type=click.IntRange(0, None))
@click.option(
    "--iters",
    default=100,
    show_default=True,
    type=click.IntRange(50, None),
    help="Timed samples per measurement (median reported; at least 50).",
)
@click.option(
    "--torchao",
    "torchao",
    default="128",
    show_default=True,
    help="Group size of the torchao int4 peer (torch._weight_int4pack_mm, tinygemm; bfloat16 activations), "
    "timed beside cuBLAS for every shape and M; 'none-rows' or empty: not timed.",
)
@report_options
def kernels_cmd(
    model_config: str,
    shapes: str | None,
    ms: str,
    bits: str,
    group_size: str,
    asym: bool,
    w4a8: str,
    mixed: str,
    vq: str,
    warmup: int,
    iters: int,
    torchao: str,
    out: ReportOutput,
) -> None:
    """Time the quantized matmuls against cuBLAS FP16/INT8/FP8 and torchao int4, with the card's measured ceilings."""

    def go() -> None:
        from qtool.bench import kernels as kb
        from qtool.bench import stats

        shape_list = stats.parse_shapes(shapes) if shapes else kb.shapes_for_model(model_config)
        cfg = kb.KernelBenchConfig(
            shapes=shape_list,
            ms=stats.parse_ints(ms, "--m"),
            bits=stats.parse_ints(bits, "--bits", 2),
            group_sizes=_group_sizes(group_size),
            symmetric=not asym,
            warmup=warmup,
            iters=iters,
            w4a8_group_sizes=[]
            if w4a8.strip().lower() in ("", "none-rows")
            else _group_sizes(w4a8, "--w4a8"),
            mixed_outliers=_fractions(mixed),
            tinygemm_group_size=_torchao_group(torchao),
            vq_presets=_vq_presets(vq),
        )
        _need_gpu()
        from qtool.bench.cuda_cases import CudaCases
        from qtool.bench.timing import CudaTimer

        with out:
            report = kb.run_kernel_bench(cfg, CudaCases(), CudaTimer(), log=lambda s: click.echo(s, err=True))
            out.finish(report, stats.validate_kernels_report(report), kb.report_parts, kb.figure)

    go()


@bench.command("e2e")
@click.option(
    "--model-config",
    "model_config",
    default="llama-2-7b",
    show_default=True,
    help="Model dimensions (llama-2-7b, llama-2-13b, llama-3-8b, mistral-7b, qwen3-8b, gemma-2-9b, tiny; "
    "mixture of experts, 4 of their layers: mixtral-8x7b-4l, qwen3-30b-a3b-4l); weights are random.",
)
@click.option(
    "--qk-norm/--no-qk-norm",
    "qk_norm",
    default=True,
    show_default=True,
    help="Keep the model's per-head query/key RMSNorm (qwen3-*: torch ops, not fused); --no-qk-norm runs "
    "the same shape without it, to measure what it costs.",
)
@click.option(
    "--llama-block",
    "llama_block",
    is_flag=True,
    help="Run a Gemma shape (gemma-2-9b) with Llama's block: fused SwiGLU instead of GeGLU (torch ops), no "
    "post-attention/post-MLP norms, embedding scaling or final soft-capping; the difference to a run without "
    "it is what those unfused pieces cost.",
)
@click.option(
    "--bits", default=4, show_default=True, type=click.Choice(["4", "8"]), callback=lambda c, p, v: int(v)
)
@click.option("--group-size", "group_size", default="128", show_default=True)
@click.option(
    "--prompt",
    default=None,
    type=click.IntRange(1, None),
    help="Prefill tokens (default 2048; 1024 with --throughput).",
)
@click.option(
    "--batches",
    default=None,
    help="Decode batch sizes (default 1,16,64; with --throughput "
    "16,64,256,max, max being the largest batch whose cache fits).",
)
@click.option(
    "--context",
    default=128,
    show_default=True,
    type=click.IntRange(2, None),
    help="Static KV-cache length for decode; the timed step sits at its middle position and attends to the "
    "positions up to it.",
)
@click.option(
    "--throughput",
    is_flag=True,
    help="Batched generation throughput (prompt + --new-tokens per "
    "sequence) of the --variants instead of prefill/decode latency.",
)
@click.option(
    "--new-tokens",
    default=512,
    show_default=True,
    type=click.IntRange(2, None),
    help="Generated tokens per sequence (--throughput).",
)
@click.option(
    "--variants",
    default="fp16,fp8,fp8-sdpa,w4a16,w4a8kv4",
    show_default=True,
    help="Formats compared by --throughput: fp16 (FP16 cache, torch SDPA), fp8 (W8A8 + FP8 cache, qtool's "
    "kernel), fp8-sdpa (W8A8 + FP16 cache, torch SDPA), w4a16 (FP16 cache, torch SDPA), w4a8kv4 (qoq + KV4), "
    "w4a8cq2 (qoq + CQ-2 cache). The report gives each over FP16 and over the better of fp8 and fp8-sdpa.",
)
@click.option("--iters", default=50, show_default=True, type=click.IntRange(10, None))
@click.option(
    "--torchao/--no-torchao",
    "torchao",
    default=True,
    show_default=True,
    help="Also run the decoder on torchao int4 linears (torch._weight_int4pack_mm, W4 at --group-size).",
)
@click.option(
    "--mixed",
    "mixed",
    default="none-rows",
    show_default=True,
    help="Also run the decoder on mixed-2-4-16 linears (block4, g1 = g2 = 16, 25% 4-bit), one run per "
    "outlier fraction, comma-separated (e.g. 0,0.002); 'none-rows' or empty: none.",
)
@click.option(
    "--vq",
    "vq",
    default="none-rows",
    show_default=True,
    help="Also run the decoder on random VQ linears, one run per preset (gptvq-2, aqlm-3), comma-separated: "
    "the VQ GEMV up to 16 rows, the fused GEMM above (Hopper); the preset's vectors and codebook tiles must "
    "divide every linear's features (and K a multiple of 64 for the GEMM); 'none-rows' or empty: none.",
)
@report_options
def e2e_cmd(
    model_config: str,
    bits: int,
    group_size: str,
    prompt: int | None,
    batches: str | None,
    context: int,
    throughput: bool,
    new_tokens: int,
    variants: str,
    iters: int,
    torchao: bool,
    mixed: str,
    vq: str,
    qk_norm: bool,
    llama_block: bool,
    out: ReportOutput,
) -> None:
    """Prefill and decode tokens/s, FP16 vs grouped_int (and torchao int4, mixed-2-4-16, VQ), same decoder, CUDA graphs (eager for
    the mixture-of-experts shapes), peak GPU memory; with --throughput, generated tokens/s of FP16, FP8 (FP8 and
    FP16 caches), W4A16 and W4A8KV4 up to the largest batch that fits."""

    def go() -> None:
        from qtool.bench import e2e, stats

        e2e.dims_for(model_config)
        gs = _group_sizes(group_size)
        if len(gs) != 1:
            raise BenchError(f"--group-size: found {group_size!r}, expected one value for e2e")
        if throughput:
            _throughput(
                model_config,
                gs[0],
                prompt or 1024,
                new_tokens,
                batches or "16,64,256,max",
                variants,
                iters,
                out,
                qk_norm,
                llama_block,
            )
            return
        bl = stats.parse_ints(batches or "1,16,64", "--batches")
        prompt_n = prompt or 2048
        mixed_fractions = _fractions(mixed)
        presets = _vq_presets(vq)
        dims = e2e.dims_for(model_config, qk_norm, llama_block)
        for preset in presets:
            problem = e2e.vq_problem(preset, dims, max(prompt_n, *bl))
            if problem is not None:
                raise BenchError(f"--vq: {preset} does not fit {model_config}'s linears: {problem}")
        _need_gpu()
        with out:
            report = e2e.run_e2e(
                model_config,
                bits,
                gs[0],
                prompt_n,
                bl,
                context,
                iters,
                log=lambda s: click.echo(s, err=True),
                torchao=torchao,
                mixed=tuple(mixed_fractions),
                qk_norm=qk_norm,
                llama_block=llama_block,
                vq=tuple(presets),
            )
            out.finish(report, [], e2e.report_parts, e2e.figure)

    go()


def _throughput(
    model_config: str,
    group_size: int | None,
    prompt: int,
    new_tokens: int,
    batches: str,
    variants: str,
    iters: int,
    out: ReportOutput,
    qk_norm: bool = True,
    llama_block: bool = False,
) -> None:
    from qtool.bench import stats
    from qtool.bench import throughput as tp
    from qtool.bench.e2e import dims_for

    names = [v.strip().lower() for v in variants.split(",") if v.strip()]
    bad = [v for v in names if v not in tp.VARIANTS]
    if bad or not names:
        raise BenchError(f"--variants: found {variants!r}, expected some of {', '.join(tp.VARIANTS)}")
    head_dim = dims_for(model_config).head_dim
    for v in names:
        reason = tp.head_dim_refusal(v, head_dim)
        if reason:
            raise BenchError(f"--variants: {v} cannot run {model_config} ({reason}); leave it out")
    sizes: list[int | str] = [
        "max" if b.strip().lower() == "max" else b for b in batches.split(",") if b.strip()
    ]
    nums = ",".join(str(b) for b in sizes if b != "max")
    sizes = [*stats.parse_ints(nums, "--batches"), *(["max"] if "max" in sizes else [])] if nums else ["max"]
    _need_gpu()
    with out:
        report = tp.run_throughput(
            model_config,
            names,
            group_size,
            prompt,
            new_tokens,
            sizes,
            iters,
            log=lambda s: click.echo(s, err=True),
            qk_norm=qk_norm,
            llama_block=llama_block,
        )
        out.finish(report, [], tp.report_parts, tp.figure)


@bench.command("quik")
@click.option(
    "--model-config",
    "model_config",
    default="llama-2-7b",
    show_default=True,
    help="Known model name or a config.json path; gives the KxN shapes.",
)
@click.option("--shapes", default=None, help="Explicit KxN list (in_features x out_features).")
@click.option("--m", "m", default=2048, show_default=True, type=click.IntRange(1, None), help="Tokens M.")
@click.option(
    "--outliers",
    default="0,128,256,512,1024",
    show_default=True,
    help="Outlier counts of the W4A4 sweep (Fig. 14), comma-separated.",
)
@click.option(
    "--ladder-outliers",
    "ladder_outliers",
    default=256,
    show_default=True,
    type=click.IntRange(0, None),
    help="Outlier count of the fusion ladder (Fig. 5) and of the W8A8 row.",
)
@click.option("--warmup", default=10, show_default=True, type=click.IntRange(0, None))
@click.option("--iters", default=100, show_default=True, type=click.IntRange(50, None))
@click.option(
    "--torchao",
    "torchao",
    default="128",
    show_default=True,
    help="Group size of the torchao int4 (W4A16) peer; 'none-rows' or empty: not timed.",
)
@report_options
def quik_cmd(
    model_config: str,
    shapes: str | None,
    m: int,
    outliers: str,
    ladder_outliers: int,
    warmup: int,
    iters: int,
    torchao: str,
    out: ReportOutput,
) -> None:
    """Time the QUIK W4A4/W8A8 kernels (fusion ladder, outlier sweep) against cuBLAS FP16/INT8/FP8 and torchao
    int4."""

    def go() -> None:
        from qtool.bench import kernels as kb
        from qtool.bench import quik as qb
        from qtool.bench import stats

        shape_list = stats.parse_shapes(shapes) if shapes else kb.shapes_for_model(model_config)
        counts = tuple(stats.parse_ints(outliers, "--outliers", 0))
        cfg = qb.QuikBenchConfig(
            shapes=shape_list,
            m=m,
            outlier_counts=counts,
            ladder_outliers=ladder_outliers,
            warmup=warmup,
            iters=iters,
            tinygemm_group_size=_torchao_group(torchao),
        )
        _need_gpu()
        from qtool.bench.cuda_cases import QuikCudaCases
        from qtool.bench.timing import CudaTimer

        with out:
            report = qb.run_quik_bench(
                cfg, QuikCudaCases(), CudaTimer(), log=lambda s: click.echo(s, err=True)
            )
            out.finish(report, qb.validate_report(report), qb.report_parts, qb.figure)

    go()


@bench.command("attention")
@click.option(
    "--model-config",
    "model_config",
    default="llama-2-7b",
    show_default=True,
    help="Model whose attention heads to use (llama-2-7b, llama-3-8b, mistral-7b, qwen3-8b, tiny, ...).",
)
@click.option("--batches", default="1,16,64", show_default=True, help="Sequences per step, comma-separated.")
@click.option(
    "--contexts", default="1024", show_default=True, help="Cached tokens per sequence, comma-separated."
)
@click.option(
    "--rows",
    "rows",
    default="fp16-sdpa,fp8,int8,int4,int4-fma,cq2,cq4",
    show_default=True,
    help="Caches to time: fp16-sdpa (torch SDPA), fp8, int8, int4 (the dispatched form), "
    "int4-fma (KV4 through the CUDA-core form), cq2, cq4 (vector-quantized caches, the dispatched "
    "form), cq2-lut, cq2-direct (CQ-2 through each form).",
)
@click.option("--warmup", default=5, show_default=True, type=click.IntRange(0, None))
@click.option("--iters", default=50, show_default=True, type=click.IntRange(10, None))
@report_options
def attention_cmd(
    model_config: str, batches: str, contexts: str, rows: str, warmup: int, iters: int, out: ReportOutput
) -> None:
    """Decode attention over an FP16 cache (torch SDPA) against FP8, INT8, INT4 (KV4) and CQ-2/CQ-4
    (vector-quantized) caches."""

    def go() -> None:
        from qtool.bench import attention as ab
        from qtool.bench import stats
        from qtool.bench.e2e import dims_for

        dims_for(model_config)
        names = [r.strip().lower() for r in rows.split(",") if r.strip()]
        bad = [r for r in names if r not in ab.ROWS]
        if bad or not names:
            raise BenchError(f"--rows: found {rows!r}, expected some of {', '.join(ab.ROWS)}")
        bl, cl = stats.parse_ints(batches, "--batches"), stats.parse_ints(contexts, "--contexts")
        _need_gpu()
        from qtool.bench.timing import CudaTimer

        with out:
            report = ab.run_attention_bench(
                model_config, bl, cl, names, warmup, iters, CudaTimer(), log=lambda s: click.echo(s, err=True)
            )
            out.finish(report, [], ab.report_parts, ab.figure)

    go()


if __name__ == "__main__":
    bench()
