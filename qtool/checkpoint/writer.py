"""Write a packed checkpoint directory atomically (temporary sibling, then rename)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import torch
import yaml
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors.torch import save_file

from qtool.checkpoint.manifest import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    dumps,
    file_sizes,
    hash_files,
    package_versions,
    portable,
)
from qtool.checkpoint.qconfig import stored_config
from qtool.layouts.base import StoredLayout
from qtool.models.integrity import INDEX_NAME, WEIGHTS_NAME
from qtool.output import Output, reserve_output


def collect_tensors(
    model: torch.nn.Module,
    packed: dict[str, StoredLayout],
    dtype: torch.dtype,
    *,
    prefix: str = "",
    skip: str | None = None,
) -> dict[str, torch.Tensor]:
    """Every tensor to store: packed fields as they are, other floating tensors in `dtype`; tied weights once.
    `prefix` names `model` inside the whole model (one decoder block); names under `skip.` are left out (the
    blocks, when they are stored block by block)."""
    packed_fields = {f"{name}.{field}" for name, layout in packed.items() for field in layout.tensors()}
    # Modules that mark themselves `stored_as_is` (the KV cache's float16 codebooks) keep their buffers' dtype.
    packed_fields |= {
        f"{prefix}.{mname}.{b}" if prefix else f"{mname}.{b}"
        for mname, mod in model.named_modules()
        if getattr(mod, "stored_as_is", False)
        for b, _ in mod.named_buffers(recurse=False)
    }
    seen: set[tuple[int, tuple[int, ...]]] = set()
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict(prefix=f"{prefix}." if prefix else "").items():
        if skip is not None and name.startswith(f"{skip}."):
            continue
        key = (t.data_ptr(), tuple(t.shape))
        # A tied weight (lm_head ↔ embed_tokens) is stored once: the config's tie flag restores it. Empty tensors
        # (e.g. `outlier_idx` of a layer without outliers) all share one address and are never ties.
        if t.numel() and key in seen:
            continue
        seen.add(key)
        if name not in packed_fields and t.is_floating_point():
            t = t.to(dtype)
        t = t.detach()
        # A contiguous CPU tensor that is its whole storage is written as it is (the writer reads it, nothing
        # changes it before). Others are copied: GPU tensors, and views of a larger storage, which safetensors
        # would write as shared memory.
        if t.device.type != "cpu" or not t.is_contiguous() or t.untyped_storage().nbytes() != t.nbytes:
            t = t.to("cpu").contiguous().clone()
        out[name] = t
    return out


def _nbytes(tensors: Mapping[str, torch.Tensor], name: str) -> int:
    sized = getattr(tensors, "nbytes", None)  # a lazy mapping knows sizes without reading the data
    if sized is not None:
        return sized(name)
    return tensors[name].numel() * tensors[name].element_size()


def _shards(tensors: Mapping[str, torch.Tensor], max_bytes: int) -> dict[str, list[str]]:
    """File name → tensor names, in name order, a new shard when the next tensor would pass `max_bytes` (a larger
    tensor gets a shard of its own), as huggingface_hub splits a state dict. It is given shapes and dtypes only, so
    a lazy mapping is never read here and every tensor counts its own bytes."""
    meta = getattr(tensors, "meta", None) or tensors
    shapes = {n: torch.empty(meta[n].shape, dtype=meta[n].dtype, device="meta") for n in sorted(tensors)}
    split = split_torch_state_dict_into_shards(shapes, filename_pattern=_PATTERN, max_shard_size=max_bytes)
    return split.filename_to_tensors


_PATTERN = WEIGHTS_NAME.replace(".safetensors", "{suffix}.safetensors")


def source_generation_config(model_ref: str):
    """The source model's generation_config.json as transformers reads it, or None when it has none."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(model_ref, local_files_only=True)
    except (OSError, ValueError):
        return None


def write_checkpoint(
    out_dir: Path,
    *,
    tensors: Mapping[str, torch.Tensor],
    config: dict,
    layers: dict[str, dict],
    model_schemes: dict | None = None,
    tokenizer,
    recipe_as_run: dict | None,
    manifest_extra: dict,
    max_shard_bytes: int,
    generation_config=None,
    overwrite: bool = False,
    reserved: Output | None = None,
    evaluate: Callable[[Path], dict] | None = None,
) -> dict:
    """Write the checkpoint and return its manifest. Nothing appears at `out_dir` until it is complete.

    `reserved` is the output as `reserve_output` checked and reserved it before the run's work (`overwrite` was
    decided there); without it the output is checked and reserved here. `evaluate` gets the folder once its
    tensors, config and tokenizer are written (a model loads from it) and returns the manifest's `eval` record."""
    if reserved is None:
        with reserve_output(out_dir, directory=True, overwrite=overwrite) as reserved:
            return write_checkpoint(
                out_dir,
                tensors=tensors,
                config=config,
                layers=layers,
                model_schemes=model_schemes,
                tokenizer=tokenizer,
                generation_config=generation_config,
                recipe_as_run=recipe_as_run,
                manifest_extra=manifest_extra,
                max_shard_bytes=max_shard_bytes,
                overwrite=overwrite,
                reserved=reserved,
                evaluate=evaluate,
            )
    tmp = reserved.tmp
    config, recipe_as_run, manifest_extra = (
        portable(config),
        portable(recipe_as_run),
        portable(manifest_extra),
    )
    shards = _shards(tensors, max_shard_bytes)
    # One shard's tensors in memory at a time (a lazy `tensors` reads them from disk here).
    for fname, names in shards.items():
        save_file({n: tensors[n] for n in names}, str(tmp / fname), metadata={"format": "pt"})
    if len(shards) > 1:
        weight_map = {n: fname for fname, names in shards.items() for n in names}
        total = sum(_nbytes(tensors, n) for n in tensors)
        (tmp / INDEX_NAME).write_text(dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))

    (tmp / "config.json").write_text(dumps(stored_config(config, layers, model_schemes)))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(tmp))
    if generation_config is not None:  # generate()'s defaults of the source model (eos ids, sampling)
        generation_config.save_pretrained(str(tmp))
    if recipe_as_run is not None:
        (tmp / "recipe.yaml").write_text(yaml.safe_dump(recipe_as_run, sort_keys=False))
    if evaluate is not None:
        # The loader reads a folder with a manifest; the final one replaces this one.
        sizes = file_sizes(tmp)
        (tmp / MANIFEST_NAME).write_text(
            dumps({"format_version": FORMAT_VERSION, "files": dict.fromkeys(sizes, ""), "sizes": sizes})
        )
        manifest_extra = {**manifest_extra, "eval": portable(evaluate(tmp))}
    from qtool.checkpoint.card import model_card

    # The card is written from the manifest's content before the manifest, so the manifest hashes it too.
    (tmp / "README.md").write_text(
        model_card(
            {"packages": package_versions(), **manifest_extra},
            {"quantization_config": {**(model_schemes or {}), "layers": layers}},
            recipe_as_run,
        )
    )
    manifest = {
        "format_version": FORMAT_VERSION,
        "files": hash_files(tmp),
        "sizes": file_sizes(tmp),
        "packages": package_versions(),
        **manifest_extra,
    }
    (tmp / MANIFEST_NAME).write_text(dumps(manifest))
    reserved.publish()
    return manifest


def bits_per_weight(packed: dict[str, StoredLayout], tensors: dict[str, torch.Tensor]) -> dict[str, float]:
    qbits = sum(p.stored_bits() for p in packed.values())
    qweights = sum(p.in_features * p.out_features for p in packed.values())
    packed_fields = {f"{name}.{field}" for name, layout in packed.items() for field in layout.tensors()}
    other = [t for name, t in tensors.items() if name not in packed_fields and t.is_floating_point()]
    all_bits = qbits + sum(t.numel() * t.element_size() * 8 for t in other)
    all_weights = qweights + sum(t.numel() for t in other)
    out = {
        "quantized_linears": round(qbits / max(qweights, 1), 4),
        "all_parameters": round(all_bits / max(all_weights, 1), 4),
    }
    # Layouts whose paper counts bits differently from what is stored report both, per layer and for the model
    # (weighted by the layer's weights): `stored` is what the tensor files hold.
    reports = {name: r for name, p in sorted(packed.items()) if (r := p.bits_report()) is not None}
    if reports:
        sizes = {name: packed[name].in_features * packed[name].out_features for name in reports}
        total = sum(sizes.values())
        out["layers"] = {n: {k: round(v, 4) for k, v in r.items()} for n, r in reports.items()}
        out["reported_layers"] = {
            key: round(sum(r[key] * sizes[n] for n, r in reports.items()) / total, 4)
            for key in next(iter(reports.values()))
        }
    return out
