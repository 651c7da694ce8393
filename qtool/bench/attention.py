"""`qtool bench attention`: one decode step's attention over a KV cache, FP16 against the quantized caches.

Rows, each timed over the same query and a cache of `context` tokens per sequence (the step attends to all of
them): torch's `scaled_dot_product_attention` on an FP16 cache (the backend torch picks, named in the report),
the quantized-cache kernel (qtool/kv_cache/cuda.py) with FP8, INT8 and INT4 caches, and the vector-quantized caches
of stage `vq_kv` (qtool/kv_cache/vq_cuda.py): CQ-2 and CQ-4 through the dispatched form, CQ-2 through each form
(`cq2-lut`, `cq2-direct`). The report names the kernel and form of each row. Decode attention reads each cached
byte once, so the report gives bytes moved and the bandwidth reached next to the time; cache sets rotate so that no
call finds its cache in L2.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from qtool.bench import plot, stats, tables
from qtool.bench.e2e import dims_for
from qtool.bench.timing import Timer

ATTENTION_SCHEMA = "qtool.bench.attention/1"
ROWS = ("fp16-sdpa", "fp8", "int8", "int4", "int4-fma", "cq2", "cq4", "cq2-lut", "cq2-direct")
CQ_ROWS = {"cq2": (4, None), "cq4": (2, None), "cq2-lut": (4, "lut"), "cq2-direct": (4, "direct")}  # d, form
L2_ROTATE_BYTES = 150 * 2**20  # three times the H100's L2: a call never finds the cache it reads there


def _sdpa_backend_name() -> str:
    try:
        from torch.nn.attention import SDPBackend  # noqa: F401
    except ImportError:
        return "default"
    return "flash" if torch.backends.cuda.flash_sdp_enabled() else "default"


def attention_names(
    rows: list[str], heads: int, kv_heads: int, head_dim: int, backend: str
) -> dict[str, str]:
    """What each row runs, for the report: SDPA and its backend for the FP16 cache, else qtool's kernel for the
    cache and the form it runs for these heads (the CQ kernels pick theirs by batch and length)."""
    from qtool.kv_cache.cuda import FORM_NAMES, attention_kernel

    out = {}
    for row in rows:
        if row == "fp16-sdpa":
            out[row] = f"torch SDPA ({backend}), FP16 cache"
        elif row in CQ_ROWS:
            dv, how = CQ_ROWS[row]
            cache = f"CQ-{8 // dv}"
            out[row] = (
                f"qtool {cache} kernel ({how} form)" if how else f"qtool {cache} kernel (dispatched form)"
            )
        elif row == "fp16":  # in reports from before it was removed
            out[row] = "qtool FP16 decode kernel (removed since)"
        elif row == "int4-fma":
            out[row] = f"qtool KV4 kernel ({FORM_NAMES['fma']})"
        else:
            name = "KV4" if row == "int4" else f"{row.upper()}-cache"
            out[row] = (
                f"qtool {name} kernel ({FORM_NAMES[attention_kernel(row, heads // kv_heads, head_dim)]})"
            )
    return out


def _cases(
    row: str,
    b: int,
    h: int,
    kvh: int,
    d: int,
    length: int,
    sets: int,
    gen: torch.Generator,
    dev: torch.device,
) -> tuple[list[Callable[[], Any]], int]:
    """The functions to time (one per cache set) and the bytes one call reads."""
    q = (torch.randn(b, h, 1, d, device=dev, generator=gen) * 0.5).half()
    pos = torch.tensor([length - 1], device=dev)
    fns: list[Callable[[], Any]] = []
    nbytes = 0
    for _ in range(sets):
        if row == "fp16-sdpa":
            k = torch.randn(b, kvh, length, d, device=dev, generator=gen).half()
            v = torch.randn(b, kvh, length, d, device=dev, generator=gen).half()
            nbytes = 2 * k.numel() * 2
            gqa = h != kvh
            fns.append(
                lambda q=q, k=k, v=v, gqa=gqa: torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, enable_gqa=gqa
                )
            )
        elif row in CQ_ROWS:
            from qtool.kv_cache import vq_cuda as vqa

            dv, form = CQ_ROWS[row]
            books = [
                (torch.randn(kvh, d // dv, 256, dv, device=dev, generator=gen) * 0.3).half() for _ in range(2)
            ]
            cache = vqa.allocate(books[0], books[1], b, length, dev)
            for t in (cache.k, cache.v):
                t.copy_(
                    torch.randint(0, 256, t.shape, device=dev, generator=gen, dtype=torch.int32).to(
                        torch.uint8
                    )
                )
            nbytes = cache.nbytes()
            out = torch.empty(b, 1, h, d, dtype=torch.float16, device=dev)
            fns.append(
                lambda q=q, cache=cache, out=out, form=form: vqa.attention(q, cache, pos, out=out, form=form)
            )
        else:
            from qtool.kv_cache import cuda as kvc

            # int4-fma: the KV4 cache through the CUDA-core kernel, whatever the dispatch picks for int4
            mode, kernel = ("int4", "fma") if row == "int4-fma" else (row, None)
            cache = kvc.allocate(mode, b, kvh, length, d, dev, k_scale=0.05, v_scale=0.05)
            for t in (cache.k, cache.v):
                if row == "fp8":
                    t.copy_(
                        (torch.randn(t.shape, device=dev, generator=gen) * 4)
                        .to(torch.float8_e4m3fn)
                        .view(torch.uint8)
                    )
                else:
                    t.copy_(
                        torch.randint(0, 256, t.shape, device=dev, generator=gen, dtype=torch.int32).to(
                            torch.uint8
                        )
                    )
            for t in (cache.k_params, cache.v_params):
                if t is not None:
                    t[..., 0] = 0.1
                    t[..., 1] = 7.5
            nbytes = cache.nbytes()
            out = torch.empty(b, 1, h, d, dtype=torch.float16, device=dev)
            fns.append(
                lambda q=q, cache=cache, out=out, kernel=kernel: kvc.attention(
                    q, cache, pos, out=out, kernel=kernel
                )
            )
    return fns, nbytes


def _row_bytes(row: str, b: int, kvh: int, d: int, length: int) -> int:
    if row == "fp16-sdpa":
        return 2 * b * kvh * length * d * 2
    if row in CQ_ROWS:
        from qtool.kv_cache.vq_cuda import bytes_per_token as vq_bytes

        return b * length * vq_bytes(kvh, d, CQ_ROWS[row][0])
    from qtool.kv_cache.cuda import bytes_per_token

    return b * length * bytes_per_token("int4" if row == "int4-fma" else row, kvh, d)


def run_attention_bench(
    model: str,
    batches: list[int],
    contexts: list[int],
    rows: list[str],
    warmup: int,
    iters: int,
    timer: Timer,
    log: Callable[[str], None] = lambda s: None,
) -> dict[str, Any]:
    d = dims_for(model)
    dev = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device=dev).manual_seed(0)
    results = []
    for b in batches:
        for length in contexts:
            entry: dict[str, Any] = {"batch": b, "context": length, "rows": {}}
            for row in rows:
                per_set = _row_bytes(row, b, d.kv_heads, d.head_dim, length)
                sets = max(1, math.ceil(L2_ROTATE_BYTES / per_set))
                fns, nbytes = _cases(row, b, d.heads, d.kv_heads, d.head_dim, length, sets, gen, dev)
                s = stats.summarize(timer(fns, warmup, iters))
                entry["rows"][row] = {
                    **s.to_dict(),
                    "bytes": nbytes,
                    "tbps": nbytes / (s.median_us * 1e-6) / 1e12,
                    "sets": sets,
                }
                del fns
                torch.cuda.empty_cache()
            base = entry["rows"].get("fp16-sdpa", {}).get("median_us")
            for r in entry["rows"].values():
                r["speedup_vs_sdpa"] = stats.speedup(base, r["median_us"])
            log(
                f"b{b} L{length}: "
                + ", ".join(f"{k} {v['median_us']:.1f} us" for k, v in entry["rows"].items())
            )
            results.append(entry)
    backend = _sdpa_backend_name()
    return {
        "schema": ATTENTION_SCHEMA,
        "model": model,
        "heads": d.heads,
        "kv_heads": d.kv_heads,
        "head_dim": d.head_dim,
        "device": torch.cuda.get_device_name(dev),
        "sdpa_backend": backend,
        "attention": attention_names(rows, d.heads, d.kv_heads, d.head_dim, backend),
        "torch": torch.__version__,
        "results": results,
    }


def report_parts(r: dict[str, Any]) -> list[Any]:
    rows = list(r["results"][0]["rows"]) if r["results"] else []
    body = []
    for e in r["results"]:
        cells = []
        for x in rows:
            v = e["rows"][x]
            sp = v.get("speedup_vs_sdpa")
            cells.append(f"{v['median_us']:.1f} ({v['tbps']:.2f}){'' if sp is None else f' {sp:.2f}x'}")
        body.append([str(e["batch"]), str(e["context"]), *cells])
    backend = r.get("sdpa_backend", "default")
    # reports from before the names were recorded: the same names, from the heads the report gives
    names = r.get("attention") or attention_names(rows, r["heads"], r["kv_heads"], r["head_dim"], backend)
    return [
        tables.table(
            f"decode attention, {r['model']} heads (H {r['heads']}, KVH {r['kv_heads']}, D {r['head_dim']}) on "
            f"{r['device']}: us per step (TB/s read) and speedup over torch SDPA ({backend}) on an FP16 cache",
            ["batch", "context", *rows],
            body,
            left=0,
        ),
        "attention: " + "; ".join(f"{x} = {names.get(x, 'not recorded')}" for x in rows),
    ]


def format_attention(r: dict[str, Any]) -> str:
    return tables.render(report_parts(r))


def figure(r: dict[str, Any]) -> plot.Figure:
    """Time of torch SDPA on an FP16 cache / time of each cache's kernel, per batch and context."""
    x = [f"b{e['batch']} L{e['context']}" for e in r["results"]]
    names = [n for n in (list(r["results"][0]["rows"]) if r["results"] else []) if n != "fp16-sdpa"]
    series = {n: [e["rows"][n].get("speedup_vs_sdpa") for e in r["results"]] for n in names}
    return plot.Figure(
        f"qtool bench attention {r['model']} on {r['device']}",
        "SDPA time / time",
        f"torch SDPA ({r.get('sdpa_backend')}) on an FP16 cache",
        [plot.Panel("decode attention, one step", x, series, kind="bar", xlabel="batch, context")],
    )
