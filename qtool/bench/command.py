"""The `qtool bench` click group: `kernels` and `e2e`. Importing this module needs neither a GPU nor cupy."""

from __future__ import annotations

import json

import click

from qtool.bench.stats import BenchError
from qtool.errors import ResourceError
from qtool.failure import QtoolGroup

__all__ = ["BenchError", "bench"]


def _need_gpu() -> None:
    import torch  # noqa: PLC0415

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
            raise BenchError(f"{option}: found {part!r}, expected positive integers or 'channel', comma-separated")
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
            raise BenchError(f"--mixed: found {part.strip()!r}, expected fractions in [0, 0.005], comma-separated")
        out.append(v)
    return out


def json_options(f):
    """`--json` (the report as JSON on stdout, the table on stderr), as on every qtool command, and `--json-out` /
    `-o PATH` (the report as JSON in a file, the table on stdout)."""
    f = click.option("-o", "--json-out", "json_out", default=None, type=click.Path(dir_okay=False),
                     help="Write the report as JSON to this file.")(f)
    f = click.option("--json", "json_flag", is_flag=True,
                     help="Print the report as JSON on stdout (the table goes to stderr).")(f)
    f.qtool_json_option = True  # errors are then also JSON objects on stdout (qtool/failure.py)
    return f


def _deliver(report: dict, text: str, json_flag: bool, json_out: str | None,
             problems: list[str] | None = None) -> None:
    """Refuse a report that breaks its own schema (a bug: exit code 70, one line), then write and print it."""
    if problems:
        raise RuntimeError(f"report does not match its schema: {problems[0]}")
    if json_out:
        from qtool.bench.kernels import write_json  # noqa: PLC0415

        write_json(report, json_out)
    if json_flag:
        click.echo(json.dumps(report, indent=2))
    click.echo(text, err=json_flag)


@click.group(name="bench", cls=QtoolGroup)
def bench() -> None:
    """Measure the kernels (grouped_int, quik) and end-to-end decode/prefill against cuBLAS on this GPU."""


@bench.command("kernels")
@click.option("--model-config", "model_config", default="llama-2-7b", show_default=True,
              help="Known model name (llama-2-7b, llama-3-8b, ...) or a config.json path; gives the KxN shapes.")
@click.option("--shapes", default=None, help="Explicit KxN list (in_features x out_features), e.g. 4096x11008,11008x4096.")
@click.option("--m", "ms", default="1,16,64,2048", show_default=True, help="Token counts M, comma-separated.")
@click.option("--bits", default="4", show_default=True, help="Weight bits, comma-separated (4, 8).")
@click.option("--group-size", "group_size", default="128", show_default=True,
              help="Group sizes, comma-separated; 'channel' for one group per row.")
@click.option("--asym", is_flag=True, help="Asymmetric (with zero points) instead of symmetric.")
@click.option("--w4a8", "w4a8", default="ch,128", show_default=True,
              help="Group sizes of the qoq W4A8 rows ('ch': per-channel; 'none-rows' or empty: no W4A8 rows).")
@click.option("--mixed", "mixed", default="0,0.002", show_default=True,
              help="Outlier fractions of the mixed-2-4-16 rows (2/4/16-bit, block4, g1 = g2 = 16; shapes with K a "
                   "multiple of 64 and N of 16), comma-separated; 'none-rows' or empty: no mixed rows.")
@click.option("--warmup", default=10, show_default=True, type=click.IntRange(0, None))
@click.option("--iters", default=100, show_default=True, type=click.IntRange(50, None),
              help="Timed samples per measurement (median reported; at least 50).")
@json_options
@click.option("--plot", "plot_path", default=None, help="Write a PNG of the speedups here.")
def kernels_cmd(model_config: str, shapes: str | None, ms: str, bits: str, group_size: str, asym: bool, w4a8: str,
                mixed: str, warmup: int, iters: int, json_flag: bool, json_out: str | None, plot_path: str | None) -> None:
    """Time the quantized matmuls and the cuBLAS FP16/INT8/FP8 baselines, with the card's measured ceilings."""

    def go() -> None:
        from qtool.bench import kernels as kb  # noqa: PLC0415
        from qtool.bench import stats  # noqa: PLC0415

        shape_list = stats.parse_shapes(shapes) if shapes else kb.shapes_for_model(model_config)
        cfg = kb.KernelBenchConfig(
            shapes=shape_list, ms=stats.parse_ints(ms, "--m"), bits=stats.parse_ints(bits, "--bits", 2),
            group_sizes=_group_sizes(group_size), symmetric=not asym, warmup=warmup, iters=iters,
            w4a8_group_sizes=[] if w4a8.strip().lower() in ("", "none-rows") else _group_sizes(w4a8, "--w4a8"),
            mixed_outliers=_fractions(mixed),
        )
        _need_gpu()
        from qtool.bench.cuda_cases import CudaCases  # noqa: PLC0415
        from qtool.bench.timing import CudaTimer  # noqa: PLC0415

        click.echo(kb.HEADER, err=True)
        report = kb.run_kernel_bench(cfg, CudaCases(), CudaTimer(), log=lambda s: click.echo(s, err=True))
        _deliver(report, kb.format_report(report), json_flag, json_out, stats.validate_kernels_report(report))
        if plot_path:
            kb.write_plot(report, plot_path)

    go()


@bench.command("e2e")
@click.option("--model-config", "model_config", default="llama-2-7b", show_default=True,
              help="Model dimensions (llama-2-7b, llama-3-8b, mistral-7b, tiny); weights are random.")
@click.option("--bits", default=4, show_default=True, type=click.Choice(["4", "8"]), callback=lambda c, p, v: int(v))
@click.option("--group-size", "group_size", default="128", show_default=True)
@click.option("--prompt", default=None, type=click.IntRange(1, None),
              help="Prefill tokens (default 2048; 1024 with --throughput).")
@click.option("--batches", default=None, help="Decode batch sizes (default 1,16,64; with --throughput "
                                               "16,64,256,max, max being the largest batch whose cache fits).")
@click.option("--context", default=128, show_default=True, type=click.IntRange(2, None),
              help="Static KV-cache length for decode (attention reads all of it).")
@click.option("--throughput", is_flag=True, help="Batched generation throughput (prompt + --new-tokens per "
                                                 "sequence) of the --variants instead of prefill/decode latency.")
@click.option("--new-tokens", default=512, show_default=True, type=click.IntRange(2, None),
              help="Generated tokens per sequence (--throughput).")
@click.option("--variants", default="fp16,fp8,w4a16,w4a8kv4", show_default=True,
              help="Formats compared by --throughput: fp16, fp8 (W8A8 + FP8 cache), w4a16, w4a8kv4 (qoq + KV4).")
@click.option("--iters", default=50, show_default=True, type=click.IntRange(10, None))
@json_options
def e2e_cmd(model_config: str, bits: int, group_size: str, prompt: int | None, batches: str | None, context: int,
            throughput: bool, new_tokens: int, variants: str, iters: int, json_flag: bool, json_out: str | None) -> None:
    """Prefill and decode tokens/s, FP16 vs grouped_int, same decoder, CUDA graphs, peak GPU memory; with
    --throughput, generated tokens/s of FP16, FP8, W4A16 and W4A8KV4 up to the largest batch that fits."""

    def go() -> None:
        from qtool.bench import stats  # noqa: PLC0415
        from qtool.bench.e2e import dims_for, format_e2e, run_e2e  # noqa: PLC0415

        dims_for(model_config)
        gs = _group_sizes(group_size)
        if len(gs) != 1:
            raise BenchError(f"--group-size: found {group_size!r}, expected one value for e2e")
        if throughput:
            _throughput(model_config, gs[0], prompt or 1024, new_tokens, batches or "16,64,256,max", variants,
                        iters, json_flag, json_out)
            return
        bl = stats.parse_ints(batches or "1,16,64", "--batches")
        prompt_n = prompt or 2048
        _need_gpu()
        report = run_e2e(model_config, bits, gs[0], prompt_n, bl, context, iters,
                         log=lambda s: click.echo(s, err=True))
        _deliver(report, format_e2e(report), json_flag, json_out)

    go()


def _throughput(model_config: str, group_size: int | None, prompt: int, new_tokens: int, batches: str,
                variants: str, iters: int, json_flag: bool, json_out: str | None) -> None:
    from qtool.bench import stats  # noqa: PLC0415
    from qtool.bench import throughput as tp  # noqa: PLC0415

    names = [v.strip().lower() for v in variants.split(",") if v.strip()]
    bad = [v for v in names if v not in tp.VARIANTS]
    if bad or not names:
        raise BenchError(f"--variants: found {variants!r}, expected some of {', '.join(tp.VARIANTS)}")
    sizes: list[int | str] = ["max" if b.strip().lower() == "max" else b for b in batches.split(",") if b.strip()]
    nums = ",".join(str(b) for b in sizes if b != "max")
    sizes = [*stats.parse_ints(nums, "--batches"), *(["max"] if "max" in sizes else [])] if nums else ["max"]
    _need_gpu()
    report = tp.run_throughput(model_config, names, group_size, prompt, new_tokens, sizes, iters,
                               log=lambda s: click.echo(s, err=True))
    _deliver(report, tp.format_throughput(report), json_flag, json_out)


@bench.command("quik")
@click.option("--model-config", "model_config", default="llama-2-7b", show_default=True,
              help="Known model name or a config.json path; gives the KxN shapes.")
@click.option("--shapes", default=None, help="Explicit KxN list (in_features x out_features).")
@click.option("--m", "m", default=2048, show_default=True, type=click.IntRange(1, None), help="Tokens M.")
@click.option("--outliers", default="0,128,256,512,1024", show_default=True,
              help="Outlier counts of the W4A4 sweep (Fig. 14), comma-separated.")
@click.option("--ladder-outliers", "ladder_outliers", default=256, show_default=True, type=click.IntRange(0, None),
              help="Outlier count of the fusion ladder (Fig. 5) and of the W8A8 row.")
@click.option("--warmup", default=10, show_default=True, type=click.IntRange(0, None))
@click.option("--iters", default=100, show_default=True, type=click.IntRange(50, None))
@json_options
def quik_cmd(model_config: str, shapes: str | None, m: int, outliers: str, ladder_outliers: int, warmup: int,
             iters: int, json_flag: bool, json_out: str | None) -> None:
    """Time the QUIK W4A4/W8A8 kernels (fusion ladder, outlier sweep) against cuBLAS FP16/INT8/FP8."""

    def go() -> None:
        from qtool.bench import kernels as kb  # noqa: PLC0415
        from qtool.bench import quik as qb  # noqa: PLC0415
        from qtool.bench import stats  # noqa: PLC0415

        shape_list = stats.parse_shapes(shapes) if shapes else kb.shapes_for_model(model_config)
        counts = tuple(stats.parse_ints(outliers, "--outliers", 0))
        cfg = qb.QuikBenchConfig(shapes=shape_list, m=m, outlier_counts=counts, ladder_outliers=ladder_outliers,
                                 warmup=warmup, iters=iters)
        _need_gpu()
        from qtool.bench.cuda_cases import QuikCudaCases  # noqa: PLC0415
        from qtool.bench.timing import CudaTimer  # noqa: PLC0415

        report = qb.run_quik_bench(cfg, QuikCudaCases(), CudaTimer(), log=lambda s: click.echo(s, err=True))
        _deliver(report, qb.format_report(report), json_flag, json_out, qb.validate_report(report))

    go()


@bench.command("attention")
@click.option("--model-config", "model_config", default="llama-2-7b", show_default=True,
              help="Model whose attention heads to use (llama-2-7b, llama-3-8b, mistral-7b, tiny).")
@click.option("--batches", default="1,16,64", show_default=True, help="Sequences per step, comma-separated.")
@click.option("--contexts", default="1024", show_default=True, help="Cached tokens per sequence, comma-separated.")
@click.option("--rows", "rows", default="fp16-sdpa,fp16,fp8,int8,int4,int4-fma", show_default=True,
              help="Caches to time: fp16-sdpa (torch), fp16 (our kernel), fp8, int8, int4 (the dispatched form), "
                   "int4-fma (KV4 through the CUDA-core form).")
@click.option("--warmup", default=5, show_default=True, type=click.IntRange(0, None))
@click.option("--iters", default=50, show_default=True, type=click.IntRange(10, None))
@json_options
def attention_cmd(model_config: str, batches: str, contexts: str, rows: str, warmup: int, iters: int,
                  json_flag: bool, json_out: str | None) -> None:
    """Decode attention over an FP16 cache (torch SDPA, our kernel) against FP8, INT8 and INT4 (KV4) caches."""

    def go() -> None:
        from qtool.bench import attention as ab  # noqa: PLC0415
        from qtool.bench import stats  # noqa: PLC0415
        from qtool.bench.e2e import dims_for  # noqa: PLC0415

        dims_for(model_config)
        names = [r.strip().lower() for r in rows.split(",") if r.strip()]
        bad = [r for r in names if r not in ab.ROWS]
        if bad or not names:
            raise BenchError(f"--rows: found {rows!r}, expected some of {', '.join(ab.ROWS)}")
        bl, cl = stats.parse_ints(batches, "--batches"), stats.parse_ints(contexts, "--contexts")
        _need_gpu()
        from qtool.bench.timing import CudaTimer  # noqa: PLC0415

        report = ab.run_attention_bench(model_config, bl, cl, names, warmup, iters, CudaTimer(),
                                        log=lambda s: click.echo(s, err=True))
        _deliver(report, ab.format_attention(report), json_flag, json_out)

    go()


if __name__ == "__main__":
    bench()
