"""Models larger than memory beyond `quantize`'s block loop: perplexity of an original model block by block equals
the whole-model evaluation with clearly less peak memory; a model spread to disk by accelerate (what `--tasks` runs
over --max-memory) computes what the whole one does; where the calibration activations go; the writer stores
contiguous CPU tensors without copying them and shards as huggingface_hub does. (Activations kept on disk write
the byte-identical checkpoint: tests/test_resume.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from bad_input import ROOT
from conftest import STORIES, WIKITEXT

# One child evaluates the whole model, then (its peak reset) the same model block by block, and reports each
# phase's peak resident set. Any memory the first phase leaves behind counts against the second, never for it.
CHILD = """
import gc, json, re, sys
from qtool.console import Reporter
from qtool.evaluate import run_eval
from qtool.models.onload import trim_heap

def peak():
    return int(re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024

ref, text = sys.argv[1:3]
out = {}
for name, memory in (("whole", None), ("streamed", 100_000_000)):
    result = run_eval([ref], text=text, seq_len=64, max_windows=3, stride=None, separator=None, text_field="text",
                      split="test", batch_size="2", device="cpu", reporter=Reporter(quiet=True), max_memory=memory)
    gc.collect()
    trim_heap()
    out[name] = {"result": result, "peak": peak()}
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident set
print(json.dumps(out))
"""


@pytest.mark.skipif(not WIKITEXT.is_file(), reason="assets not found")
def test_streamed_perplexity_equals_the_whole_model_with_less_memory(smollm2, tmp_path):
    text = tmp_path / "wiki.txt"
    text.write_text(WIKITEXT.read_text(encoding="utf-8")[:4000], encoding="utf-8")
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(smollm2), str(text)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    streamed, whole = out["streamed"]["result"], out["whole"]["result"]
    assert streamed["streamed"]["blocks"] == 30 and "streamed" not in whole
    assert streamed["dtype"] == whole["dtype"] == "float32"
    assert streamed["protocol"] == whole["protocol"] and streamed["scored_tokens"] == whole["scored_tokens"]
    assert streamed["perplexity"] == pytest.approx(whole["perplexity"], rel=1e-5)
    # The whole model in float32 is 538 MB; block by block holds the embedding (113 MB) and one 14 MB block.
    streamed_peak, whole_peak = out["streamed"]["peak"], out["whole"]["peak"]
    assert streamed_peak < whole_peak - 250e6, (streamed_peak / 1e6, whole_peak / 1e6)


def test_activation_budget_is_checked():
    from qtool.calibration.store import choose_place
    from qtool.errors import UsageError

    assert choose_place(10, torch.device("cuda"), 100, 100) == "device"
    assert choose_place(10, torch.device("cuda"), 5, 100) == "host"
    assert choose_place(10, torch.device("cuda"), 5, 5) == "disk"
    assert choose_place(10, torch.device("cpu"), 5, 100) == "disk"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("QTOOL_ACTIVATION_BUDGET", "9")
        assert choose_place(10, torch.device("cuda"), 100, 100) == "disk"
        mp.setenv("QTOOL_ACTIVATION_BUDGET", "lots")
        with pytest.raises(UsageError, match="QTOOL_ACTIVATION_BUDGET: found 'lots'"):
            choose_place(10, torch.device("cpu"), 100, 100)


def test_writer_keeps_contiguous_cpu_tensors_and_shards_as_huggingface_hub(tmp_path):
    from qtool.checkpoint.writer import _shards, collect_tensors

    lin = torch.nn.Linear(8, 4)
    view_holder = torch.nn.Module()
    view_holder.register_buffer("part", torch.arange(16.0)[4:8])  # a view of a larger storage
    model = torch.nn.ModuleDict({"lin": lin, "v": view_holder})
    out = collect_tensors(model, {}, torch.float32)
    assert out["lin.weight"].data_ptr() == lin.weight.data_ptr()  # no copy
    assert (
        out["v.part"].data_ptr() != view_holder.part.data_ptr()
    )  # copied: safetensors would see shared memory
    assert collect_tensors(model, {}, torch.float16)["lin.weight"].dtype == torch.float16

    sizes = {"a": 10, "b": 10, "c": 100, "d": 10, "e": 10}  # float32 elements; limit 80 bytes
    tensors = {k: torch.zeros(n) for k, n in sizes.items()}
    shards = _shards(tensors, 80)
    # Name order fills a shard up to the limit; the tensor larger than the limit gets one of its own, numbered
    # when it is met (before the shard still being filled).
    assert list(shards.values()) == [["c"], ["a", "b"], ["d", "e"]]
    assert list(shards) == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert list(_shards(tensors, 10_000)) == ["model.safetensors"]


@pytest.mark.skipif(not (STORIES.is_dir() and WIKITEXT.is_file()), reason="assets not found")
def test_a_model_over_max_memory_is_spread_to_disk_for_whole_forwards(tmp_path):
    """What `--tasks` runs on a model larger than --max-memory: the whole model through accelerate's hooks."""
    from qtool.eval.perplexity import perplexity
    from qtool.models.loading import load_model
    from qtool.recipe import EvalSpec

    text = tmp_path / "wiki.txt"
    text.write_text(WIKITEXT.read_text(encoding="utf-8")[:4000], encoding="utf-8")
    spec = EvalSpec(text=str(text), seq_len=64, max_windows=2, batch_size=2)
    whole, tokenizer, _, _ = load_model(str(STORIES))
    spread, _, _, _ = load_model(str(STORIES), device="cpu", max_memory=100_000)  # less than the embedding
    assert "disk" in set(spread.hf_device_map.values())
    assert perplexity(spread, tokenizer, spec, "cpu")["perplexity"] == pytest.approx(
        perplexity(whole, tokenizer, spec, "cpu")["perplexity"], rel=1e-6
    )
