"""Measure `qtool quantize` over several GPUs: GPTQ W4 g128 (asymmetric, act-order, static groups) of the
7B-shaped random-weight model (scripts/make_test_model.py), C4 calibration of 128 windows of 2048 tokens, on 1, 2
and 4 GPUs; print the wall time of each run, the speed-ups over one GPU, and how far the checkpoints are apart.

    QTOOL_ASSETS=/path/to/assets python scripts/multigpu_quantize.py [--work /tmp/qtool-multigpu] [--out DIR]

Within the 10 minutes one command may take on an H100 machine, split it: `--plan 1+2` (writes the model, then
the 1-GPU and the 2-GPU runs at once), then `--plan 4` on the same `--work` folder, which reports all three. On a
machine of 2 GPUs: `--plan 1,2 --layers 8` (a model of 8 blocks: shorter runs, the same per-block work).

The 1-GPU run is the plain single-process command; N > 1 GPUs run under `torchrun --standalone --nproc-per-node N`.
`--plan` says which runs go at the same time: "1+2,4" (the default) runs the 1-GPU run on GPU 0 beside the 2-GPU
run on GPUs 1-2, then the 4-GPU run on GPUs 0-3, so the whole measurement takes about the 1-GPU time plus the
4-GPU time. Concurrent runs share the host's CPUs, memory bandwidth and disk: "1,2,4" runs them one after another
(the cleanest numbers, the longest wait).

Agreement: for every quantized linear, the fraction of 4-bit codes equal to the 1-GPU run's, the largest
difference of the dequantized weights (relative to the layer's largest |w|), and each run's quantization error
||W - Q(W)|| / ||W|| against the model's float weights (the runs agree when these are the same).

On a CPU (for a check of this script): --device cpu --shape tiny --samples 8 --seq-len 64 --plan 1+2.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ASSETS = Path(os.environ.get("QTOOL_ASSETS", ROOT.parent / "shared" / "assets"))
C4 = ASSETS / "data" / "c4" / "c4-en-train.00000-of-01024.first1000.jsonl"

RECIPE = """\
model: {model}
calibration:
  source: {source}
  num_samples: {samples}
  seq_len: {seq_len}
  seed: 0
settings:
  device: {device}
stages:
  - stage: gptq
    bits: 4
    group_size: 128
    symmetric: false
    act_order: true
    static_groups: true
"""


def parse_plan(plan: str) -> list[list[int]]:
    phases = [[int(n) for n in phase.split("+")] for phase in plan.split(",")]
    if not phases or any(n < 1 for p in phases for n in p):
        raise SystemExit(
            f"--plan: found {plan!r}, expected GPU counts joined by + (at once) and , (one after another)"
        )
    return phases


def command(n: int, recipe: Path, out: Path) -> list[str]:
    qtool = ["-m", "qtool.cli", "quantize", str(recipe), "-o", str(out), "--overwrite", "--json"]
    if n == 1:
        return [sys.executable, *qtool]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", *qtool]


def run_phase(counts: list[int], recipe: Path, work: Path, device: str) -> dict[int, dict]:
    """Start the runs of one phase at once on disjoint GPUs; wait for all; their summaries and wall times."""
    procs, first = {}, 0
    for n in counts:
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        if device == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in range(first, first + n))
        if n > 1 and "OMP_NUM_THREADS" not in os.environ:
            # torchrun would set 1: each rank's CPU work (reading shards, copies, packing on the CPU) on one thread.
            env["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // sum(counts)))
        first += n
        log = open(work / f"run-{n}.log", "w")  # closed below
        procs[n] = (
            subprocess.Popen(
                command(n, recipe, work / f"q{n}"),
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
            ),
            log,
            time.perf_counter(),
        )
        print(f"started {n} GPU{'s' * (n > 1)}: {env.get('CUDA_VISIBLE_DEVICES', device)}", flush=True)
    ends: dict[int, float] = {}
    while len(ends) < len(procs):  # each run's own end (its JSON summary is small: the pipe never fills)
        for n, (p, _, _) in procs.items():
            if n not in ends and p.poll() is not None:
                ends[n] = time.perf_counter()
        time.sleep(0.2)
    done = {}
    for n, (p, log, t0) in procs.items():
        out, _ = p.communicate()
        wall = ends[n] - t0
        log.close()
        if p.returncode != 0:
            tail = (work / f"run-{n}.log").read_text().strip().splitlines()[-5:]
            raise SystemExit(f"the {n}-GPU run failed (exit {p.returncode}):\n" + "\n".join(tail))
        summary = json.loads(out)
        (work / f"run-{n}.json").write_text(json.dumps(summary, indent=1))
        done[n] = {
            "wall_s": round(wall, 1),
            "quantize_s": summary["timings"]["quantize_s"],
            "total_s": summary["timings"]["total_s"],
            "world_size": summary.get("world_size", 1),
            "ranks": summary.get("ranks", []),
        }
        tm = summary["timings"]
        done[n].update(
            {k: tm[k] for k in ("startup_s", "join_s", "write_s", "preflight_s", "calibration_s") if k in tm}
        )
        print(
            f"{n} GPU{'s' * (n > 1)}: {wall:.1f} s wall = start {tm.get('startup_s', 0):.1f} + joining the "
            f"process group {tm.get('join_s', 0):.1f} + total "
            f"{tm['total_s']:.1f} (preflight {tm.get('preflight_s', 0):.1f}, calibration "
            f"{tm.get('calibration_s', 0):.1f}, quantize {tm['quantize_s']:.1f}) + write {tm.get('write_s', 0):.1f} "
            f"+ the rest (the launcher, leaving the group, exit)",
            flush=True,
        )
        for r in done[n]["ranks"]:
            print(
                f"  rank {r['rank']}: quantize {r['quantize_s']:.1f} s = statistics {r.get('stats_s', 0):.1f} + "
                f"solves {r.get('solve_s', 0):.1f} + sharing (and waiting) {r.get('share_s', 0):.1f} + waiting "
                f"for weights {r.get('onload_s', 0):.1f} + for the work folder {r.get('commit_s', 0):.1f} + the "
                f"rest",
                flush=True,
            )
    return done


def compare(model: Path, checkpoints: dict[int, Path], device: str) -> dict:
    """Codes, dequantized weights and quantization error of every quantized linear, each run against the first."""
    import torch
    from safetensors import safe_open

    from qtool.layouts.grouped_int.layout import GroupedIntWeight
    from qtool.models.integrity import read_header, read_tensor

    dev = "cuda" if device == "cuda" and torch.cuda.is_available() else "cpu"
    base_n = min(checkpoints)
    config = json.loads((checkpoints[base_n] / "config.json").read_text())["quantization_config"]["layers"]
    originals = {}
    for f in sorted(model.glob("*.safetensors")):
        for name, info in read_header(f, RuntimeError).items():
            originals[name] = info
    handles = {
        n: safe_open(str(c / "model.safetensors"), framework="pt")
        if (c / "model.safetensors").exists()
        else None
        for n, c in checkpoints.items()
    }
    index = {
        n: json.loads((c / "model.safetensors.index.json").read_text())["weight_map"]
        if (c / "model.safetensors.index.json").exists()
        else None
        for n, c in checkpoints.items()
    }

    def tensors(n: int, layer: str) -> dict:
        out = {}
        for field in ("qweight", "scales", "zeros"):
            key = f"{layer}.{field}"
            h = handles[n]
            if index[n] is not None:
                if key not in index[n]:
                    continue
                with safe_open(str(checkpoints[n] / index[n][key]), framework="pt") as s:
                    out[field] = s.get_tensor(key)
            elif key in h.keys():
                out[field] = h.get_tensor(key)
        return out

    stats = {
        n: {"codes_equal": [0, 0], "max_rel_diff": 0.0, "err_num": 0.0, "err_den": 0.0} for n in checkpoints
    }
    for layer, cfg in sorted(config.items()):
        w = read_tensor(originals[f"{layer}.weight"]).to(dev, torch.float32)
        deq = {}
        for n in checkpoints:
            q = GroupedIntWeight.from_tensors(
                layer, cfg, {k: v.to(dev) for k, v in tensors(n, layer).items()}
            )
            deq[n] = (q.dequantize(torch.float32), q.codes())
            s = stats[n]
            s["err_num"] += float((w - deq[n][0]).pow(2).sum())
            s["err_den"] += float(w.pow(2).sum())
        for n in checkpoints:
            s = stats[n]
            s["codes_equal"][0] += int((deq[n][1] == deq[base_n][1]).sum())
            s["codes_equal"][1] += deq[n][1].numel()
            rel = float((deq[n][0] - deq[base_n][0]).abs().max() / w.abs().max())
            s["max_rel_diff"] = max(s["max_rel_diff"], rel)
    return {
        n: {
            "codes_equal": round(s["codes_equal"][0] / max(s["codes_equal"][1], 1), 6),
            "max_rel_weight_diff": round(s["max_rel_diff"], 6),
            "quant_error": round((s["err_num"] / max(s["err_den"], 1e-30)) ** 0.5, 6),
        }
        for n, s in stats.items()
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--work", type=Path, default=Path("/tmp/qtool-multigpu"), help="model, checkpoints and logs"
    )
    ap.add_argument("--out", type=Path, help="also copy the summary JSON here")
    ap.add_argument("--shape", default="7b", help="scripts/make_test_model.py --shape")
    ap.add_argument("--layers", type=int, help="scripts/make_test_model.py --layers (default: the shape's)")
    ap.add_argument("--samples", type=int, default=128, help="calibration windows")
    ap.add_argument("--seq-len", type=int, default=2048, help="tokens per calibration window")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument(
        "--plan", default="1+2,4", help="GPU counts: + at once on disjoint GPUs, , one after another"
    )
    ap.add_argument("--no-compare", action="store_true", help="skip the checkpoint comparison")
    args = ap.parse_args()
    phases = parse_plan(args.plan)
    if args.device == "cuda":
        import torch

        have = torch.cuda.device_count()
        if max(sum(p) for p in phases) > have:
            raise SystemExit(
                f"--plan: found {args.plan!r}, whose largest phase needs {max(sum(p) for p in phases)} "
                f"GPUs; expected at most the {have} of this machine (e.g. --plan 1,2 on 2 GPUs)"
            )
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    model = work / f"model-{args.shape}{'-' + str(args.layers) if args.layers else ''}"
    t0 = time.perf_counter()
    if not (model / "config.json").is_file():
        layers = ["--layers", str(args.layers)] if args.layers else []
        subprocess.run(
            [
                sys.executable,
                str(ROOT / "scripts" / "make_test_model.py"),
                str(model),
                "--shape",
                args.shape,
                *layers,
            ],
            check=True,
        )
        print(f"model written in {time.perf_counter() - t0:.0f} s", flush=True)
    recipe = work / "recipe.yaml"
    recipe.write_text(
        RECIPE.format(model=model, source=C4, samples=args.samples, seq_len=args.seq_len, device=args.device)
    )
    # Every run starts warm: a dry run first compiles the bytecode (where the interpreter can write it; set
    # PYTHONPYCACHEPREFIX where site-packages is read-only) and reads the model's headers, which the first timed
    # run would otherwise pay for alone.
    t = time.perf_counter()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "qtool.cli",
            "quantize",
            str(recipe),
            "-o",
            str(work / "dry"),
            "--dry-run",
            "-q",
        ],
        cwd=ROOT,
        check=True,
        stdout=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")},
    )
    print(f"warm-up (dry run) {time.perf_counter() - t:.1f} s", flush=True)
    runs: dict[int, dict] = {}
    for counts in phases:
        runs.update(run_phase(counts, recipe, work, args.device))
    # Runs of an earlier invocation on the same work folder and recipe (a measurement split over two commands,
    # e.g. --plan 1+2 then --plan 4) join the table and the comparison.
    for f in sorted(work.glob("run-*.done.json")):
        n = int(f.name.split("-")[1].split(".")[0])
        earlier = json.loads(f.read_text())
        if n not in runs and earlier.get("recipe") == recipe.read_text() and (work / f"q{n}").is_dir():
            runs[n] = earlier["run"]
            print(f"{n} GPU{'s' * (n > 1)}: from an earlier invocation", flush=True)
    for n, r in runs.items():
        (work / f"run-{n}.done.json").write_text(json.dumps({"recipe": recipe.read_text(), "run": r}))
    result = {
        "model": str(model),
        "samples": args.samples,
        "seq_len": args.seq_len,
        "plan": args.plan,
        "runs": {str(n): r for n, r in sorted(runs.items())},
    }
    if 1 in runs:
        result["speedup_wall"] = {
            str(n): round(runs[1]["wall_s"] / r["wall_s"], 2) for n, r in sorted(runs.items())
        }
        result["speedup_quantize"] = {
            str(n): round(runs[1]["quantize_s"] / r["quantize_s"], 2) for n, r in sorted(runs.items())
        }
    if not args.no_compare and len(runs) > 1:
        t = time.perf_counter()
        result["agreement"] = {
            str(n): v
            for n, v in compare(model, {n: work / f"q{n}" for n in sorted(runs)}, args.device).items()
        }
        print(f"compared in {time.perf_counter() - t:.0f} s", flush=True)
    try:
        import torch

        if args.device == "cuda" and torch.cuda.is_available():
            result["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    text = json.dumps(result, indent=1)
    (work / "summary.json").write_text(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "multigpu_summary.json").write_text(text)
    print(text)
    print(
        f"{'GPUs':>4} {'wall s':>8} {'quantize s':>11} {'speed-up (wall)':>16} {'codes equal':>12} "
        f"{'max dW/|W|':>11} {'quant err':>10}"
    )
    for n, r in sorted(runs.items()):
        a = result.get("agreement", {}).get(str(n), {})
        print(
            f"{n:>4} {r['wall_s']:>8.1f} {r['quantize_s']:>11.1f} "
            f"{result.get('speedup_wall', {}).get(str(n), float('nan')):>16.2f} "
            f"{a.get('codes_equal', float('nan')):>12.4f} {a.get('max_rel_weight_diff', float('nan')):>11.4g} "
            f"{a.get('quant_error', float('nan')):>10.5f}"
        )
    print(f"total {time.perf_counter() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
