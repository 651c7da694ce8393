"""`qtool export --format compressed-tensors` (formats/compressed-tensors.md): a checkpoint in the format that
transformers and vLLM load natively, written through the `compressed-tensors` library itself.

Every quantized layer is first mapped to a compressed-tensors scheme; the first layer (or model scheme) the format
cannot hold is refused before anything is written. The library's own compressor then quantizes and packs each
layer from qtool's exact dequantized weight and stored scales and zero points, and the library's decompressor
must give that weight back bit for bit: an export is either exact or refused, never silently lossy."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from qtool.console import Reporter
from qtool.errors import UsageError

FORMAT = "compressed-tensors"

# qtool layouts whose every instance some compressed-tensors scheme holds, and why the others cannot be exported.
_CANNOT = {
    "mixed": "2/4/16-bit mixed precision stripes with sparse float16 outliers",
}


@dataclass(frozen=True)
class LayerScheme:
    """The compressed-tensors scheme of one quantized layer: weight args and, for W8A8-style layers, the dynamic
    per-token activation args."""

    bits: int
    symmetric: bool
    group_size: int | None  # None: one scale per output channel
    act_bits: int | None = None
    act_symmetric: bool = True

    def scheme(self, targets: list[str]):
        from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

        weights = QuantizationArgs(
            num_bits=self.bits,
            type="int",
            symmetric=self.symmetric,
            strategy="group" if self.group_size else "channel",
            group_size=self.group_size,
        )
        acts = None
        if self.act_bits is not None:
            acts = QuantizationArgs(
                num_bits=self.act_bits,
                type="int",
                symmetric=self.act_symmetric,
                strategy="token",
                dynamic=True,
            )
        return QuantizationScheme(targets=targets, weights=weights, input_activations=acts)

    def describe(self) -> str:
        g = f"g{self.group_size}" if self.group_size else "per channel"
        a = f"A{self.act_bits} per token" if self.act_bits else "A16"
        return f"W{self.bits} {'sym' if self.symmetric else 'asym'} {g}, {a}"


def _refuse(where: str, found: str) -> UsageError:
    return UsageError(
        f"{where}: {found}; compressed-tensors cannot express it, expected grouped or per-channel "
        f"integer weights (W2..W8, whole groups) with at most per-token dynamic INT activations"
    )


def layer_scheme(name: str, cfg: dict, where: str) -> LayerScheme:
    """The scheme of layer `name` (its qtool layer config), or a one-line refusal naming the layer."""
    fmt = cfg.get("format")
    at = f"{where}: layer {name}"
    if fmt in _CANNOT:
        raise _refuse(at, f"{fmt} layout ({_CANNOT[fmt]})")
    k, g = cfg.get("in_features"), cfg.get("group_size")
    if isinstance(g, int) and isinstance(k, int) and k % g:
        raise UsageError(
            f"{at}: in_features {k} is not a multiple of group_size {g} (the last group of each row is "
            f"partial); compressed-tensors expects whole groups (quantize with `target: "
            f"compressed-tensors` in the recipe, or a group size dividing {k})"
        )
    if fmt == "grouped_int":
        return LayerScheme(bits=cfg["bits"], symmetric=bool(cfg["symmetric"]), group_size=g)
    if fmt == "qoq":
        if g is not None:
            raise _refuse(at, "qoq progressive groups (two-level scales: 8-bit levels times 4-bit groups)")
        # W8: symmetric codes; W4 per channel: one zero point per row. Activations: per-token symmetric INT8.
        return LayerScheme(
            bits=cfg["bits"], symmetric=cfg["bits"] == 8, group_size=None, act_bits=cfg["act_bits"]
        )
    if fmt == "quik":
        if cfg.get("num_outliers"):
            raise _refuse(at, f"quik layout with {cfg['num_outliers']} float16 outlier input columns")
        if cfg.get("sparsity"):
            raise _refuse(at, f"quik layout with {cfg['sparsity']} sparse weights")
        # Per-token asymmetric activations (a float zero at the row minimum in qtool; an integer zero point in
        # compressed-tensors' runtime: formats/compressed-tensors.md).
        return LayerScheme(
            bits=cfg["bits"], symmetric=True, group_size=None, act_bits=cfg["act_bits"], act_symmetric=False
        )
    raise _refuse(at, f"layout {fmt!r}")


def _model_schemes(qcfg: dict, where: str) -> None:
    from qtool.kv_cache.schemes import RESERVED

    for key, value in sorted(qcfg.items()):
        if key in RESERVED:
            continue
        if key == "kv_cache":
            bits = value.get("bits") if isinstance(value, dict) else value
            raise _refuse(
                f"{where}: quantization_config.kv_cache",
                f"a {bits}-bit KV cache quantized per token at run time",
            )
        raise _refuse(f"{where}: quantization_config.{key}", "a model scheme")


def plan(checkpoint: Path, config: dict, linears: list[str]) -> dict[str, LayerScheme]:
    """{layer: scheme} for every quantized layer, in model order (`linears`: the model's nn.Linear names in
    module order); refuses the first layer, then the first model scheme, that cannot be exported."""
    where = str(checkpoint / "config.json")
    qcfg = config["quantization_config"]
    layers = qcfg.get("layers", {})
    order = [n for n in linears if n in layers] + sorted(set(layers) - set(linears))
    out = {name: layer_scheme(name, layers[name], where) for name in order}
    _model_schemes(qcfg, where)
    return out


def model_linears(checkpoint: Path) -> list[str]:
    """The names of the checkpoint's model's nn.Linear modules in module order (a meta-device model: no weight)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    from qtool.checkpoint.loader import checkpoint_config

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(checkpoint_config(checkpoint))
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]


def _signed(codes: torch.Tensor, bits: int) -> torch.Tensor:
    return (codes - (1 << (bits - 1))).to(torch.int8)


# The exported scales' dtype. Clients dequantize in the scale's dtype (transformers' `dequantize=True` does, then
# casts to the model's dtype), so float32 scales (qtool's float16 ones, exactly) give qtool's weight rounded once,
# as qtool's reference forward rounds it; float16 scales would round every weight to float16 first.
SCALE_DTYPE = torch.float32


def layer_state(
    name: str, cfg: dict, fields: dict[str, torch.Tensor], dtype: torch.dtype
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(qtool's dequantized weight in float32, its compressed-tensors qparams: weight_scale in `dtype` and, when
    asymmetric, weight_zero_point in the library's signed convention) of one layer, validated by its layout."""
    from qtool.layouts.registry import layout_class

    layout = layout_class(cfg["format"]).from_tensors(name, cfg, fields)
    weight = layout.dequantize(torch.float32)
    fmt, bits = cfg["format"], cfg["bits"]
    if fmt == "grouped_int":
        zeros = None if layout.zeros is None else _signed(layout.zeros.to(torch.int64), bits)
        scales = layout.scales
    elif fmt == "qoq":
        zeros = None if layout.zeros is None else _signed(layout.zeros.to(torch.int64), bits)[:, None]
        scales = layout.scales[:, None]
    else:  # quik without outliers
        zeros, scales = None, layout.scales[:, None]
    qparams = {"weight_scale": scales.to(dtype).contiguous()}
    if zeros is not None:
        qparams["weight_zero_point"] = zeros.contiguous()
    return weight, qparams


def compress_layer(name: str, weight: torch.Tensor, qparams: dict[str, torch.Tensor], scheme) -> dict:
    """The layer's tensors as the library's compressor for `scheme` writes them, checked by decompressing them
    with the same library (float32 scales, so the product is rounded once, as qtool's dequantize rounds it)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.compressors.format import infer_module_format

    from qtool.errors import CheckpointError

    compressor = BaseCompressor.get_value_from_registry(infer_module_format(torch.nn.Linear, scheme).value)
    out = compressor.compress({"weight": weight, **qparams}, scheme)
    back = compressor.decompress({**out, "weight_scale": out["weight_scale"].to(torch.float32)}, scheme)[
        "weight"
    ]
    if back.shape != weight.shape or not torch.equal(back.to(torch.float32), weight):
        bad = (
            (back.to(torch.float32) - weight).abs().max().item() if back.shape == weight.shape else back.shape
        )
        raise CheckpointError(
            f"layer {name}: the compressed-tensors round trip differs from the checkpoint's weight "
            f"({bad}); expected an exact copy"
        )
    return out


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """`t` contiguous and alone in its storage: the library packs a per-channel zero point ([rows, 1]) into a view
    of a larger buffer, and the safetensors writer refuses a tensor that does not cover its whole storage."""
    t = t.contiguous()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone()
    return t


def quantization_config(schemes: dict[str, LayerScheme], ignore: list[str]):
    """compressed-tensors' QuantizationConfig: one config group per distinct scheme. A scheme shared by every
    quantized linear targets `Linear` (what llm-compressor writes); otherwise each group lists its modules."""
    from compressed_tensors.compressors.format import infer_module_format
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus

    groups: dict[LayerScheme, list[str]] = {}
    for name, s in schemes.items():
        groups.setdefault(s, []).append(name)
    config_groups, formats = {}, set()
    for i, (s, names) in enumerate(groups.items()):
        scheme = s.scheme(["Linear"] if len(groups) == 1 else names)
        scheme.format = infer_module_format(torch.nn.Linear, scheme)
        formats.add(scheme.format.value)
        config_groups[f"group_{i}"] = scheme
    fmt = formats.pop() if len(formats) == 1 else "mixed-precision"
    return QuantizationConfig(
        config_groups=config_groups,
        format=fmt,
        ignore=ignore,
        quantization_status=QuantizationStatus.COMPRESSED,
    )


def write_record(folder: Path, checkpoint: Path, manifest: dict, fmt: str = FORMAT) -> None:
    """The export's provenance (which checkpoint, which libraries, every file's hash): what lets `--overwrite`
    recognise the folder as qtool's to replace, and a reader trace the model back to its recipe. The library
    writes its shards owner-only (a temporary file renamed); they get the permissions any other file gets."""
    import os

    from qtool.checkpoint.manifest import MANIFEST_NAME as SOURCE_MANIFEST
    from qtool.checkpoint.manifest import dumps, file_sha256, hash_files, package_versions
    from qtool.output import EXPORT_RECORD

    umask = os.umask(0)
    os.umask(umask)
    for f in folder.glob("*.safetensors"):
        f.chmod(0o666 & ~umask)
    packages = package_versions()
    if fmt == FORMAT:
        import compressed_tensors

        packages["compressed-tensors"] = compressed_tensors.__version__
    record = {
        "format": fmt,
        "source": {
            "checkpoint": checkpoint.name,
            "base_model": manifest.get("base_model"),
            "manifest_sha256": file_sha256(checkpoint / SOURCE_MANIFEST),
            "stages": manifest.get("stages"),
            "seed": manifest.get("seed"),
            "bits_per_weight": manifest.get("bits_per_weight"),
        },
        "packages": packages,
        "files": hash_files(folder),
    }
    (folder / EXPORT_RECORD).write_text(dumps(record))


def stored_names(checkpoint: Path):
    """The checkpoint's family's mapping from qtool's module names to its hub checkpoints' (identity for most)."""
    from qtool.checkpoint.loader import checkpoint_config
    from qtool.models.loading import adapter_of

    adapter = adapter_of(checkpoint_config(checkpoint))
    return (lambda name: name) if isinstance(adapter, str) else adapter.stored_name


def write_card(
    folder: Path, checkpoint: Path, manifest: dict, config: dict, export: dict | None = None
) -> None:
    """The export's model card (the checkpoint's, with loading instructions for the format's clients) and the
    source model's generation_config.json when the checkpoint carries one."""
    import yaml

    from qtool.checkpoint.card import model_card
    from qtool.checkpoint.writer import source_generation_config

    recipe_file = checkpoint / "recipe.yaml"
    recipe = yaml.safe_load(recipe_file.read_text()) if recipe_file.is_file() else None
    card = model_card(
        manifest, config, recipe, export=export or {"format": FORMAT, "library": "transformers"}
    )
    (folder / "README.md").write_text(card)
    generation = source_generation_config(str(checkpoint))
    if generation is not None:
        generation.save_pretrained(str(folder))


def open_source(checkpoint: Path, output: Path, max_shard_size: str, overwrite: bool) -> tuple:
    """What both export formats check and read before writing: (shard bytes, the inputs the output must not
    touch, the manifest, config.json). The output is checked first: it must never be the checkpoint it exports,
    which --overwrite would replace."""
    from qtool.checkpoint.loader import read_config, read_manifest, verify_files
    from qtool.output import check_output
    from qtool.units import parse_size

    try:
        shard_bytes = parse_size(max_shard_size)
    except ValueError:
        raise UsageError(f"--max-shard-size: found {max_shard_size!r}, expected a size such as 5GB") from None
    inputs = {"checkpoint": checkpoint}
    check_output(output, directory=True, overwrite=overwrite, inputs=inputs)
    manifest = read_manifest(checkpoint)
    verify_files(checkpoint, manifest)
    return shard_bytes, inputs, manifest, read_config(checkpoint)


def pop_layer_fields(tensors: dict[str, torch.Tensor], name: str) -> dict[str, torch.Tensor]:
    """Linear `name`'s own stored fields (its bias aside), taken out of `tensors` by field name."""
    prefix = f"{name}."
    return {
        k[len(prefix) :]: tensors.pop(k)
        for k in list(tensors)
        if k.startswith(prefix) and "." not in k[len(prefix) :] and k != f"{name}.bias"
    }


def run_export(
    checkpoint: Path, output: Path, fmt: str, max_shard_size: str, overwrite: bool, reporter: Reporter
) -> dict:
    from huggingface_hub import save_torch_state_dict

    from qtool.checkpoint.loader import load_tokenizer, read_tensors
    from qtool.output import folder_bytes, reserve_output

    if fmt != FORMAT:
        raise UsageError(f"--format: found {fmt!r}, expected {FORMAT!r} or 'gptq'")
    checkpoint = Path(checkpoint)
    shard_bytes, inputs, manifest, config = open_source(checkpoint, output, max_shard_size, overwrite)
    linears = model_linears(checkpoint)
    schemes = plan(checkpoint, config, linears)
    tokenizer = load_tokenizer(checkpoint)
    layers = config["quantization_config"]["layers"]

    with reserve_output(
        output,
        directory=True,
        overwrite=overwrite,
        needs_bytes=folder_bytes(checkpoint),
        log=reporter.log,
        inputs=inputs,
    ) as reserved:
        tensors = read_tensors(checkpoint)
        built = {name: s.scheme(["Linear"]) for name, s in schemes.items()}
        out: dict[str, torch.Tensor] = {}
        for name in schemes:
            prefix = f"{name}."
            fields = pop_layer_fields(tensors, name)
            weight, qparams = layer_state(name, layers[name], fields, SCALE_DTYPE)
            for field, t in compress_layer(name, weight, qparams, built[name]).items():
                out[f"{prefix}{field}"] = _own_storage(t)
        out.update(tensors)  # biases and every tensor left in floating point, as stored
        # Under the names the family's hub checkpoints use (Mixtral's experts), which plain clients convert.
        rename = stored_names(checkpoint)
        out = {rename(k): v for k, v in out.items()}

        raw = {k: v for k, v in config.items() if k != "quantization_config"}
        qconfig = quantization_config(
            {rename(n): s for n, s in schemes.items()}, [rename(n) for n in linears if n not in schemes]
        )
        save_torch_state_dict(out, str(reserved.tmp), max_shard_size=shard_bytes, metadata={"format": "pt"})
        from compressed_tensors.compressors import ModelCompressor

        from qtool.checkpoint.manifest import dumps

        (reserved.tmp / "config.json").write_text(dumps(raw))
        ModelCompressor(quantization_config=qconfig).update_config(str(reserved.tmp))
        tokenizer.save_pretrained(str(reserved.tmp))
        write_card(reserved.tmp, checkpoint, manifest, config)
        write_record(reserved.tmp, checkpoint, manifest)
        reserved.publish()
    counts: dict[str, int] = {}
    for s in schemes.values():
        counts[s.describe()] = counts.get(s.describe(), 0) + 1
    reporter.log(f"wrote {output}")
    return {
        "checkpoint": str(checkpoint),
        "output": str(output),
        "format": FORMAT,
        "compression_format": qconfig.format,
        "quantized_layers": len(schemes),
        "schemes": counts,
        "ignored": qconfig.ignore,
    }
