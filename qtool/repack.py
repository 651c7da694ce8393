"""`qtool pack`: verify a checkpoint and optionally write a re-packed (e.g. re-sharded) copy."""

from __future__ import annotations

from pathlib import Path

import yaml

from qtool.console import Reporter
from qtool.output import Output


def run_pack(
    checkpoint: Path,
    output: Path | None,
    max_shard_size: str,
    overwrite: bool,
    reporter: Reporter,
    verify: bool = True,
) -> dict:
    """`verify`: hash every file and read every tensor; otherwise (`--quick`) only what every load checks."""
    from qtool.errors import UsageError
    from qtool.output import folder_bytes, reserve_output
    from qtool.units import parse_size

    if not verify:
        if output is not None:
            raise UsageError(
                "--quick with -o: a re-pack reads every tensor and verifies the checkpoint; drop --quick"
            )
        return _quick(checkpoint)
    if output is None:
        return _pack(checkpoint, None, None, None, reporter)
    try:
        shard_bytes = parse_size(max_shard_size)
    except ValueError:
        raise UsageError(f"--max-shard-size: found {max_shard_size!r}, expected a size such as 5GB") from None
    # The copy's folder is checked (and its temporary created) before the checkpoint is read.
    needs = folder_bytes(checkpoint) if checkpoint.is_dir() else None
    with reserve_output(
        output,
        directory=True,
        overwrite=overwrite,
        needs_bytes=needs,
        log=reporter.log,
        inputs={"checkpoint": checkpoint},
    ) as reserved:
        return _pack(checkpoint, output, reserved, shard_bytes, reporter)


def _quick(checkpoint: Path) -> dict:
    """What every load checks, without reading a tensor: manifest, file sizes, safetensors headers and index,
    config.json (the model's and quantization_config) and the tokenizer."""
    from qtool.checkpoint.loader import (
        check_files,
        checkpoint_config,
        load_tokenizer,
        read_config,
        read_manifest,
    )
    from qtool.errors import CheckpointError
    from qtool.models.integrity import tensor_index

    if not checkpoint.is_dir():
        raise CheckpointError(f"{checkpoint}: not a directory; expected a qtool checkpoint")
    manifest = read_manifest(checkpoint)
    check_files(checkpoint, manifest)
    if tensor_index(checkpoint, CheckpointError) is None:
        raise CheckpointError(
            f"{checkpoint}: no model.safetensors (or shards with model.safetensors.index.json)"
        )
    layers = read_config(checkpoint)["quantization_config"]["layers"]
    checkpoint_config(checkpoint)
    load_tokenizer(checkpoint)
    return {
        "checkpoint": str(checkpoint),
        "verified": False,
        "checked": "sizes, headers, configs, tokenizer",
        "quantized_layers": len(layers),
        "bits_per_weight": manifest.get("bits_per_weight"),
    }


def _pack(
    checkpoint: Path,
    output: Path | None,
    reserved: Output | None,
    shard_bytes: int | None,
    reporter: Reporter,
) -> dict:
    from qtool.checkpoint.loader import check_figures, read_manifest, read_tensors, verify_files
    from qtool.checkpoint.writer import bits_per_weight, source_generation_config, write_checkpoint

    manifest = read_manifest(checkpoint)
    verify_files(checkpoint, manifest)
    from qtool.checkpoint.loader import load_checkpoint, load_tokenizer, read_config
    from qtool.layouts.registry import layout_class

    config = read_config(checkpoint)
    # A checkpoint is verified only if it can be used: it must carry a tokenizer (quantize always writes one).
    tokenizer = load_tokenizer(checkpoint)
    model = load_checkpoint(checkpoint, verify=False)  # checks every layout, tensor shape and value (finite)
    layers = config["quantization_config"]["layers"]
    packed = {name: model.get_submodule(name).layout for name in layers}
    del model
    check_figures(checkpoint, manifest, bits_per_weight(packed, read_tensors(checkpoint).meta))
    del packed
    layouts: dict[str, int] = {}
    for cfg in layers.values():
        key = layout_class(cfg["format"]).describe(cfg)
        layouts[key] = layouts.get(key, 0) + 1
    summary = {
        "checkpoint": str(checkpoint),
        "verified": True,
        "checked": "hashes, tensors (layouts, shapes, finite values), configs, tokenizer",
        "quantized_layers": len(layers),
        "layouts": layouts,
        "bits_per_weight": manifest.get("bits_per_weight"),
    }
    if reserved is not None:
        tensors = read_tensors(checkpoint)
        qcfg = config.pop("quantization_config")
        # The model's run-time schemes (the KV cache's) travel with the layers.
        schemes = {k: v for k, v in qcfg.items() if k not in ("quant_method", "format_version", "layers")}
        recipe_file = checkpoint / "recipe.yaml"
        recipe = yaml.safe_load(recipe_file.read_text()) if recipe_file.is_file() else None
        extra = {k: v for k, v in manifest.items() if k not in ("files", "sizes", "format_version")}
        write_checkpoint(
            output,
            tensors=tensors,
            config=config,
            layers=layers,
            model_schemes=schemes,
            tokenizer=tokenizer,
            generation_config=source_generation_config(str(checkpoint)),
            recipe_as_run=recipe,
            manifest_extra=extra,
            max_shard_bytes=shard_bytes,
            reserved=reserved,
        )
        summary["output"] = str(output)
        if reserved.removed_leftovers:
            summary["removed_leftovers"] = [str(p) for p in reserved.removed_leftovers]
        reporter.log(f"wrote {output}")
    return summary
