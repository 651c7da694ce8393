"""`qtool export --format gptq` (formats/gptq.md): a checkpoint in the GPTQ layout that AutoGPTQ wrote and that
GPTQModel, transformers' GPTQ integration and vLLM read (`qweight`, `qzeros`, `scales`, `g_idx`).

The layout holds exactly what qtool's `grouped_int` layer holds when its widths are whole packing words, so the
tensors are qtool's own rearranged, never requantized; the export decodes what it wrote and refuses to publish
unless every weight comes back bit for bit."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from qtool.console import Reporter
from qtool.errors import CheckpointError, UsageError

FORMAT = "gptq"
# Bit widths whose codes fill an int32 word exactly; GPTQ's 3-bit layout packs across words in another order.
BITS = (2, 4, 8)
# GPTQ clients size `qweight` as in_features // 32 * bits words and `qzeros` as out_features // 32 * bits.
WIDTH_MULTIPLE = 32


@dataclass(frozen=True)
class GptqScheme:
    bits: int
    group_size: int | None  # None: one group per output row (GPTQ's group_size -1)
    symmetric: bool

    def describe(self) -> str:
        g = f"g{self.group_size}" if self.group_size else "per channel"
        return f"W{self.bits} {'sym' if self.symmetric else 'asym'} {g}, A16"

    @property
    def checkpoint_format(self) -> str:
        # GPTQ's first format stores each zero point minus one, so an asymmetric group whose zero point is 0 (its
        # weights all at or above 0) has no code there; gptq_v2 stores zero points as they are. Symmetric zero
        # points (2^(bits-1)) fit either, and the first format is the one every client reads.
        return "gptq" if self.symmetric else "gptq_v2"

    def quantization_config(self) -> dict:
        from qtool.version import __version__

        # desc_act false: qtool's act-order runs with static groups, so each group is a run of consecutive columns
        # and g_idx is k // group_size, which is what desc_act false means to every client.
        return {
            "quant_method": "gptq",
            "checkpoint_format": self.checkpoint_format,
            "bits": self.bits,
            "group_size": self.group_size or -1,
            "sym": self.symmetric,
            "desc_act": False,
            "lm_head": False,
            "meta": {"quantizer": [f"qtool:{__version__}"]},
        }


def _refuse(at: str, found: str) -> UsageError:
    return UsageError(
        f"{at}: {found}; GPTQ expects weight-only integer layers (grouped_int, {'/'.join(map(str, BITS))} bits, "
        f"whole groups, widths multiples of {WIDTH_MULTIPLE}) with one scheme for the whole model"
    )


def layer_scheme(name: str, cfg: dict, where: str) -> GptqScheme:
    at = f"{where}: layer {name}"
    fmt = cfg.get("format")
    if fmt != "grouped_int":
        raise _refuse(at, f"{fmt} layout (activation quantization, outliers or codebooks)")
    bits, k, n, g = cfg["bits"], cfg["in_features"], cfg["out_features"], cfg.get("group_size")
    if bits not in BITS:
        raise _refuse(at, f"{bits}-bit codes")
    if k % WIDTH_MULTIPLE or n % WIDTH_MULTIPLE:
        raise _refuse(at, f"in_features {k}, out_features {n}")
    if g is not None and k % g:
        raise _refuse(at, f"in_features {k} is not a multiple of group_size {g} (a partial last group)")
    return GptqScheme(bits=bits, group_size=g, symmetric=bool(cfg["symmetric"]))


def plan(checkpoint: Path, config: dict, linears: list[str]) -> tuple[GptqScheme, list[str], list[str]]:
    """(the model's one scheme, the quantized linears in model order, the linears left in floating point), or a
    one-line refusal naming the first layer (or model scheme) the format cannot hold."""
    from qtool.kv_cache.schemes import RESERVED

    where = str(checkpoint / "config.json")
    qcfg = config["quantization_config"]
    layers = qcfg.get("layers", {})
    for key in sorted(qcfg):
        if key not in RESERVED:
            raise _refuse(f"{where}: quantization_config.{key}", "a model scheme (e.g. a quantized KV cache)")
    order = [n for n in linears if n in layers] + sorted(set(layers) - set(linears))
    schemes = {name: layer_scheme(name, layers[name], where) for name in order}
    first = next(iter(schemes.values()))
    for name, s in schemes.items():
        if s != first:
            raise _refuse(f"{where}: layer {name}", f"{s.describe()} where {order[0]} is {first.describe()}")
    ignored = [n for n in linears if n not in layers]
    for name in order + ignored:
        if ".experts." in name:
            raise _refuse(f"{where}: layer {name}", "a mixture-of-experts expert")
    for name in ignored:
        # GPTQ clients replace every linear of the decoder blocks (numbered modules) with a quantized one.
        if re.search(r"\.\d+\.", name):
            raise _refuse(f"{where}: layer {name}", "a linear of a decoder block left in floating point")
    return first, order, ignored


def layer_tensors(name: str, cfg: dict, fields: dict[str, torch.Tensor], scheme: GptqScheme) -> dict:
    """The layer's GPTQ tensors from its stored grouped_int tensors (validated by the layout), checked by decoding
    them back to qtool's weight."""
    from qtool.layouts.bitpack import pack_codes
    from qtool.layouts.registry import layout_class

    layout = layout_class(cfg["format"]).from_tensors(name, cfg, fields)
    bits, n = layout.spec.bits, layout.out_features
    groups = layout.spec.num_groups(layout.in_features)
    if layout.zeros is None:
        zeros = torch.full((n, groups), layout.spec.sym_zero, dtype=torch.int64)
    else:
        zeros = layout.zeros.to(torch.int64)
    offset = zero_offset(scheme.checkpoint_format)
    # With whole words per column (in_features a multiple of 32), qtool's row-major bit stream of one output row
    # is, word for word, GPTQ's column of qweight: the same codes, 32/bits per word, the lowest column first.
    out = {
        "qweight": layout.qweight.t().contiguous(),
        "qzeros": pack_codes((zeros - offset).t().contiguous(), bits),
        "scales": layout.scales.t().contiguous(),
        "g_idx": layout.group_index().to(torch.int32),
    }
    if not torch.equal(dequantize(out, bits, offset), layout.dequantize(torch.float32)):
        raise CheckpointError(f"layer {name}: the GPTQ tensors do not decode to the checkpoint's weight")
    return out


def zero_offset(checkpoint_format: str) -> int:
    """What the format subtracts from a zero point before storing it."""
    return 1 if checkpoint_format == "gptq" else 0


def dequantize(tensors: dict[str, torch.Tensor], bits: int, offset: int) -> torch.Tensor:
    """A GPTQ layer's weight [out, in] in float32: `(q - (qzeros + offset)) * scales`, per input column's group."""
    from qtool.layouts.bitpack import unpack_codes

    qweight, qzeros, scales, g_idx = (tensors[k] for k in ("qweight", "qzeros", "scales", "g_idx"))
    k, n = qweight.shape[0] * 32 // bits, qweight.shape[1]
    codes = unpack_codes(qweight.t().contiguous(), bits, k)
    zeros = unpack_codes(qzeros, bits, n) + offset
    idx = g_idx.to(torch.int64)
    return (codes.to(torch.float32) - zeros.t()[:, idx].to(torch.float32)) * scales.t()[:, idx].to(
        torch.float32
    )


def run_export(
    checkpoint: Path, output: Path, max_shard_size: str, overwrite: bool, reporter: Reporter
) -> dict:
    from huggingface_hub import save_torch_state_dict

    from qtool.checkpoint.loader import load_tokenizer, read_tensors
    from qtool.checkpoint.manifest import dumps
    from qtool.export.compressed_tensors import (
        model_linears,
        open_source,
        pop_layer_fields,
        write_card,
        write_record,
    )
    from qtool.output import folder_bytes, reserve_output

    checkpoint = Path(checkpoint)
    shard_bytes, inputs, manifest, config = open_source(checkpoint, output, max_shard_size, overwrite)
    scheme, quantized, ignored = plan(checkpoint, config, model_linears(checkpoint))
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
        out: dict[str, torch.Tensor] = {}
        for name in quantized:
            prefix = f"{name}."
            fields = pop_layer_fields(tensors, name)
            for field, t in layer_tensors(name, layers[name], fields, scheme).items():
                out[f"{prefix}{field}"] = t
        out.update(tensors)  # biases and every tensor left in floating point, as stored
        save_torch_state_dict(out, str(reserved.tmp), max_shard_size=shard_bytes, metadata={"format": "pt"})
        qconfig = scheme.quantization_config()
        raw = {k: v for k, v in config.items() if k != "quantization_config"}
        (reserved.tmp / "config.json").write_text(dumps({**raw, "quantization_config": qconfig}))
        # AutoGPTQ and GPTQModel also read the scheme from quantize_config.json.
        (reserved.tmp / "quantize_config.json").write_text(dumps(qconfig))
        tokenizer.save_pretrained(str(reserved.tmp))
        write_card(
            reserved.tmp,
            checkpoint,
            manifest,
            config,
            {
                "format": FORMAT,
                "library": "transformers",
                "needs": "gptqmodel",
                "vllm": " (symmetric 4- and 8-bit; vLLM reads no gptq_v2)",
            },
        )
        write_record(reserved.tmp, checkpoint, manifest, FORMAT)
        reserved.publish()
    reporter.log(f"wrote {output}")
    return {
        "checkpoint": str(checkpoint),
        "output": str(output),
        "format": FORMAT,
        "compression_format": scheme.checkpoint_format,
        "quantized_layers": len(quantized),
        "schemes": {scheme.describe(): len(quantized)},
        "ignored": ignored,
    }
