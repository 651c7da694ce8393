"""Times the KV4 tensor-core decode attention (qtool/kv_cache/cuda.py) with each stage size of its warps' rings
(`copy_steps` 1: four bulk copies a 16-token step, the dispatched form; 2 and 4: the `_c2`/`_c4` entries, four
copies a stage of 2 or 4 consecutive steps), these with every stage's copies issued before the query is staged
(`c2`, `c4`) and with the first stage's alone (`c2e1`, `c4e1`: `early_stages` 1), beside torch SDPA on an FP16
cache, in one process (needs a Hopper GPU and cupy). Timing as `qtool bench attention` does it: CUDA-graph replays
over cache sets rotated past L2 (qtool.bench.timing), medians, context `--context` tokens attended in full. Per
(heads, batch): SDPA's time, then each form's us and speedup over SDPA, its kernel, dynamic shared memory,
registers, the blocks a multiprocessor holds, and the largest difference of its output from the one-step form's
(the forms sum the same terms in another order: float16 rounding, not more).

    PYTHONPATH=. python scripts/kv4_attention_variants.py [--models llama-2-7b,llama-3-8b]
        [--batches 1,16,64,160] [--forms c1,c2,c4,c2e1,c4e1] [--warps auto,4,8] [--iters 30] [--json out.json]

`--warps auto` takes the dispatch's block size (`tc_warps`) and split (`attention_splits`), columns named by the
form; 4 or 8 force the block size with the dispatch's split, columns `{form}/w{warps}`. See kernels/kv_cache/NOTES.md
(KV4 "Open") and scripts/bulk_copy_rate.py.
"""

from __future__ import annotations

import argparse
import json
import math
import re

import torch

from qtool.bench import stats
from qtool.bench.attention import L2_ROTATE_BYTES
from qtool.bench.e2e import dims_for
from qtool.bench.timing import CudaTimer
from qtool.cuda import compile as cc
from qtool.kv_cache import cuda as kvc


def _kv4_cache(b: int, kvh: int, length: int, d: int, gen: torch.Generator, dev: torch.device) -> kvc.KVCache:
    """Random codes (every nibble occurs) and the (scale, zero) `qtool bench attention` uses."""
    cache = kvc.allocate("int4", b, kvh, length, d, dev)
    for t in (cache.k, cache.v):
        t.copy_(torch.randint(0, 256, t.shape, device=dev, generator=gen, dtype=torch.int32).to(torch.uint8))
    for t in (cache.k_params, cache.v_params):
        t[..., 0] = 0.1
        t[..., 1] = 7.5
    return cache


def parse_form(text: str) -> tuple[str, int, int | None]:
    """`c4` -> ("c4", 4, None); `c4e1` -> ("c4e1", 4, 1)."""
    m = re.fullmatch(r"c(\d+)(?:e(\d+))?", text.strip())
    if m is None:
        raise SystemExit(
            f"--forms: found {text!r}, expected c{{copy_steps}} or c{{copy_steps}}e{{early_stages}}"
        )
    return text.strip(), int(m.group(1)), None if m.group(2) is None else int(m.group(2))


def _sets(per_set: int) -> int:
    return max(1, math.ceil(L2_ROTATE_BYTES / per_set))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="llama-2-7b,llama-3-8b")
    ap.add_argument("--batches", default="1,16,64,160")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--forms", default="c1,c2,c4,c2e1,c4e1", help="c{copy_steps}[e{early_stages}]")
    ap.add_argument("--warps", default="auto", help="auto (the dispatch's), and/or 4, 8")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda", torch.cuda.current_device())
    di = cc.device_index(dev)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    forms = [parse_form(f) for f in args.forms.split(",")]
    warp_opts: list[int | None] = [None if w == "auto" else int(w) for w in args.warps.split(",")]
    timer = CudaTimer()
    gen = torch.Generator(device=dev).manual_seed(0)
    length = args.context

    def t(fns) -> float:
        return stats.summarize(timer(fns, args.warmup, args.iters)).median_us

    print(
        f"device {torch.cuda.get_device_name(dev)} ({sms} SMs), torch {torch.__version__}, context {length}, "
        f"{kvc.TC_STAGES} stages a ring"
    )
    rows = []
    for model in args.models.split(","):
        dims = dims_for(model)
        h, kvh, d = dims.heads, dims.kv_heads, dims.head_dim
        for b in stats.parse_ints(args.batches, "--batches"):
            q = (torch.randn(b, h, 1, d, device=dev, generator=gen) * 0.5).half()
            pos = torch.tensor([length - 1], device=dev)
            # torch SDPA on an FP16 cache (the baseline of qtool bench attention)
            fp16_bytes = 2 * b * kvh * length * d * 2
            fns = []
            for _ in range(_sets(fp16_bytes)):
                k = torch.randn(b, kvh, length, d, device=dev, generator=gen).half()
                v = torch.randn(b, kvh, length, d, device=dev, generator=gen).half()
                fns.append(
                    lambda q=q, k=k, v=v, gqa=h != kvh: torch.nn.functional.scaled_dot_product_attention(
                        q, k, v, enable_gqa=gqa
                    )
                )
            sdpa = t(fns)
            del fns
            torch.cuda.empty_cache()
            kv4_bytes = b * length * kvc.bytes_per_token("int4", kvh, d)
            caches = [_kv4_cache(b, kvh, length, d, gen, dev) for _ in range(_sets(kv4_bytes))]
            outs = [torch.empty(b, 1, h, d, dtype=torch.float16, device=dev) for _ in caches]
            pairs = b * kvh
            splits = kvc.attention_splits(pairs, length, sms)
            ref = kvc.attention(q, caches[0], pos, copy_steps=1).clone()
            cells = {}
            line = f"{model} (H {h}, KVH {kvh}, D {d}) batch {b}: sdpa {sdpa:.1f} us"
            for w_opt in warp_opts:
                warps = kvc.tc_warps(pairs, sms) if w_opt is None else w_opt
                for form, cs, early in forms:
                    name = form if w_opt is None else f"{form}/w{warps}"
                    kw = {"copy_steps": cs, "early_stages": early, "warps": warps, "splits": splits}
                    smem = kvc.tc_shared_bytes(d, warps, cs)
                    try:
                        fn = kvc._module(di).fn(kvc.tc_entry(d, warps, cs))
                        got = kvc.attention(q, caches[0], pos, **kw)
                        diff = float((got.float() - ref.float()).abs().max())
                        us = t(
                            [
                                lambda q=q, c=c, pos=pos, o=o, kw=kw: kvc.attention(q, c, pos, out=o, **kw)
                                for c, o in zip(caches, outs, strict=True)
                            ]
                        )
                    except Exception as exc:  # a form that cannot run here: say so, time the rest
                        print(f"    {name}: {type(exc).__name__}: {exc}"[:200])
                        continue
                    blocks = cc.resident_blocks(fn, 32 * warps, smem, di)
                    cells[name] = {
                        "us": us,
                        "x_sdpa": sdpa / us,
                        "tbps": kv4_bytes / (us * 1e-6) / 1e12,
                        "entry": kvc.tc_entry(d, warps, cs),
                        "warps": warps,
                        "splits": splits,
                        "copy_steps": cs,
                        "early_stages": early,
                        "smem": smem,
                        "registers": int(fn.num_regs),
                        "blocks_per_sm": blocks,
                        "max_diff_vs_c1": diff,
                    }
                    line += f" | {name} {us:.1f} us {sdpa / us:.2f}x"
            print(line)
            for name, c in cells.items():
                print(
                    f"    {name}: {c['entry']} splits {c['splits']}, {c['smem']} B shared, {c['registers']} regs, "
                    f"{c['blocks_per_sm']} blocks/SM, {c['tbps']:.2f} TB/s, max |out - c1| {c['max_diff_vs_c1']:.2e}"
                )
            rows.append(
                {"model": model, "heads": h, "kv_heads": kvh, "head_dim": d, "batch": b, "context": length}
                | {"sdpa_us": sdpa, "kv4_bytes": kv4_bytes, "forms": cells}
            )
            del caches, outs
            torch.cuda.empty_cache()
    if timer.graph_failures:
        print("graph capture failed (timed eagerly):", "; ".join(timer.graph_failures[:3]))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(dev), "sms": sms, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
