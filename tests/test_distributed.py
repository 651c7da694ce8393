"""`qtool quantize` over several processes (qtool/distributed.py), on the CPU with gloo: each process is started
the way torchrun starts it (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT in its environment), so a test can give
one rank other arguments or kill it.

- SmolLM2 GPTQ over 2 processes writes the checkpoint of 1 process that sums the statistics in the same order,
  byte for byte: the checkpoint equals the single-process one up to float summation order.
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

from bad_input import ROOT, Run, assert_one_line_error
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


def launch(per_rank: list[list[object]], cwd: Path, env: dict[str, str] | None = None) -> list[subprocess.Popen]:
    """One `qtool` process per rank, `per_rank[r]` its arguments, in torchrun's environment."""
    port, n = free_port(), len(per_rank)
    procs = []
    for r, args in enumerate(per_rank):
        e = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "RANK": str(r), "LOCAL_RANK": str(r),
             "WORLD_SIZE": str(n), "LOCAL_WORLD_SIZE": str(n), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
             **(env or {})}
        procs.append(subprocess.Popen([sys.executable, "-m", "qtool.cli", *map(str, args)], cwd=cwd, env=e,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
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
    t_end = time.monotonic() + 120
    while ((Work.read_state(partial) or {}).get("next_block", 0) < 1 and procs[0].poll() is None
           and time.monotonic() < t_end):
        time.sleep(0.01)
    procs[1].send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    res = finish(procs[0], timeout=60)
    finish(procs[1])
    waited = time.monotonic() - t0
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
        parts = [real(block, names, [inputs[i] for i in World(r, 2).share(len(inputs))], kwargs, hessian)
                 for r in range(2)]
        for n, s in parts[0].items():
            other = parts[1][n]
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
def test_smollm2_gptq_over_two_processes_writes_the_one_process_checkpoint(tmp_path, smollm2, monkeypatch,
                                                                           one_thread):
    """GPTQ W4 g64 (asymmetric, act-order, static groups) of SmolLM2's first two blocks over 2 gloo processes
    (4 windows of 128 tokens, 2 per rank) against 1 process that sums each linear's statistics in the ranks'
    order: the same bytes (so the same perplexity). Samples split, statistics combined, solves spread over the
    ranks, weights sent back: nothing else may differ. (Against a plain single-process run, GPTQ's roundings flip
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
    assert not runs[1].stdout.strip() and not runs[1].stderr.strip()  # rank 0 alone reports
    a, b = ((tmp_path / d / "model.safetensors").read_bytes() for d in ("one", "two"))
    assert a == b


@pytest.mark.parametrize("stage, message", [
    ("  - stage: mixed\n    finetune_steps: 2\n", "stages[0].finetune_steps: found 2: mixed"),
    ("  - stage: progressive\n    group_size: null\n    clip: true\n", "stages[0].clip_qk: found 'attention': progressive"),
])
def test_stages_whose_statistics_do_not_combine_are_refused_over_several_processes(tmp_path, stage, message):
    from qtool.distributed import World
    from qtool.errors import RecipeError
    from qtool.recipe import load_recipe
    from qtool.run import _check_world

    r = tmp_path / "r.yaml"
    r.write_text(RECIPE.format(model=STORIES, samples=4, bits=4).split("stages:")[0] + "stages:\n" + stage
                 + "output: out\n")
    world = World(0, 2, joined=True)
    world.check_same = lambda what: None  # no process group here: what this test asks is the stage's answer
    with pytest.raises(RecipeError, match=r"expected .* with several processes") as e:
        _check_world(world, load_recipe(r, {}), resume=False, dry_run=False, whole_model=False, overwrite=False,
                     run_eval=False)
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
    work = Work(tmp_path, {"next_block": 1, "blocks": [{}], "inputs": {
        "dtype": "float32", "shapes": [[1, 2, 3]] * 5, "parts": [3, 2]}})
    for part, chunk in enumerate((xs[:3], xs[3:])):
        work.inputs_file(1, part).write_bytes(b"".join(x.numpy().tobytes() for x in chunk))
    for size in (1, 2, 3):
        for rank in range(size):
            share = World(rank, size).share(5)
            got = work.inputs(torch.device("cpu"), share)
            assert [int(x[0, 0, 0]) for x in got] == list(share), (size, rank)
