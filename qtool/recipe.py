"""Recipes: YAML files naming a model, calibration data, an ordered chain of stages and an output.

The whole recipe is validated before any model is loaded; every problem is one line `file:key: found X,
expected Y` (exit code 3; 4 for a model, text or stats file that does not exist). Relative paths in a recipe are
relative to the recipe's folder; paths given on the command line are relative to the working directory.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from qtool.calibration.data import check_encoding
from qtool.errors import InputError, RecipeError, UsageError, shown
from qtool.models.loading import is_hub_id
from qtool.options import INT_LIMIT, YAMLTooLarge, check_option, load_yaml, option, parse_options
from qtool.stages import STAGES
from qtool.stages.base import QuantizerStage, Targets, TransformStage
from qtool.units import parse_size

_TEXT_SUFFIXES = (".txt", ".jsonl", ".json", ".parquet", ".csv")


@dataclass
class CalibrationSpec:
    source: str = option(help="a .txt/.jsonl file, a saved datasets folder, or a datasets name")
    num_samples: int = option(128, min=1, max=100_000, help="number of token windows")
    seq_len: int = option(2048, min=8, max=1_048_576, help="tokens per window")
    seed: int = option(0, min=0, max=INT_LIMIT, help="seed of the window sampler")
    text_field: str = option("text", help="field holding the text in .jsonl/datasets sources")
    split: str = option("train", help="datasets split")
    config: str | None = option(None, help="datasets config name")
    stats: str | None = option(
        None, help="stats file from `qtool calibrate`, reused instead of FP statistics"
    )
    encoding: str = option("utf-8", help="text encoding of a .txt/.jsonl source (e.g. latin-1, cp1252)")
    allow_long_context: bool = option(
        False,
        help="allow seq_len beyond the model's context length (max_position_embeddings); refused otherwise",
    )
    expert_tokens: Literal["routed", "all"] = option(
        "routed",
        help="mixture of experts: each expert's statistics from the tokens routed to it, or from every token "
        "(for the statistics only; the block's outputs still route)",
    )

    def validate(self) -> tuple[str, str] | None:
        problem = check_encoding(self.encoding)
        return ("encoding", problem) if problem else None


@dataclass
class EvalSpec:
    text: str | None = option(
        None, help="perplexity text: a .txt/.jsonl file, a saved datasets folder, or a datasets name"
    )
    seq_len: int = option(2048, min=8, max=1_048_576, help="tokens per window")
    max_windows: int | None = option(None, min=1, help="evaluate only the first windows; null for all")
    stride: int | None = option(None, min=1, help="tokens between window starts; null for non-overlapping")
    separator: str | None = option(None, help="split the text into documents here and tokenize each with BOS")
    text_field: str = option("text", help="field holding the text in .jsonl/datasets sources")
    split: str = option("test", help="datasets split")
    config: str | None = option(None, help="datasets config name")
    batch_size: int = option(4, min=1, max=1024, help="windows per forward pass")
    tasks: list[str] | None = option(
        None, help="zero-shot tasks through lm-eval, e.g. [piqa, arc_easy, hellaswag]"
    )
    limit: int | None = option(None, min=1, help="score only the first items of each task; null for all")
    num_fewshot: int = option(0, min=0, max=100, help="examples in each task prompt")
    task_batch_size: int | Literal["auto"] = option(
        32, min=1, max=4096, help="lm-eval requests per forward pass"
    )
    data_dir: str | None = option(
        None,
        help="folder of the standard tasks' JSONL files (default: "
        "$QTOOL_ZEROSHOT_DATA, else ../shared/assets/data/zeroshot)",
    )
    encoding: str = option("utf-8", help="text encoding of a .txt/.jsonl text (e.g. latin-1, cp1252)")
    allow_long_context: bool = option(
        False,
        help="allow seq_len beyond the model's context length (max_position_embeddings); refused otherwise",
    )

    def validate(self) -> tuple[str, str] | None:
        if self.text is None and not self.tasks:
            return "text", "missing; expected a text (perplexity) and/or tasks (zero-shot accuracy)"
        problem = check_encoding(self.encoding)
        return ("encoding", problem) if problem else None


@dataclass
class Settings:
    device: str = option("auto", help="compute device for the block-wise pipeline: auto, cpu, cuda, cuda:N")
    dtype: Literal["auto", "float32", "float16", "bfloat16", "float64"] = option(
        "auto",
        help="activation dtype in the pipeline; auto is float32 on CPU and the model's dtype on CUDA "
        "(float64 for exactness checks)",
    )
    max_shard_size: str = option("5GB", help="largest safetensors file before the checkpoint is sharded")


@dataclass
class StageSpec:
    stage: QuantizerStage | TransformStage
    raw: dict


@dataclass
class Recipe:
    path: Path | None
    model: str
    output: str | None
    calibration: CalibrationSpec | None
    stages: list[StageSpec]
    eval: EvalSpec | None
    settings: Settings
    as_run: dict = field(default_factory=dict)
    # Where a value came from (`file:key` or the `--flag` that overrode it), for errors found after validation,
    # e.g. a seq_len beyond the model's context once its config is read.
    origins: dict[str, str] = field(default_factory=dict)
    # The format the checkpoint must be exportable to (qtool/export/targets.py); "qtool" asks nothing more.
    target: str = "qtool"

    def needs_calibration(self) -> bool:
        return any(s.stage.needs_calibration() for s in self.stages)

    def quantizers(self) -> list[QuantizerStage]:
        return [s.stage for s in self.stages if isinstance(s.stage, QuantizerStage)]

    def transforms(self) -> list[TransformStage]:
        return [s.stage for s in self.stages if isinstance(s.stage, TransformStage)]

    def max_shard_bytes(self) -> int:
        return parse_size(self.settings.max_shard_size)


# What a checkpoint must stay exportable to (qtool/export/targets.py checks it before the run); "vllm" is
# compressed-tensors by the name of the engine that reads it.
TARGETS = ("qtool", "compressed-tensors", "vllm")
# A recipe is a few hundred bytes; anything near this is not one, and is refused before it is read.
MAX_RECIPE_BYTES = 1 << 20
TOP_KEYS = ("model", "calibration", "stages", "output", "eval", "settings", "target")
# Overrides whose command-line flag is not named after the key.
_FLAGS = {"calibration.source": "--calibration", "eval.max_windows": "--max-windows"}


def load_recipe(
    path: str | Path, overrides: dict[str, Any] | None = None, names: dict[str, str] | None = None
) -> Recipe:
    """Read and validate a recipe. `overrides` maps `model`, `output`, `calibration.<key>` and
    `eval.max_windows` to CLI values; `names` says how an error names each override (default: its flag)."""
    path = Path(path)
    label = str(path)
    if path.is_dir():
        raise RecipeError(f"{label}: is a directory; expected a YAML recipe file")
    if not path.is_file():
        raise RecipeError(f"{label}: recipe file not found")
    try:
        size = path.stat().st_size
        if size > MAX_RECIPE_BYTES:
            raise RecipeError(
                f"{label}: found {size} bytes, expected a recipe of at most {MAX_RECIPE_BYTES} bytes (a YAML "
                f"file of a few keys)"
            )
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise RecipeError(
            f"{label}: found a byte that is not UTF-8 (0x{e.object[e.start]:02x} at offset {e.start}); "
            f"expected a YAML text file"
        ) from None
    except OSError as e:
        raise RecipeError(
            f"{label}: cannot be read ({e.strerror or e}); expected a readable YAML file"
        ) from None
    if not text.strip():
        raise RecipeError(f"{label}: is empty; expected a mapping with keys {', '.join(TOP_KEYS)}")
    try:
        raw = load_yaml(text)
    except YAMLTooLarge as e:
        raise RecipeError(f"{label}: found YAML whose {e.problem}; expected a recipe") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise RecipeError(f"{label}: malformed YAML{where}: {problem}") from None
    if raw is None:  # only comments
        raise RecipeError(f"{label}: is empty; expected a mapping with keys {', '.join(TOP_KEYS)}")
    return validate_recipe(raw, label, path.resolve().parent, overrides or {}, path, names)


def validate_recipe(
    raw: Any,
    label: str,
    base: Path,
    overrides: dict[str, Any],
    path: Path | None = None,
    names: dict[str, str] | None = None,
) -> Recipe:
    if not isinstance(raw, dict):
        raise RecipeError(
            f"{label}: found {type(raw).__name__}, expected a mapping with keys {', '.join(TOP_KEYS)}"
        )
    for key in raw:
        if key not in TOP_KEYS:
            raise RecipeError(f"{label}:{key}: unknown key; expected one of {', '.join(TOP_KEYS)}")
    cwd = Path.cwd()

    # Each value remembers where it came from, so errors name the flag or the recipe key.
    def where(key: str) -> str:
        if key not in overrides:
            return f"{label}:{key}"
        if names and key in names:
            return names[key]
        return _FLAGS.get(key) or f"--{key.split('.')[-1].replace('_', '-')}"

    # An override is checked on its own first, so that a bad value names the flag (or argument) it came from,
    # not the recipe key it replaces.
    for key, value in overrides.items():
        section, _, name = key.partition(".")
        spec = {"calibration": CalibrationSpec, "eval": EvalSpec}.get(section)
        if spec is not None and name in {f.name for f in dataclasses.fields(spec)}:
            try:
                check_option(spec, name, value, where(key))
            except RecipeError as e:  # the command line's (or the caller's) value, not the recipe's
                raise UsageError(str(e)) from None

    model = overrides.get("model", raw.get("model"))
    if model is None:
        raise RecipeError(f"{label}:model: missing; expected a model directory or a hub id")
    if not isinstance(model, str):
        raise RecipeError(f"{where('model')}: found {shown(model)}, expected a model directory or a hub id")
    model = _resolve_model(model, cwd if "model" in overrides else base, where("model"))

    output = overrides.get("output", raw.get("output"))
    if output is not None and not isinstance(output, str):
        raise RecipeError(f"{where('output')}: found {shown(output)}, expected a directory path")
    if output is not None:
        output = str(((cwd if "output" in overrides else base) / output).resolve())

    settings_raw = raw.get("settings") or {}
    if "settings.device" in overrides and isinstance(settings_raw, dict):
        settings_raw = {**settings_raw, "device": overrides["settings.device"]}
    settings = parse_options(Settings, settings_raw, f"{label}:settings")
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", settings.device):
        raise RecipeError(
            f"{label}:settings.device: found {settings.device!r}, expected auto, cpu, cuda or cuda:N"
        )
    try:
        parse_size(settings.max_shard_size)
    except ValueError:
        raise RecipeError(
            f"{label}:settings.max_shard_size: found {settings.max_shard_size!r}, expected a size "
            f"such as 5GB or 500MB"
        ) from None

    stages_raw = raw.get("stages")
    if not isinstance(stages_raw, list) or not stages_raw:
        raise RecipeError(f"{label}:stages: found {shown(stages_raw)}, expected a non-empty list of stages")
    stages = [_parse_stage(s, i, label) for i, s in enumerate(stages_raw)]
    # Transforms rewrite the float model that the quantizers then see; one after a quantizer would have to
    # undo the packed layers.
    seen_quantizer = None
    for spec in stages:
        if isinstance(spec.stage, QuantizerStage):
            seen_quantizer = seen_quantizer or spec.stage
        elif seen_quantizer is not None:
            raise RecipeError(
                f"{label}:stages[{spec.stage.index}]: transform {spec.stage.name!r} comes after "
                f"quantizer {seen_quantizer.label}; expected every transform before the quantizers"
            )

    cal_raw = raw.get("calibration")
    cal_over = {k.split(".", 1)[1]: v for k, v in overrides.items() if k.startswith("calibration.")}
    calibration = None
    if cal_raw is not None or cal_over:
        merged = dict(cal_raw or {}) if isinstance(cal_raw, dict) or cal_raw is None else cal_raw
        if isinstance(merged, dict):
            merged.update(cal_over)
        calibration = parse_options(CalibrationSpec, merged, f"{label}:calibration")
        src_base = cwd if "calibration.source" in overrides else base
        calibration.source = resolve_text(calibration.source, src_base, where("calibration.source"))
        if calibration.stats is not None:
            stats_base = cwd if "calibration.stats" in overrides else base
            p = (stats_base / calibration.stats).resolve()
            if not p.is_file():
                raise InputError(
                    f"{where('calibration.stats')}: file '{p}' does not exist; expected a stats file "
                    f"written by `qtool calibrate`"
                )
            calibration.stats = str(p)
            moved = next((s.stage for s in stages if isinstance(s.stage, TransformStage)), None)
            if moved is not None:
                raise RecipeError(
                    f"{where('calibration.stats')}: a stats file of the original model, with "
                    f"{moved.label} changing the model first; expected no stats file (the pipeline "
                    f"calibrates the transformed model itself)"
                )
    if calibration is None and any(s.stage.needs_calibration() for s in stages):
        first = next(s.stage for s in stages if s.stage.needs_calibration())
        raise RecipeError(
            f"{label}:calibration: missing; expected calibration data, which {first.label} needs"
        )

    ev = None
    if raw.get("eval") is not None:
        ev_raw = raw["eval"]
        if isinstance(ev_raw, dict) and "eval.max_windows" in overrides:
            ev_raw = {**ev_raw, "max_windows": overrides["eval.max_windows"]}
        ev = parse_options(EvalSpec, ev_raw, f"{label}:eval")
        if ev.text is not None:
            ev.text = resolve_text(ev.text, base, f"{label}:eval.text")
        if ev.data_dir is not None:
            ev.data_dir = str((base / Path(ev.data_dir).expanduser()).resolve())

    target = raw.get("target", "qtool")
    if target not in TARGETS:
        raise RecipeError(f"{label}:target: found {shown(target)}, expected one of {', '.join(TARGETS)}")
    recipe = Recipe(path, model, output, calibration, stages, ev, settings, target=target)
    recipe.as_run = _as_run(recipe)
    recipe.origins = {
        key: _origin(key, raw, label, where(key), key in overrides)
        for key in (
            "model",
            "calibration.num_samples",
            "calibration.seq_len",
            "calibration.source",
            "eval.seq_len",
            "eval.text",
        )
    }
    return recipe


def _origin(key: str, raw: dict, label: str, where: str, overridden: bool) -> str:
    """`where`, marked "(default)" when neither the recipe nor a flag set the value: an error about a value the user
    never wrote says so (and, for a recipe made from flags, names the flag that sets it)."""
    section, _, name = key.rpartition(".")
    written = raw.get(section) if section else raw
    if overridden or (isinstance(written, dict) and name in written):
        return where
    if label == "command line":
        return f"--{name.replace('_', '-')} (default)"
    return f"{where} (default)"


def _parse_stage(entry: Any, i: int, label: str) -> StageSpec:
    where = f"{label}:stages[{i}]"
    if not isinstance(entry, dict) or "stage" not in entry:
        raise RecipeError(
            f"{where}: found {shown(entry)}, expected a mapping with a 'stage' key naming one of "
            f"{', '.join(sorted(STAGES))}"
        )
    name = entry["stage"]
    if name not in STAGES:
        raise RecipeError(
            f"{where}.stage: unknown stage {shown(name)}; expected one of {', '.join(sorted(STAGES))}"
        )
    cls = STAGES[name]
    opts = {k: v for k, v in entry.items() if k not in ("stage", "targets")}
    options = parse_options(cls.options_cls, opts, where)
    targets = parse_options(Targets, entry.get("targets") or {}, f"{where}.targets")
    return StageSpec(cls(options, targets, i), dict(entry))


def _looks_like_path(ref: str) -> bool:
    return ref.startswith((".", "/", "~")) or ref.endswith(_TEXT_SUFFIXES)


def _resolve_model(ref: str, base: Path, where: str) -> str:
    if is_hub_id(ref, base):
        return ref
    p = (base / Path(ref).expanduser()).resolve()
    if not p.exists():
        raise InputError(f"{where}: path '{p}' does not exist; expected a model directory or a hub id")
    if not (p / "config.json").is_file():
        raise InputError(f"{where}: '{p}' has no config.json; expected a Hugging Face model directory")
    return str(p)


def resolve_text(ref: str, base: Path, where: str) -> str:
    p = (base / Path(ref).expanduser()).resolve()
    if p.exists():
        return str(p)
    if _looks_like_path(ref):
        raise InputError(
            f"{where}: file '{p}' does not exist; expected a text file, a datasets folder or a datasets name"
        )
    return ref  # a datasets name, resolved when loaded


def _as_run(r: Recipe) -> dict:
    """The recipe with overrides applied and defaults filled in, as saved beside the checkpoint. The output path
    is left out: where a checkpoint is written is not part of what it is (copies stay byte-identical)."""
    out: dict[str, Any] = {"model": r.model}
    if r.calibration is not None:
        out["calibration"] = dataclasses.asdict(r.calibration)
    out["stages"] = [
        {
            "stage": s.stage.name,
            **dataclasses.asdict(s.stage.options),
            "targets": dataclasses.asdict(s.stage.targets),
        }
        for s in r.stages
    ]
    if r.eval is not None:
        out["eval"] = dataclasses.asdict(r.eval)
    out["settings"] = dataclasses.asdict(r.settings)
    if r.target != "qtool":  # recipes without a target keep their recipe.yaml byte for byte
        out["target"] = r.target
    return out
