"""The block-wise quantization pipeline: one decoder block at a time on the compute device, each block's
quantized outputs feeding the next (as GPTQ does), so peak memory is one block plus its activations."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from qtool.calibration.capture import StopForward, block_output, capture_block_inputs
from qtool.calibration.data import (
    TextSource,
    check_not_empty,
    check_token_ids,
    read_documents,
    sample_windows,
)
from qtool.calibration.stats import LinearStats, load_stats
from qtool.calibration.store import ActivationStore
from qtool.console import Reporter, peak_rss_mb
from qtool.distributed import World, describe_device
from qtool.errors import InputError, RecipeError, ResourceError
from qtool.layouts.base import StoredLayout
from qtool.layouts.registry import module_for
from qtool.models.adapters import Adapter, forward_groups
from qtool.models.integrity import read_header
from qtool.models.loading import (
    adapter_of,
    check_architecture,
    check_context,
    check_weight_files,
    config_dtype,
    load_config,
    load_model,
    load_tokenizer,
    meta_model,
)
from qtool.models.moe import route_all
from qtool.recipe import Recipe
from qtool.stages.base import BlockContext, QuantizerStage


@dataclass
class QuantizedModel:
    model: nn.Module
    tokenizer: object
    adapter: Adapter
    original_dtype: torch.dtype
    packed: dict[str, StoredLayout]
    calibration: dict | None
    timings: dict[str, float] = field(default_factory=dict)
    peak_rss_mb: float = 0.0
    # What the transforms did (per stage, per block) and the run-time schemes of the whole model they set.
    transforms: list[dict] = field(default_factory=list)
    model_schemes: dict = field(default_factory=dict)


def resolve_device(name: str) -> torch.device:
    """The compute device `settings.device` names (under a launcher with several processes, cuda is this rank's
    cuda:LOCAL_RANK)."""
    if name == "auto":
        return describe_device(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ResourceError(
            f"settings.device: found {name!r}, but no CUDA device is available; expected cpu or auto"
        )
    return describe_device(torch.device(name))


def compute_dtype(setting: str, device: torch.device, original: torch.dtype) -> torch.dtype:
    if setting != "auto":
        return getattr(torch, setting)
    # fp16 matmuls on CPU are several times slower than fp32.
    return torch.float32 if device.type == "cpu" else original


def assign_stages(model: nn.Module, adapter: Adapter, recipe: Recipe) -> dict[str, QuantizerStage]:
    """Map each targeted linear's full name to the one quantizer stage that claims it."""
    return _assign(adapter, recipe, len(adapter.blocks(model)))


def _assign(adapter: Adapter, recipe: Recipe, num_blocks: int) -> dict[str, QuantizerStage]:
    assignment: dict[str, QuantizerStage] = {}
    for i in range(num_blocks):
        for rel in adapter.linear_names():
            full = f"{adapter.block_prefix(i)}.{rel}"
            claims = [q for q in recipe.quantizers() if q.targets.matches(full)]
            if len(claims) > 1:
                raise RecipeError(
                    f"{recipe.path}:stages: {full} is targeted by {claims[0].label} and "
                    f"{claims[1].label}; expected each linear in one quantizer's targets"
                )
            if claims:
                assignment[full] = claims[0]
    for q in recipe.quantizers():
        if q not in assignment.values():
            raise RecipeError(
                f"{recipe.path}:stages[{q.index}].targets: matches no linear of the model; "
                f"expected patterns over names such as {adapter.block_prefix(0)}.{adapter.linear_names()[0]}"
            )
    return assignment


def check_stages(recipe: Recipe, config) -> None:
    """Every stage's check of the model config (no weight is read): a model a stage cannot handle fails here."""
    setters: dict[str, object] = {}
    for spec in recipe.stages:
        # Two stages setting one run-time scheme of the model (kv_cache and vq_kv) would quantize the cache twice.
        scheme = spec.stage.model_scheme() if hasattr(spec.stage, "model_scheme") else None
        for key in scheme or {}:
            if key in setters:
                raise RecipeError(
                    f"{recipe.path}:stages[{spec.stage.index}]: {spec.stage.name} sets the model's "
                    f"{key} scheme, as {setters[key].label} does; expected one stage per scheme"
                )
            setters[key] = spec.stage
        spec.stage.check_config(config, f"{recipe.path}:stages[{spec.stage.index}]")
        if recipe.calibration is not None:
            spec.stage.check_calibration(recipe.calibration, f"{recipe.path}:stages[{spec.stage.index}]")
    from qtool.export.targets import check_target

    check_target(recipe, config)
    # Targets that overlap or match nothing are known from the block count alone: refused before loading too.
    adapter = adapter_of(config)
    if isinstance(adapter, Adapter) and isinstance(getattr(config, "num_hidden_layers", None), int):
        _assign(adapter, recipe, config.num_hidden_layers)


@dataclass
class Prepared:
    """What the pre-flight read, reused by the run."""

    config: object
    # Why the checkpoint will not export to compressed-tensors (a recipe without `target`), or None.
    export_problem: str | None = None
    windows: torch.Tensor | None = None
    digest: str | None = None
    seconds: float = 0.0  # sampling the calibration windows is most of it
    tokenizer: object = None
    meta: nn.Module | None = (
        None  # the model on the meta device: names and shapes, the onloaded run's skeleton
    )
    files: dict | None = None  # tensor name -> TensorInfo of a local safetensors model
    # Where the calibration activations between blocks are kept (qtool/calibration/store.py), as the memory
    # pre-flight decided, and the folder under which they go when that is disk.
    activations: str = "device"
    offload_dir: Path | None = None
    # Reading and tokenizing the calibration text (what the dry run's estimate scales the evaluation text's by).
    text_bytes: int = 0
    text_tokens: int = 0
    tokenize_seconds: float = 0.0
    check_seconds: float = 0.0  # in `before_data` (a dry run's estimate measures this machine there)


def preflight(recipe: Recipe, before_data: Callable[[Prepared], None] | None = None) -> Prepared:
    """Everything about a quantize run that can be checked without reading a weight, so that bad input fails in
    seconds instead of after an evaluation or a quantization: the config and its architecture, what the stages
    need of it, seq_len against the context length, the tokenizer, the weight files' headers (whole, indexed,
    shaped as the config says), the targets, a stats file's linears, the calibration windows and the eval text.
    `before_data` sees what was read before the calibration text is (the memory pre-flight)."""
    t0 = time.perf_counter()
    config = load_config(recipe.model)
    adapter = check_architecture(recipe.model, config)
    check_stages(recipe, config)
    cal, ev = recipe.calibration, recipe.eval
    if cal is not None:
        check_context(
            cal.seq_len,
            cal.allow_long_context,
            config,
            recipe.model,
            recipe.origins.get("calibration.seq_len", "calibration.seq_len"),
            "calibration.allow_long_context: true",
        )
    if ev is not None and ev.text is not None:
        check_context(
            ev.seq_len,
            ev.allow_long_context,
            config,
            recipe.model,
            recipe.origins.get("eval.seq_len", "eval.seq_len"),
            "eval.allow_long_context: true",
        )
    tokenizer = load_tokenizer(recipe.model)
    meta = meta_model(config, f"model '{recipe.model}' config", InputError)
    files = check_weight_files(recipe.model, config, meta)
    assignment = assign_stages(meta, adapter, recipe)
    if cal is not None and cal.stats:
        _check_stats_header(recipe, meta, adapter, assignment)
    prepared = Prepared(config, tokenizer=tokenizer, meta=meta, files=files)
    from qtool.export.targets import export_problem

    prepared.export_problem = export_problem(recipe, config)
    if before_data is not None:
        t = time.perf_counter()
        before_data(prepared)
        prepared.check_seconds = time.perf_counter() - t
    if cal is not None:
        src = TextSource(cal.source, cal.text_field, cal.split, cal.config, cal.encoding)
        if recipe.needs_calibration():
            t = time.perf_counter()
            prepared.windows, prepared.digest = sample_windows(
                tokenizer,
                src,
                cal.num_samples,
                cal.seq_len,
                cal.seed,
                recipe.origins.get("calibration.num_samples", "calibration.num_samples"),
                counts=prepared,
            )
            prepared.tokenize_seconds = time.perf_counter() - t
            check_token_ids(prepared.windows, config.vocab_size, cal.source, tokenizer)
        elif Path(cal.source).is_file():
            check_not_empty(src, read_documents(src))
    if ev is not None and ev.text is not None and Path(ev.text).is_file():
        src = TextSource(ev.text, ev.text_field, ev.split, ev.config, ev.encoding)
        check_not_empty(src, read_documents(src))
    prepared.seconds = time.perf_counter() - t0
    return prepared


class _Blocks:
    """What quantizing one decoder block takes, shared by the whole-model and the onloaded run so that both compute
    the same numbers: the stage of each linear, the transforms, the FP statistics, the compute device."""

    def __init__(
        self,
        recipe: Recipe,
        adapter: Adapter,
        config,
        num_blocks: int,
        device: torch.device,
        world: World | None = None,
    ) -> None:
        self.recipe, self.adapter, self.config, self.device = recipe, adapter, config, device
        # Several processes (qtool/distributed.py): this rank's share of the samples, statistics combined.
        self.world = world or World()
        # Seconds of this rank in the linears' statistics (with their combination over the ranks), in its solves,
        # and in sending results (with waiting for the other ranks' solves); the onloaded run adds its waits for
        # block weights (`onload_s`) and for the work folder (`commit_s`): `--json` reports them per rank.
        self.seconds = {"stats_s": 0.0, "solve_s": 0.0, "share_s": 0.0}
        self.expert_tokens: dict[str, list[int]] = {}  # experts module -> calibration tokens of each expert
        self.assignment = _assign(adapter, recipe, num_blocks)
        self.transforms = recipe.transforms()
        self.fp_stats: dict[str, LinearStats] = {}
        if recipe.calibration is not None and recipe.calibration.stats:
            self.fp_stats, _ = load_stats(recipe.calibration.stats)
            _check_stats(recipe, self.fp_stats, self.assignment)
        self.num_blocks = num_blocks
        self.last_needing = max(
            (
                i
                for i in range(num_blocks)
                for rel in adapter.linear_names()
                if (s := self.assignment.get(f"{adapter.block_prefix(i)}.{rel}")) and self.wants_pass(s)
            ),
            default=-1,
        )
        if any(tr.needs_calibration() for tr in self.transforms):
            self.last_needing = num_blocks - 1

    def _count_expert_tokens(self, prefix: str, stats: dict) -> None:
        """The calibration tokens each expert's statistics rest on (its gate_proj's, which its up_proj shares)."""
        experts = self.adapter.experts
        for rel, st in stats.items():
            if experts and rel.startswith(f"{experts}.") and rel.endswith(".gate_proj"):
                e = int(rel[len(experts) + 1 :].split(".")[0])
                counts = self.expert_tokens.setdefault(f"{prefix}.{experts}", [0] * (e + 1))
                counts.extend([0] * (e + 1 - len(counts)))
                counts[e] = st.tokens

    def expert_summary(self) -> dict | None:
        """Tokens per expert over the model (None without experts): the fewest, the median, the most, and how
        many experts saw fewer tokens than their input width (their Hessian is then singular and rests on the
        damping)."""
        if not self.expert_tokens:
            return None
        counts = sorted(c for per in self.expert_tokens.values() for c in per)
        width = self.config.hidden_size
        return {
            "experts": len(counts),
            "fewest": counts[0],
            "median": counts[len(counts) // 2],
            "most": counts[-1],
            "below_input_width": sum(c < width for c in counts),
            "per_block": self.expert_tokens,
        }

    def apply_outer(self, model: nn.Module) -> list[dict]:
        """Every transform's step on the modules outside the blocks, before the block loop; their records."""
        records = []
        for tr in self.transforms:
            info = tr.apply_outer(model, self.adapter)
            if info:
                records.append({"stage": tr.name, **info})
        return records

    def model_schemes(self) -> dict:
        """The run-time schemes of the whole model the transforms set (the KV cache's)."""
        schemes: dict = {}
        for tr in self.transforms:
            schemes.update(tr.model_scheme() or {})
        return schemes

    def wants_pass(self, stage: QuantizerStage) -> bool:
        # Stages that need statistics from the block-wise pass (GPTQ's Hessians of quantized inputs) get them
        # propagated; the others use the FP stats file when one is given.
        return stage.needs_calibration() and (stage.needs_hessian() or not self.fp_stats)

    def needs_calibration(self) -> bool:
        return any(self.wants_pass(s) for s in self.assignment.values()) or any(
            tr.needs_calibration() for tr in self.transforms
        )

    def calibrate(
        self, model: nn.Module, prepared: Prepared, tokenizer, reporter: Reporter, first_only: bool = False
    ) -> tuple[list[torch.Tensor], list[dict], dict]:
        """(inputs of the first block per window, each block's keyword arguments, the manifest's calibration
        record). `first_only` runs one window, for the keyword arguments alone (a resumed run has its inputs)."""
        cal = self.recipe.calibration
        windows, digest = prepared.windows, prepared.digest
        if windows is None:
            src = TextSource(cal.source, cal.text_field, cal.split, cal.config, cal.encoding)
            windows, digest = sample_windows(tokenizer, src, cal.num_samples, cal.seq_len, cal.seed)
            prepared.windows, prepared.digest = windows, digest
        info = {
            "source": cal.source,
            "num_samples": cal.num_samples,
            "seq_len": cal.seq_len,
            "seed": cal.seed,
            "data_sha256": digest,
        }
        if not first_only:
            reporter.log(f"calibration: {cal.num_samples} windows of {cal.seq_len} tokens from {cal.source}")
        share = range(1) if first_only else self.world.share(len(windows))
        mine = windows[share.start : share.stop]
        inputs, kwargs = capture_block_inputs(
            model, self.adapter.blocks(model), mine, self.device, self.store(prepared)
        )
        return inputs, kwargs, info

    def store(self, prepared: Prepared) -> ActivationStore:
        """An empty store for the activations, where the pre-flight put them (on disk: `prepared.offload_dir`,
        emptied first, since what a killed run left there is of no use to anyone)."""
        folder = None
        if prepared.activations == "disk":
            folder = prepared.offload_dir or Path(tempfile.mkdtemp(prefix="qtool-activations-"))
            shutil.rmtree(folder, ignore_errors=True)
        return ActivationStore(self.device, prepared.activations, folder, owned=True)

    @contextmanager
    def timed(self, key: str):
        # GPU work is asynchronous: the device is waited for at both ends, so the time is the work's.
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        sync()
        t = time.perf_counter()
        yield  # not on an error: a collective whose peer died may never finish, and waiting for it would hang
        sync()
        self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - t

    def quantize(
        self, block: nn.Module, i: int, inputs: list[torch.Tensor], kwargs: dict, records: list[dict]
    ) -> tuple[dict[str, object], list[torch.Tensor]]:
        """Transform (with calibration) and quantize block `i` (on the compute device, its weights already through
        the transforms' `apply_block_weights`); return its packed layouts by full name and the inputs of the next
        block (the quantized block's outputs, or `inputs` when no later block needs them)."""
        adapter = self.adapter
        prefix = adapter.block_prefix(i)
        mine = {
            rel: self.assignment[f"{prefix}.{rel}"]
            for rel in adapter.linear_names()
            if f"{prefix}.{rel}" in self.assignment
        }
        if self.transforms:
            ctx = BlockContext(block, i, prefix, adapter, self.config, inputs, kwargs, mine, self.world)
            for tr in self.transforms:
                info = tr.apply_block(ctx)
                if info:
                    records.append({"stage": tr.name, "block": i, **info})
            # The ranks computed the same transforms from the same gathered samples; rank 0's weights are kept,
            # so that a last-bit difference between devices can never leave the ranks on different weights.
            self.world.sync_module(block)
        packed: dict[str, object] = {}
        tuners = sorted({s for s in mine.values() if s.finetunes()}, key=lambda s: s.index)
        targets: list[torch.Tensor] = []
        originals: dict[str, torch.Tensor] = {}
        if tuners:
            with torch.no_grad():
                targets = [block_output(block(x, **kwargs)) for x in inputs]
        sequential = any(s.sequential() for s in mine.values())
        if sequential and adapter.generic and len(adapter.linear_groups) == 1 and len(inputs):
            # A model no declared adapter knows: which linears share an input, and their order, from a forward.
            self.adapter = adapter = forward_groups(adapter, block, inputs[0], kwargs)
        groups = adapter.linear_groups if sequential else (tuple(adapter.linear_names()),)
        for group in groups:
            todo = [rel for rel in group if rel in mine]
            if not todo:
                continue
            need = [rel for rel in todo if self.wants_pass(mine[rel])]
            cal = self.recipe.calibration
            with self.timed("stats_s"), route_all(block, cal is not None and cal.expert_tokens == "all"):
                stats = (
                    _collect(
                        block,
                        need,
                        inputs,
                        kwargs,
                        hessian=any(mine[r].needs_hessian() for r in need),
                        world=self.world,
                    )
                    if need
                    else {}
                )
            self._count_expert_tokens(prefix, stats)
            objective = {rel: kind for rel in todo if (kind := mine[rel].attention_objective(rel, adapter))}
            probe = _attention_probe(block, adapter, self.config, inputs, kwargs) if objective else None

            def solve(rel: str, rows: range, stats=stats, objective=objective, probe=probe):
                linear = block.get_submodule(rel)
                extra = {"score": probe.row_score(linear, objective[rel])} if rel in objective else {}
                weight, stage = linear.weight.data.float(), mine[rel]
                st = stats.get(rel) or self.fp_stats.get(f"{prefix}.{rel}")
                if st is not None and st.tokens == 0 and stage.needs_hessian():
                    raise RecipeError(
                        f"{self.recipe.path}:calibration.expert_tokens: {prefix}.{rel} saw no calibration "
                        f"token routed to it; expected some for {stage.label}'s Hessian (expert_tokens: all routes "
                        f"every token through every expert for the statistics, or give more samples)"
                    )
                with self.timed("solve_s"):
                    if len(rows) < weight.shape[0]:
                        return stage.quantize_rows(f"{prefix}.{rel}", weight, st, rows)
                    return stage.quantize(f"{prefix}.{rel}", weight, st, **extra)

            # With several ranks, the group's linears are shared out as `World.plan` says (whole, or split by rows
            # over a team of ranks), and every rank solves all of its share before any result is sent, so the
            # solves run at the same time (the attention objective, which reads the group's other weights as
            # solved so far, is refused there: each linear is then solved whole, one after another).
            world = self.world
            early = world.size > 1 and not objective
            plan = world.plan(
                [
                    (block.get_submodule(rel).out_features, mine[rel].row_split() if early else None)
                    for rel in todo
                ]
            )
            solved = {
                rel: solve(rel, plan[j][world.rank])
                for j, rel in enumerate(todo)
                if early and len(plan[j][world.rank])
            }
            for j, rel in enumerate(todo):
                full = f"{prefix}.{rel}"
                linear: nn.Linear = block.get_submodule(rel)
                result = solved.pop(rel, None)
                if not early and len(plan[j][world.rank]):
                    result = solve(rel, plan[j][world.rank])
                with self.timed("share_s"):
                    result = world.share_rows(plan[j], result, tuple(linear.weight.shape))
                if mine[rel] in tuners:
                    originals[rel] = linear.weight.data.float().cpu()
                linear.weight.data.copy_(result.dequantized.to(linear.weight.device, linear.weight.dtype))
                packed[full] = result.packed
        for stage in tuners:
            rels = [rel for rel in mine if mine[rel] is stage]
            tuned, info = stage.finetune_block(
                block,
                {rel: packed[f"{prefix}.{rel}"] for rel in rels},
                {rel: originals[rel] for rel in rels},
                inputs,
                kwargs,
                targets,
            )
            for rel, layout in tuned.items():
                linear = block.get_submodule(rel)
                linear.weight.data.copy_(
                    layout.dequantize(torch.float32).to(linear.weight.device, linear.weight.dtype)
                )
                packed[f"{prefix}.{rel}"] = layout
            if info:
                records.append({"stage": stage.name, "block": i, **info})
        del targets, originals
        self.world.sync_module(block)
        if i < self.last_needing:
            with torch.no_grad():

                def run(x: torch.Tensor) -> torch.Tensor:
                    return block_output(block(x, **kwargs))

                inputs = inputs.map(run) if isinstance(inputs, ActivationStore) else [run(x) for x in inputs]
        return packed, inputs


def install_packed(model: nn.Module, packed: dict[str, object], prefix: str = "") -> None:
    """Replace each quantized linear of `model` (named inside the whole model, `model` itself named `prefix`) by
    the module that runs its packed layout."""
    for full, layout in packed.items():
        parent_name, _, child = full.removeprefix(f"{prefix}." if prefix else "").rpartition(".")
        parent = model.get_submodule(parent_name)
        old: nn.Linear = getattr(parent, child)
        bias = None if old.bias is None else old.bias.data.clone()
        setattr(parent, child, module_for(layout, bias))


def layer_summary(layout, has_bias: bool) -> dict:
    """What the manifest and config need of a packed layer once its tensors are on disk (JSON)."""
    out = {
        "layer": layout.layer_config(has_bias),
        "stored_bits": layout.stored_bits(),
        "in_features": layout.in_features,
        "out_features": layout.out_features,
        "fields": sorted(layout.tensors()),
    }
    report = layout.bits_report()
    if report is not None:
        out["bits_report"] = report
    return out


class LayerSummary:
    """A packed layer as `bits_per_weight` sees it, rebuilt from `layer_summary` (the tensors stay on disk)."""

    def __init__(self, summary: dict) -> None:
        self.summary = summary
        self.in_features = summary["in_features"]
        self.out_features = summary["out_features"]

    def stored_bits(self) -> int:
        return self.summary["stored_bits"]

    def tensors(self) -> dict[str, None]:
        return dict.fromkeys(self.summary["fields"])

    def layer_config(self, has_bias: bool) -> dict:
        return self.summary["layer"]

    def bits_report(self) -> dict[str, float] | None:
        return self.summary.get("bits_report")


def quantize_model(recipe: Recipe, reporter: Reporter, prepared: Prepared | None = None) -> QuantizedModel:
    """Quantize with the whole model loaded in host memory (one block at a time on the compute device)."""
    if prepared is None:
        prepared = preflight(recipe)
    t0 = time.perf_counter()
    device = resolve_device(recipe.settings.device)
    config = prepared.config
    dtype = compute_dtype(recipe.settings.dtype, device, config_dtype(config))
    reporter.log(f"loading {recipe.model} ({dtype}, blocks on {device})")
    model, tokenizer, adapter, original_dtype = load_model(recipe.model, dtype)
    blocks = adapter.blocks(model)
    work = _Blocks(recipe, adapter, model.config, len(blocks), device)
    records = work.apply_outer(model)
    timings = {"load_s": time.perf_counter() - t0}

    calibration_info = None
    inputs: list[torch.Tensor] = []
    kwargs: list[dict] = [{}] * len(blocks)
    if work.needs_calibration():
        t = time.perf_counter()
        inputs, kwargs, calibration_info = work.calibrate(model, prepared, tokenizer, reporter)
        timings["calibration_s"] = time.perf_counter() - t

    packed: dict[str, StoredLayout] = {}
    t = time.perf_counter()
    for i in reporter.track(range(len(blocks)), total=len(blocks), description="quantizing blocks"):
        for tr in work.transforms:
            tr.apply_block_weights(blocks[i], i, adapter)
        block = blocks[i].to(device)
        done, inputs = work.quantize(block, i, inputs, kwargs[i], records)
        packed.update(done)
        blocks[i] = block.to("cpu")
    timings["quantize_s"] = time.perf_counter() - t
    if isinstance(inputs, ActivationStore):
        inputs.close()
    del inputs

    install_packed(model, packed)
    experts = work.expert_summary()
    if experts is not None and calibration_info is not None:
        calibration_info["expert_tokens"] = experts
        if experts["below_input_width"]:
            reporter.log(
                f"calibration: {experts['below_input_width']} of {experts['experts']} experts saw fewer tokens than "
                f"their {model.config.hidden_size} inputs (fewest {experts['fewest']}); their Hessians rest on the "
                f"damping (calibration.expert_tokens: all, or more samples)"
            )
    timings["preflight_s"] = prepared.seconds
    timings["total_s"] = time.perf_counter() - t0 + prepared.seconds
    peak = peak_rss_mb()
    return QuantizedModel(
        model=model,
        tokenizer=tokenizer,
        adapter=adapter,
        original_dtype=original_dtype,
        packed=packed,
        calibration=calibration_info,
        timings=timings,
        peak_rss_mb=peak,
        transforms=records,
        model_schemes=work.model_schemes(),
    )


def _attention_probe(block: nn.Module, adapter, config, inputs: list[torch.Tensor], kwargs: dict):
    """The attention calls of `block` on its calibration inputs, for the q_proj/k_proj clipping objective."""
    from qtool.quant.attention_objective import AttentionProbe

    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return AttentionProbe(
        block,
        block.get_submodule(adapter.attention_path),
        block.get_submodule(adapter.output_linears[0]),
        inputs,
        kwargs,
        heads,
        kv_heads,
        head_dim,
    )


def _collect(
    block: nn.Module,
    names: list[str],
    inputs: list[torch.Tensor],
    kwargs: dict,
    hessian: bool,
    world: World | None = None,
) -> dict[str, LinearStats]:
    """Statistics of the inputs of `names` over all samples (this rank's, then combined with the other ranks');
    each pass stops once they have all run. Linears that take the same input tensor (q/k/v, gate/up) share one
    statistics object: the Hessian of a shared input is accumulated once, not once per linear."""
    stats = {n: LinearStats(block.get_submodule(n).in_features, hessian, inputs[0].device) for n in names}
    fired: set[str] = set()
    owner: dict[str, str] = {}  # linear → the first linear of the first pass that took its input
    taken: dict[
        int, tuple[torch.Tensor, str]
    ] = {}  # this pass: id of an input → (the input, kept alive; linear)

    def make_hook(n: str):
        def hook(module, args, output):
            x = args[0]
            first = taken.setdefault(id(x), (x, n))[1]
            if owner.setdefault(n, first) != first:
                raise RuntimeError(
                    f"{n} shared its input with {owner[n]} in the first pass, with {first} now"
                )
            if first == n:
                stats[n].update(x)
            fired.add(n)
            if len(fired) == len(names):
                raise StopForward

        return hook

    handles = [block.get_submodule(n).register_forward_hook(make_hook(n)) for n in names]
    try:
        with torch.no_grad():
            for x in inputs:
                fired.clear()
                taken.clear()
                try:
                    block(x, **kwargs)
                except StopForward:
                    pass
    finally:
        taken.clear()
        for h in handles:
            h.remove()
    stats = {n: stats[owner.get(n, n)] for n in names}
    for s in {id(s): s for s in stats.values()}.values():
        s.all_reduce(world or World())
    return stats


def _check_stats_header(
    recipe: Recipe, meta: nn.Module, adapter: Adapter, assignment: dict[str, QuantizerStage]
) -> None:
    """A stats file is of this model: its linears are this model's, with this model's input widths (read from the
    file's header, so a stats file of another model fails before any weight or statistic is read)."""
    path = Path(recipe.calibration.stats)
    header = read_header(path, InputError)
    widths = {
        f"{adapter.block_prefix(i)}.{rel}": meta.get_submodule(f"{adapter.block_prefix(i)}.{rel}").in_features
        for i in range(len(adapter.blocks(meta)))
        for rel in adapter.linear_names()
    }
    for key, info in sorted(header.items()):
        name, _, field_name = key.rpartition(".")
        if field_name != "absmax":
            continue
        if name not in widths:
            raise InputError(
                f"{path}: statistics for {name}, which is not a linear of '{recipe.model}'; expected a "
                f"stats file computed on this model"
            )
        if info.shape != (widths[name],):
            raise InputError(
                f"{path}: {name}.absmax has shape {list(info.shape)}, the model's linear has "
                f"{widths[name]} inputs; expected a stats file computed on this model"
            )
    _check_stats(recipe, {k.rpartition(".")[0]: None for k in header}, assignment)


def _check_stats(recipe: Recipe, fp_stats: dict, assignment: dict[str, QuantizerStage]) -> None:
    for full, stage in assignment.items():
        if stage.needs_calibration() and not stage.needs_hessian() and full not in fp_stats:
            raise InputError(
                f"{recipe.calibration.stats}: no statistics for {full}; expected a stats file "
                f"computed on this model"
            )
