"""How fast one lane a warp streams global memory into shared memory through `cp.async.bulk` (mbarrier completion),
by copy size: does the number of copies or the number of bytes bound it? The KV4 tensor-core attention
(kernels/kv_cache/quantized.cu) has each warp's first lane issue four copies a 16-token step (1 KB of key rows, 1 KB
of value rows, two 80-byte parameter runs at D = 128); kernels/kv_cache/NOTES.md (KV4 "Open") asks whether the copy
engine's issue rate bounds its prologue and loop. Needs a Hopper GPU and cupy.

One block a multiprocessor of W warps; lane 0 of each warp streams a fixed number of bytes a multiprocessor through a
ring of S stages, each stage a group of one to four copies (e.g. `1024`, or `1024+1024+80+80` for the attention's
step), waiting for a stage's previous group before reusing it; nothing consumes the data. `dram`: each warp reads its
own run (the whole far beyond L2); `l2`: all warps cycle through one 8 MB window (L2-resident after the first pass).
Per case: us a launch (CUDA-graph replays, medians), TB/s, copies a us per multiprocessor, GB/s per multiprocessor,
and each warp's SM cycles per copy (median over warps, from clock64). Same bytes a multiprocessor throughout: if
copies/us/SM stays put as the copies grow while TB/s rises, the count bounds; if TB/s stays put, the bytes do.

    PYTHONPATH=. python scripts/bulk_copy_rate.py [--groups 1024,2048,4096,8192,1024+1024+80+80,...] [--warps 1,8,16]
        [--stages 2,4] [--mb-per-sm 4] [--modes dram,l2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import torch

from qtool.bench import stats
from qtool.bench.timing import CudaTimer
from qtool.cuda import compile as cc

MAX_WARPS = 16
MAX_STAGES = 8
SMEM_LIMIT = 226 * 1024  # dynamic shared memory a block may take on sm_90 beside the 1 KB of barriers
L2_WINDOW = 8 * 2**20

SOURCE = r"""
__device__ __forceinline__ void wait_parity(unsigned bar, unsigned parity) {
    unsigned done;
    do {
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                     : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    } while (!done);
}

__device__ __forceinline__ void copy(unsigned dst, const unsigned char* src, int bytes, unsigned bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

// groups: groups of copies each warp issues; stages: its ring's depth; window_groups: 0 for a run of its own per
// warp, else the groups of a window all warps cycle through; s0..s3: the copies of a group in bytes (0: none)
extern "C" __global__ void bulk_stream(const unsigned char* __restrict__ src, int groups, int stages,
                                       int window_groups, int s0, int s1, int s2, int s3,
                                       long long* __restrict__ cycles) {
    extern __shared__ __align__(128) unsigned char ring[];
    __shared__ __align__(8) unsigned long long bars[16 * 8];
    const int warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    if ((threadIdx.x & 31) != 0) return;  // one issuing lane a warp, as the attention has
    const int group = s0 + s1 + s2 + s3;
    const unsigned bar0 = (unsigned)__cvta_generic_to_shared(&bars[warp * 8]);
    const unsigned buf0 = (unsigned)__cvta_generic_to_shared(ring) + (unsigned)(warp * stages * group);
    for (int i = 0; i < stages; ++i)
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar0 + 8 * i) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    const long long gw = (long long)blockIdx.x * nw + warp;
    const long long t0 = clock64();
    for (int it = 0; it < groups; ++it) {
        const int st = it % stages;
        const unsigned bar = bar0 + 8 * st;
        if (it >= stages) wait_parity(bar, (unsigned)(it / stages - 1) & 1u);
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(group) : "memory");
        const long long g = window_groups ? (gw + it) % window_groups : gw * groups + it;
        const unsigned char* p = src + g * group;
        unsigned d = buf0 + (unsigned)(st * group);
        copy(d, p, s0, bar);
        if (s1) copy(d + s0, p + s0, s1, bar);
        if (s2) copy(d + s0 + s1, p + s0 + s1, s2, bar);
        if (s3) copy(d + s0 + s1 + s2, p + s0 + s1 + s2, s3, bar);
    }
    for (int it = groups > stages ? groups - stages : 0; it < groups; ++it)
        wait_parity(bar0 + 8 * (it % stages), (unsigned)(it / stages) & 1u);
    cycles[gw] = clock64() - t0;
}
"""


def parse_group(text: str) -> list[int]:
    sizes = [int(x) for x in text.split("+")]
    if not 1 <= len(sizes) <= 4 or any(s <= 0 or s % 16 for s in sizes):
        raise SystemExit(f"--groups: found {text!r}, expected 1 to 4 sizes, multiples of 16, joined by +")
    return sizes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--groups",
        default="1024,2048,4096,8192,1024+1024+80+80,2048+2048+144+144,4096+4096+272+272",
        help="copy sizes of a stage, + between the copies of one stage (the last three: the attention's stage at "
        "1, 2 and 4 steps, D = 128)",
    )
    ap.add_argument("--warps", default="1,8,16")
    ap.add_argument("--stages", default="2,4")
    ap.add_argument("--mb-per-sm", type=float, default=4.0)
    ap.add_argument("--modes", default="dram,l2")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cupy = cc.require_cupy()
    dev = torch.device("cuda", torch.cuda.current_device())
    di = cc.device_index(dev)
    props = torch.cuda.get_device_properties(dev)
    sms = props.multi_processor_count
    with cupy.cuda.Device(di):
        fn = cupy.RawModule(code=SOURCE, options=("--std=c++17",)).get_function("bulk_stream")
        clock_khz = cupy.cuda.runtime.getDeviceProperties(di)["clockRate"]
    per_sm = int(args.mb_per_sm * 2**20)
    groups_list = [parse_group(g) for g in args.groups.split(",")]
    warps_list = stats.parse_ints(args.warps, "--warps")
    stages_list = stats.parse_ints(args.stages, "--stages")
    if max(warps_list) > MAX_WARPS or max(stages_list) > MAX_STAGES:
        raise SystemExit(f"--warps at most {MAX_WARPS}, --stages at most {MAX_STAGES}")
    biggest = max(sum(g) for g in groups_list)
    src = torch.empty(sms * per_sm + biggest * max(stages_list) * MAX_WARPS, dtype=torch.uint8, device=dev)
    src.random_(0, 256)
    timer = CudaTimer()
    print(
        f"device {props.name} ({sms} SMs, {clock_khz / 1e6:.2f} GHz), {per_sm / 2**20:.1f} MB a multiprocessor a "
        "launch"
    )
    print(
        "mode  warps stages group                    in flight/SM  copies/SM      us   TB/s  copies/us/SM  "
        "GB/s/SM  cycles/copy"
    )
    rows = []
    for mode in args.modes.split(","):
        for sizes in groups_list:
            group = sum(sizes)
            for warps in warps_list:
                for stages in stages_list:
                    smem = warps * stages * group
                    name = "+".join(str(s) for s in sizes)
                    if smem > SMEM_LIMIT:
                        print(f"{mode:5} {warps:5} {stages:6} {name:24} {smem} B of shared memory: skipped")
                        continue
                    groups = per_sm // (warps * group)
                    if groups < stages:
                        continue
                    window = L2_WINDOW // group if mode == "l2" else 0
                    cycles = torch.zeros(sms * warps, dtype=torch.int64, device=dev)
                    cc.allow_shared_memory(fn, smem)
                    s = [*sizes, 0, 0, 0][:4]
                    launch_args = (
                        cc.ptr(src),
                        cc.i32(groups),
                        cc.i32(stages),
                        cc.i32(window),
                        *(cc.i32(x) for x in s),
                        cc.ptr(cycles),
                    )

                    def run(launch_args=launch_args, warps=warps, smem=smem) -> None:
                        cc.launch(fn, (sms,), (32 * warps,), launch_args, shared_mem=smem, device=di)

                    us = stats.summarize(timer([run], 3, args.iters)).median_us
                    total = sms * warps * groups * group
                    copies = warps * groups * len(sizes)  # a multiprocessor's
                    cyc = float(cycles.double().median()) / (groups * len(sizes))
                    row = {
                        "mode": mode,
                        "warps": warps,
                        "stages": stages,
                        "group": sizes,
                        "inflight_per_sm": smem,
                        "copies_per_sm": copies,
                        "us": us,
                        "tbps": total / (us * 1e-6) / 1e12,
                        "copies_per_us_per_sm": copies / us,
                        "gbps_per_sm": total / sms / (us * 1e-6) / 1e9,
                        "cycles_per_copy": cyc,
                    }
                    rows.append(row)
                    print(
                        f"{mode:5} {warps:5} {stages:6} {name:24} {smem:12} {copies:10} {us:7.1f} "
                        f"{row['tbps']:6.2f} {row['copies_per_us_per_sm']:13.1f} {row['gbps_per_sm']:8.1f} "
                        f"{cyc:12.1f}"
                    )
    if timer.graph_failures:
        print("graph capture failed (timed eagerly):", "; ".join(timer.graph_failures[:3]))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": props.name, "sms": sms, "clock_khz": clock_khz, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
