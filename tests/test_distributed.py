"""`qtool quantize` over several processes (qtool/distributed.py), on the CPU with gloo: each process is started
the way torchrun starts it (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT in its environment), so a test can give
one rank other arguments or kill it.

- SmolLM2 GPTQ over 2 processes writes the checkpoint of 1 process that sums the statistics in the same order,
  byte for byte: the checkpoint equals the single-process one up to float summation order (every linear split
  by rows over the ranks).
- stories260K with QUIK (outliers), QoQ progressive GPTQ and mixed GPTQ over 2 processes: the same, for each
  layout split by rows and solved whole by one rank.
- How a group's linears are shared out over the ranks (whole, or split by rows).
- A linear solved by row slices (gptq, outliers, progressive, mixed) and joined is the whole solve, byte for
  byte.
- stories260K: ranks started with different recipes are refused on every rank, naming the rank; a killed rank
  stops the other within the heartbeat timeout, naming it, with the work folder at a block boundary, from which
  one process resumes and writes the checkpoint.
- In one process: stages whose statistics do not combine are refused naming the option, other commands refuse a
  launcher of several processes, a resumed run reads its share of activations written by any number of ranks.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qtool.checkpoint.loader import read_config

from bad_input import ROOT, Run, assert_one_line_error, reap
from conftest import STORIES, TINY_SAMPLE

pytestmark = pytest.mark.skipif(not STORIES.is_dir(), reason="stories260K assets not found")

RECIPE = f"""
model: {{model}}
calibration:
  source: {TINY_SAMPLE}
  num_samples: {{samples}}
  seq_len: 32
stages:
  - stage: gptq
    bits: {{bits}}
    group_size: 32
output: out
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(
    per_rank: list[list[object]], cwd: Path, env: dict[str, str] | None = None
) -> list[subprocess.Popen]:
    """One `qtool` process per rank, `per_rank[r]` its arguments, in torchrun's environment."""
    port, n = free_port(), len(per_rank)
    procs = []
    for r, args in enumerate(per_rank):
        e = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "OMP_NUM_THREADS": "1",
            "RANK": str(r),
            "LOCAL_RANK": str(r),
            "WORLD_SIZE": str(n),
            "LOCAL_WORLD_SIZE": str(n),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            **(env or {}),
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "qtool.cli", *map(str, args)],
                cwd=cwd,
                env=e,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    return procs


def finish(p: subprocess.Popen, timeout: float = 240) -> Run:
    out, err = p.communicate(timeout=timeout)
    return Run(p.returncode, out, err)


@pytest.fixture
def one_thread():
    """One intra-op thread in this process while a test runs qtool in it beside the ranks (as they run, and as
    the test workers do): two processes' OpenMP threads spinning for two cores make a 3 s run take 30 s."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def recipe(folder: Path, samples: int = 4, bits: int = 4, model: Path = STORIES) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"r{bits}.yaml"
    path.write_text(RECIPE.format(model=model, samples=samples, bits=bits))
    return path


def test_ranks_with_different_recipes_are_refused_naming_the_rank(tmp_path):
    r4, r3 = recipe(tmp_path, bits=4), recipe(tmp_path, bits=3)
    runs = [finish(p) for p in launch([["quantize", r4, "-q"], ["quantize", r3, "-q"]], tmp_path)]
    for res in runs:  # every rank stops, each with the same one line
        assert_one_line_error(res, 2, "rank 1", "differ from rank 0", output=tmp_path / "out")
    assert not (tmp_path / ".out.partial").exists()


def test_a_killed_rank_stops_the_other_naming_it_and_the_work_folder_resumes(tmp_path, one_thread):
    from qtool.checkpoint.partial import Work

    r = recipe(tmp_path, samples=16)
    partial = tmp_path / ".out.partial"
    procs = launch([["quantize", r, "-q"]] * 2, tmp_path, env={"QTOOL_DIST_TIMEOUT": "3"})
    try:
        t_end = time.monotonic() + 120
        while (
            (Work.read_state(partial) or {}).get("next_block", 0) < 1
            and procs[0].poll() is None
            and time.monotonic() < t_end
        ):
            time.sleep(0.01)
        procs[1].send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        res = finish(procs[0], timeout=60)
        finish(procs[1])
        waited = time.monotonic() - t0
    finally:  # a rank that did not stop must not outlive the test
        reap(*procs)
    line = assert_one_line_error(res, 6, "rank 1", output=tmp_path / "out")
    print(line, f"after {waited:.1f} s")
    assert waited < 3 + 5 + 10, (waited, line)  # timeout, the grace of the main thread, slack for a busy CPU
    state = Work.read_state(partial)
    assert state is not None  # a block boundary: what the state names is there, the rest is removed on resume
    for i in range(state["next_block"]):
        assert (partial / f"block-{i:05d}.safetensors").is_file()
    # One process goes on from the folder two left (its activations in one part per rank).
    from bad_input import run_cli

    done = run_cli(["quantize", r, "--resume", "-q", "--json"], cwd=tmp_path)
    assert done.exit_code == 0, done.output
    assert json.loads(done.stdout)["world_size"] == 1
    assert not partial.exists()


def summed_like_two_ranks(monkeypatch) -> None:
    """Make this process sum each linear's statistics as two ranks do: each half of the samples from zero, then
    the halves added (rank 0's + rank 1's), instead of one running sum."""
    import qtool.pipeline as pipeline
    from qtool.distributed import World

    real = pipeline._collect

    def collect(block, names, inputs, kwargs, hessian, world=None):
        parts = [
            real(block, names, [inputs[i] for i in World(r, 2).share(len(inputs))], kwargs, hessian)
            for r in range(2)
        ]
        # Linears of one input share a statistics object (q/k/v): each object is added to once.
        for n in {id(s): n for n, s in parts[0].items()}.values():
            s, other = parts[0][n], parts[1][n]
            s.tokens += other.tokens
            s.absmax = s.absmax.maximum(other.absmax)
            s.sq_sum += other.sq_sum
            if s.has_hessian:
                s._xtx += other._xtx
        return parts[0]

    monkeypatch.setattr(pipeline, "_collect", collect)


SMOLLM2_RECIPE = f"""
model: {{model}}
calibration:
  source: {TINY_SAMPLE}
  num_samples: 4
  seq_len: 128
stages:
  - stage: gptq
    bits: 4
    group_size: 64
    symmetric: false
    act_order: true
    static_groups: true
    targets:
      include: ["model.layers.[01].*"]
output: out
"""


@pytest.mark.slow
def test_smollm2_gptq_over_two_processes_writes_the_one_process_checkpoint(
    tmp_path, smollm2, monkeypatch, one_thread
):
    """GPTQ W4 g64 (asymmetric, act-order, static groups) of SmolLM2's first two blocks over 2 gloo processes
    (4 windows of 128 tokens, 2 per rank) against 1 process that sums each linear's statistics in the ranks'
    order: the same bytes (so the same perplexity). Samples split, statistics combined, solves spread over the
    ranks (q_proj on rank 0, k_proj on rank 1, gate/up on ranks 0 and 1, v_proj, o_proj and down_proj split by
    rows over both), weights sent back: nothing else may differ. (Against a plain single-process run, GPTQ's roundings flip
    under the other summation order: codes differ, perplexity by a fraction of a percent.)"""

    from bad_input import run_cli

    r = tmp_path / "r.yaml"
    r.write_text(SMOLLM2_RECIPE.format(model=smollm2))
    procs = launch([["quantize", r, "-q", "--json", "-o", tmp_path / "two"]] * 2, tmp_path)
    summed_like_two_ranks(monkeypatch)
    # One thread, as the ranks run (`one_thread`): another thread count may also sum a product in another order.
    one = run_cli(["quantize", r, "-q", "-o", tmp_path / "one"], cwd=tmp_path)
    assert one.exit_code == 0, one.output
    runs = [finish(p, timeout=900) for p in procs]
    assert runs[0].exit_code == 0 and runs[1].exit_code == 0, runs[0].output + runs[1].output
    summary = json.loads(runs[0].stdout)
    assert summary["world_size"] == 2 and [r["rank"] for r in summary["ranks"]] == [0, 1]
    assert all(r["quantize_s"] > 0 for r in summary["ranks"])
    assert summary["timings"]["join_s"] > 0 and summary["timings"]["startup_s"] > 0
    # Both ranks solved (each has linears or slices of every block) and shared.
    assert all(r["solve_s"] > 0 and r["share_s"] > 0 and r["stats_s"] > 0 for r in summary["ranks"]), summary
    assert all(r["solve_s"] + r["share_s"] + r["stats_s"] < r["quantize_s"] for r in summary["ranks"]), (
        summary
    )
    assert not runs[1].stdout.strip() and not runs[1].stderr.strip()  # rank 0 alone reports
    a, b = ((tmp_path / d / "model.safetensors").read_bytes() for d in ("one", "two"))
    assert a == b


MIXED_LAYOUTS_RECIPE = f"""
model: {STORIES}
calibration:
  source: {TINY_SAMPLE}
  num_samples: 4
  seq_len: 32
stages:
  - stage: outliers
    outliers: 8
    sparsity_24: true
    targets:
      include: ["*.q_proj", "*.k_proj", "*.down_proj"]
  - stage: progressive
    solver: gptq
    group_size: 32
    clip: true
    clip_qk: layer
    act_order: true
    static_groups: true
    targets:
      include: ["*.o_proj"]
  - stage: mixed
    solver: gptq
    scale_group_size: 4
    targets:
      include: ["*.v_proj", "*.gate_proj", "*.up_proj"]
output: out
"""


def test_quik_qoq_and_mixed_split_by_rows_over_two_processes_write_the_one_process_checkpoint(
    tmp_path, monkeypatch, one_thread
):
    """stories260K over 2 gloo processes, against 1 process summing the statistics in the ranks' order: the same
    checkpoint bytes. As `World.plan` shares out each group: q_proj on rank 0, k_proj on rank 1 (quik), v_proj
    split by rows (mixed-2-4-16: stripes and outliers chosen over the whole matrix, second-order scales over 4
    rows), o_proj split (qoq progressive groups, GPTQ with act-order and clipped level 0), gate_proj and up_proj
    on ranks 0 and 1 (mixed-2-4-16), down_proj split (quik: outlier columns, 2:4)."""
    from bad_input import run_cli

    r = tmp_path / "r.yaml"
    r.write_text(MIXED_LAYOUTS_RECIPE)
    procs = launch([["quantize", r, "-q", "-o", tmp_path / "two"]] * 2, tmp_path)
    summed_like_two_ranks(monkeypatch)
    one = run_cli(["quantize", r, "-q", "-o", tmp_path / "one"], cwd=tmp_path)
    assert one.exit_code == 0, one.output
    runs = [finish(p) for p in procs]
    assert runs[0].exit_code == 0 and runs[1].exit_code == 0, runs[0].output + runs[1].output
    layers = read_config(tmp_path / "one")["quantization_config"]["layers"]
    assert {name.rpartition(".")[2]: cfg["format"] for name, cfg in layers.items()} == {
        "q_proj": "quik",
        "k_proj": "quik",
        "v_proj": "mixed-2-4-16",
        "down_proj": "quik",
        "o_proj": "qoq",
        "gate_proj": "mixed-2-4-16",
        "up_proj": "mixed-2-4-16",
    }
    a, b = ((tmp_path / d / "model.safetensors").read_bytes() for d in ("one", "two"))
    assert a == b


def test_a_group_is_shared_out_whole_then_split_by_rows_over_the_ranks_left():
    """`World.plan`: whole rounds of one linear per rank, then the rest each split over a team of ranks (whole on
    the team's first rank when the stage cannot split rows); slices are whole multiples of ROW_ALIGN rows."""
    from qtool.distributed import World

    empty = (0, 0)

    def plan(size: int, linears):
        return [
            [(r.start, r.stop) if len(r) else empty for r in ranges]
            for ranges in World(0, size).plan(linears)
        ]

    # q/k/v over 2 ranks: q on 0, k on 1, v split.
    assert plan(2, [(96, 1)] * 3) == [[(0, 96), empty], [empty, (0, 96)], [(0, 48), (48, 96)]]
    # q/k/v over 4 ranks: teams of 2, 1, 1.
    assert plan(4, [(96, 1)] * 3) == [
        [(0, 48), (48, 96), empty, empty],
        [empty, empty, (0, 96), empty],
        [empty, empty, empty, (0, 96)],
    ]
    # One linear over 3 ranks: 100 rows in units of 16 (7 units: 3, 2, 2), the last slice taking the remainder.
    assert plan(3, [(100, 1)]) == [[(0, 48), (48, 80), (80, 100)]]
    # A stage whose rows are coupled: whole on the team's first rank; a granularity of 48 rows: units of 48.
    assert plan(3, [(100, None)]) == [[(0, 100), empty, empty]]
    assert plan(2, [(100, 48)]) == [[(0, 96), (96, 100)]]
    # Fewer rows than ranks need: a rank may get none.
    assert plan(4, [(20, 1)]) == [[(0, 16), (16, 20), empty, empty]]
    # One process: everything whole.
    assert plan(1, [(96, 1)] * 3) == [[(0, 96)]] * 3


ROW_CASES = [
    (
        "gptq",
        {
            "bits": 4,
            "group_size": 32,
            "symmetric": False,
            "act_order": True,
            "static_groups": True,
            "clip": True,
        },
    ),
    ("gptq", {"bits": 3, "group_size": 64}),
    ("outliers", {"outliers": 8, "sparsity_24": True}),
    ("outliers", {"bits": 8, "outliers": 8, "clip": False}),
    ("progressive", {"solver": "gptq", "group_size": 32, "clip": True, "clip_qk": "layer"}),
    ("progressive", {"solver": "gptq", "bits": 8, "group_size": None}),
    ("mixed", {"solver": "gptq", "scale_group_size": 4, "outlier_fraction": 0.005}),
    ("mixed", {"solver": "gptq", "scale_group_size": 20, "assign": "global", "target_bits": 3.0}),
]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("stage, options", ROW_CASES)
def test_a_linear_solved_by_row_slices_is_the_whole_solve_byte_for_byte(stage, options, device, one_thread):
    """What each rank solves of a linear split by rows (the slices `World.rows` gives 2, 3 and 5 ranks), joined
    by the layout's `concat_rows`, is the layout and the dequantized weight of the whole solve, bit for bit
    (mixed: its outliers and stripe widths chosen over the whole matrix, its second-order scales over 4 or 20
    rows)."""
    import math

    import torch

    from qtool.calibration.stats import LinearStats
    from qtool.distributed import ROW_ALIGN, World
    from qtool.options import parse_options
    from qtool.stages import STAGES
    from qtool.stages.base import Targets

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    cls = STAGES[stage]
    quantizer = cls(parse_options(cls.options_cls, options, "test"), Targets(), 0)
    n, k = 100, 128  # 100 rows: the last slice is not a multiple of ROW_ALIGN
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, k, generator=g) * (1 + 4 * (torch.rand(k, generator=g) > 0.9))
    stats = LinearStats(k, hessian=True, device=device)
    stats.update(x.to(device))
    w = torch.randn(n, k, generator=g).to(device)
    name = "model.layers.0.mlp.down_proj"
    whole = quantizer.quantize(name, w, stats)
    # What the stage dequantized where it solved is what the layout dequantizes to on the host.
    assert torch.equal(whole.dequantized.cpu(), whole.packed.dequantize(torch.float32).cpu())
    for size in (2, 3, 5):
        ranges = World(0, size).rows(n, quantizer.row_split())
        assert [i for r in ranges for i in r] == list(range(n))
        assert all(r.start % math.lcm(ROW_ALIGN, quantizer.row_split()) == 0 for r in ranges if len(r))
        parts = [quantizer.quantize_rows(name, w, stats, r) for r in ranges if len(r)]
        joined = type(whole.packed).concat_rows([p.packed for p in parts])
        assert joined.layer_config(False) == whole.packed.layer_config(False)
        mine, theirs = joined.tensors(), whole.packed.tensors()
        assert mine.keys() == theirs.keys()
        for key, t in theirs.items():
            assert mine[key].dtype == t.dtype and torch.equal(mine[key], t), (size, key)
        assert torch.equal(torch.cat([p.dequantized for p in parts]), whole.dequantized), size


@pytest.mark.parametrize(
    "stage, message",
    [
        ("  - stage: mixed\n    finetune_steps: 2\n", "stages[0].finetune_steps: found 2: mixed"),
        ("  - stage: vq\n    entries: 16\n    finetune_steps: 2\n", "stages[0].finetune_steps: found 2: vq"),
        (
            "  - stage: progressive\n    group_size: null\n    clip: true\n",
            "stages[0].clip_qk: found 'attention': progressive",
        ),
    ],
)
def test_stages_whose_statistics_do_not_combine_are_refused_over_several_processes(tmp_path, stage, message):
    from qtool.distributed import World
    from qtool.errors import RecipeError
    from qtool.recipe import load_recipe
    from qtool.run import _check_world

    r = tmp_path / "r.yaml"
    r.write_text(
        RECIPE.format(model=STORIES, samples=4, bits=4).split("stages:")[0]
        + "stages:\n"
        + stage
        + "output: out\n"
    )
    world = World(0, 2, joined=True)
    world.check_same = lambda what: None  # no process group here: what this test asks is the stage's answer
    with pytest.raises(RecipeError, match=r"expected .* with several processes") as e:
        _check_world(
            world,
            load_recipe(r, {}),
            resume=False,
            dry_run=False,
            whole_model=False,
            overwrite=False,
            run_eval=False,
        )
    assert str(e.value).startswith(message), str(e.value)


def test_other_commands_refuse_to_run_under_a_launcher_of_several_processes(tmp_path):
    from bad_input import run_cli

    launcher = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    res = run_cli(["eval", STORIES, "--text", TINY_SAMPLE, "--seq-len", "32"], env=launcher)
    assert_one_line_error(res, 2, "qtool eval", "rank 1 of 2 processes", "qtool quantize alone")


def test_a_resumed_run_reads_its_share_from_the_parts_any_number_of_ranks_wrote(tmp_path):
    """Activations of 5 samples written as parts of 3 and 2 (two ranks) are read back by the shares of 1, 2 or 3
    ranks, each sample where it was."""
    import torch

    from qtool.checkpoint.partial import Work
    from qtool.distributed import World

    xs = [torch.full((1, 2, 3), float(i)) for i in range(5)]
    work = Work(
        tmp_path,
        {
            "next_block": 1,
            "blocks": [{}],
            "inputs": {"dtype": "float32", "shapes": [[1, 2, 3]] * 5, "parts": [3, 2]},
        },
    )
    for part, chunk in enumerate((xs[:3], xs[3:])):
        work.inputs_file(1, part).write_bytes(b"".join(x.numpy().tobytes() for x in chunk))
    for size in (1, 2, 3):
        for rank in range(size):
            share = World(rank, size).share(5)
            got = work.inputs(torch.device("cpu"), share)
            assert [int(x[0, 0, 0]) for x in got] == list(share), (size, rank)
