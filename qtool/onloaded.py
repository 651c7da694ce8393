"""The block-wise pipeline on a model that is never whole in memory: the model is a skeleton on the meta device,
each decoder block is read from the weight files when the loop reaches it, quantized, stored in the run's work
folder (`.NAME.partial`, see qtool/checkpoint/partial.py) and dropped. The checkpoint is then written from the
work folder one shard at a time.

It runs the same per-block code as the whole-model pipeline (qtool/pipeline.py `_Blocks`) on tensors cast the same
way, so the two write byte-identical checkpoints; a run resumed from the work folder writes the same bytes too,
because the folder keeps the exact activations entering the next block.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial as partial_fn
from pathlib import Path

import torch

from qtool import interrupts
from qtool.calibration.store import ActivationStore
from qtool.checkpoint.partial import LazyTensors, Work, model_fingerprint, recipe_hash
from qtool.checkpoint.writer import collect_tensors
from qtool.console import Reporter, peak_rss_mb
from qtool.distributed import World
from qtool.errors import Interrupted
from qtool.models.adapters import Adapter
from qtool.models.loading import adapter_of, config_dtype
from qtool.models.onload import ShardReader, check_module, check_names, load_outer, materialize, release
from qtool.pipeline import (
    LayerSummary,
    Prepared,
    _Blocks,
    compute_dtype,
    install_packed,
    layer_summary,
    resolve_device,
)
from qtool.recipe import Recipe
from qtool.version import __version__


@dataclass
class Onloaded:
    """What the writer needs of an onloaded run (the model itself was never whole)."""

    tensors: LazyTensors
    packed: dict[str, LayerSummary]
    layers: dict[str, dict]
    config: dict
    tokenizer: object
    original_dtype: torch.dtype
    calibration: dict | None
    work: Work
    timings: dict[str, float] = field(default_factory=dict)
    peak_rss_mb: float = 0.0
    transforms: list[dict] = field(default_factory=list)
    model_schemes: dict = field(default_factory=dict)
    resumed_at: int = 0
    ranks: list[dict] = field(default_factory=list)  # per rank of a run over several processes: its timings


def can_onload(recipe: Recipe, prepared: Prepared) -> bool:
    """A local folder of safetensors weights: what block onloading reads. Mixture-of-experts weights are stored
    under other names than the model's (per expert, where transformers fuses them as it loads): those models load
    whole."""
    if prepared.files is None or prepared.meta is None:
        return False
    adapter = adapter_of(prepared.config)
    return not (isinstance(adapter, Adapter) and adapter.experts)


def identity(
    recipe: Recipe, prepared: Prepared, dtype: torch.dtype, device: torch.device, num_blocks: int
) -> dict:
    cal = recipe.calibration
    dev = device.type
    if dev == "cuda":
        dev = f"cuda ({torch.cuda.get_device_name(device)})"
    return {
        "recipe": recipe_hash(recipe.as_run),
        "model": model_fingerprint(recipe.model),
        "data": prepared.digest,
        "seed": cal.seed if cal is not None else None,
        "dtype": str(dtype).removeprefix("torch."),
        "device": dev,
        "versions": f"qtool {__version__}, torch {torch.__version__}",
        "num_blocks": num_blocks,
    }


def _commit_block(
    block: torch.nn.Module,
    i: int,
    prefix: str,
    packed: dict,
    records: list[dict],
    inputs,
    run: _Blocks,
    work: Work,
    world: World,
    original_dtype: torch.dtype,
) -> None:
    """Commit quantized block `i` to the work folder (rank 0 alone holds the packed layouts and writes their
    tensors and summaries; every rank commits the next block's inputs) and drop the block."""
    tensors, summaries, linears = {}, {}, {}
    if world.is_main:
        linears = {full: block.get_submodule(full.removeprefix(prefix + ".")) for full in packed}
        install_packed(block, packed, prefix)
        tensors = collect_tensors(block, packed, original_dtype, prefix=prefix)
        summaries = {
            full: layer_summary(layout, linears[full].bias is not None) for full, layout in packed.items()
        }
    with run.timed("commit_s"):
        work.commit(
            i,
            tensors,
            {"records": records, "linears": summaries},
            inputs if i < run.last_needing else None,
        )
    # The packed modules hold their layouts outside their parameters: put the linears back, so that dropping the
    # block to the meta device frees everything it held.
    for full, linear in linears.items():
        parent, _, child = full.removeprefix(prefix + ".").rpartition(".")
        setattr(block.get_submodule(parent), child, linear)
    release(block)


def quantize_onloaded(
    recipe: Recipe,
    reporter: Reporter,
    prepared: Prepared,
    partial: Path,
    *,
    resume: bool,
    world: World | None = None,
    overwrite: bool = False,
    checked: bool = False,
) -> Onloaded:
    """`world` (qtool/distributed.py): several processes, each on its share of the calibration samples; rank 0
    keeps the work folder (the others write their part of the activations into it). `overwrite`: the run may
    replace an existing output (recorded for a --resume of it). `checked`: the work folder to resume was verified
    against the run's identity already."""
    world = world or World()
    t0 = time.perf_counter()
    device = resolve_device(recipe.settings.device)
    config = prepared.config
    original_dtype = config_dtype(config)
    dtype = compute_dtype(recipe.settings.dtype, device, original_dtype)
    skeleton = prepared.meta
    skeleton.eval()
    adapter = adapter_of(config)
    reader = ShardReader(recipe.model, prepared.files, config)
    check_names(reader, skeleton, recipe.model)
    blocks = adapter.blocks(skeleton)
    n = len(blocks)
    run = _Blocks(recipe, adapter, skeleton.config, n, device, world)
    # The final norm and the head are read when something needs them: a transform now, else the writer.
    later = () if run.transforms else (adapter.final_norm_path, adapter.head_path)
    reporter.log(f"onloading {recipe.model} block by block ({dtype}, blocks on {device})")
    load_outer(skeleton, adapter, reader, dtype, skip=later)
    records = run.apply_outer(skeleton)
    timings = {"load_s": time.perf_counter() - t0}

    inputs: list[torch.Tensor] = []
    kwargs: list[dict] = [{}] * n
    calibration = None
    if run.needs_calibration() and prepared.windows is None:
        run.calibrate(
            skeleton, prepared, prepared.tokenizer, reporter, first_only=True
        )  # samples the windows
    ident = identity(recipe, prepared, dtype, device, n)
    state = None
    if world.is_main:
        work = (
            Work.resume(partial, ident, overwrite, checked)
            if resume
            else Work.start(partial, ident, overwrite)
        )
        state = work.state
    work = Work(partial, world.broadcast_object(state), world)
    start = work.next_block
    progress = reading = None
    try:
        if run.needs_calibration():
            t = time.perf_counter()
            if start > 0:
                _, kwargs, calibration = run.calibrate(
                    skeleton, prepared, prepared.tokenizer, reporter, first_only=True
                )
                inputs = run.store(prepared)
                for x in work.inputs(torch.device("cpu"), world.share(len(prepared.windows))) or []:
                    inputs.append(x)
            else:
                inputs, kwargs, calibration = run.calibrate(skeleton, prepared, prepared.tokenizer, reporter)
            timings["calibration_s"] = time.perf_counter() - t
        for done in work.blocks:
            records.extend(done["records"])
        if start:
            reporter.log(f"resuming at block {start} of {n} from '{work.folder}'")

        t = time.perf_counter()
        progress = reporter.blocks(n, start, "quantizing blocks", device)
        # On a GPU the next block's weights are read from the shards while this one is quantized (the reader is
        # used by nothing else during the loop); on the CPU the read would only take cores from the quantization.
        reading = ThreadPoolExecutor(1, thread_name_prefix="qtool-onload") if device.type != "cpu" else None
        # On a GPU the weights are read into page-locked memory (copied to the device several times faster than
        # from pageable memory) and, when no transform changes them first, checked finite on the device: the ranks
        # of one machine share its CPUs and memory bandwidth, and on an H200 pair a 7B block's read with the
        # host-side check took 0.35 s alone and 0.8 s with both ranks reading (a block's quantization on 4 GPUs: 1.1 s).
        on_gpu = device.type == "cuda"
        late_check = on_gpu and not run.transforms
        read = partial_fn(materialize, reader=reader, dtype=dtype, pinned=on_gpu, check=not late_check)
        ahead = None
        for i in range(start, n):
            interrupts.check()  # a signal whose exception a finalizer swallowed stops the run here
            block, prefix = blocks[i], adapter.block_prefix(i)
            with run.timed("onload_s"):
                if ahead is None:
                    read(block, prefix)
                else:
                    ahead.result()
                ahead = None
                if reading is not None and i + 1 < n:
                    ahead = reading.submit(read, blocks[i + 1], adapter.block_prefix(i + 1))
                for tr in run.transforms:
                    tr.apply_block_weights(block, i, adapter)
                block.to(device)
                if late_check:
                    check_module(block, prefix, reader)
            mine: list[dict] = []
            packed, inputs = run.quantize(block, i, inputs, kwargs[i], mine)
            with run.timed("share_s"):
                packed = world.collect(packed)  # the slices other ranks solved, sent while the block went on
            _commit_block(block, i, prefix, packed, mine, inputs, run, work, world, original_dtype)
            records.extend(mine)
            del packed
            progress.advance(i + 1)
        with run.timed("commit_s"):
            work.flush()
        interrupts.check()
        timings["quantize_s"] = time.perf_counter() - t
    except KeyboardInterrupt as e:
        if work.next_block == 0:
            raise
        raise Interrupted(
            f"interrupted; blocks 0-{work.next_block - 1} of {n} are done and kept in "
            f"'{work.folder}'; run the same command with --resume to continue from block "
            f"{work.next_block}",
            e,
        ) from None
    finally:
        if reading is not None:
            reading.shutdown(wait=True, cancel_futures=True)
        if progress is not None:
            progress.close()
        if isinstance(inputs, ActivationStore):
            inputs.close()
        del inputs

    mine = {
        "rank": world.rank,
        "device": str(device),
        "calibration_s": round(timings.get("calibration_s", 0.0), 3),
        "quantize_s": round(timings.get("quantize_s", 0.0), 3),
        **{key: round(value, 3) for key, value in run.seconds.items()},
        "total_s": round(time.perf_counter() - t0 + prepared.seconds, 3),
        "peak_rss_mb": round(peak_rss_mb(), 1),
    }
    ranks = world.all_gather_object(mine)
    if not world.is_main:  # rank 0 writes the checkpoint
        reader.close()
        return Onloaded(
            tensors=LazyTensors([], {}),
            packed={},
            layers={},
            config={},
            tokenizer=None,
            original_dtype=original_dtype,
            calibration=calibration,
            work=work,
            timings=timings,
            peak_rss_mb=peak_rss_mb(),
            transforms=records,
            resumed_at=start,
            ranks=ranks,
        )
    load_outer(skeleton, adapter, reader, dtype)
    reader.close()
    outer = collect_tensors(skeleton, {}, original_dtype, skip=adapter.blocks_path)
    config = skeleton.config.to_diff_dict()
    release(skeleton)  # the writer takes `outer`, in the checkpoint's dtype
    summaries = {name: s for done in work.blocks for name, s in done["linears"].items()}
    packed = {name: LayerSummary(s) for name, s in sorted(summaries.items())}
    timings["preflight_s"] = prepared.seconds
    timings["total_s"] = time.perf_counter() - t0 + prepared.seconds
    return Onloaded(
        tensors=LazyTensors(work.tensor_files(), outer),
        packed=packed,
        layers={name: p.layer_config(False) for name, p in packed.items()},
        config=config,
        tokenizer=prepared.tokenizer,
        original_dtype=original_dtype,
        calibration=calibration,
        work=work,
        timings=timings,
        peak_rss_mb=peak_rss_mb(),
        transforms=records,
        model_schemes=run.model_schemes(),
        resumed_at=start,
        ranks=ranks,
    )
