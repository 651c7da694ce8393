"""Stage `vq`: vector-quantized weights in the `vq` layout (formats/vq.md), the codebooks VQ-LLM's kernels read
(Liu et al., "VQ-LLM", Sec. II-A, Table II), produced as the cited methods produce them: GPTVQ's Hessian-weighted
k-means inside GPTQ's column loop with error feedback across vector columns, per tensor or per tile (codebook
switching), and AQLM's additive codebooks initialised by greedy residual k-means, with its beam search over codes
as an option. Entries are re-indexed by access frequency for the codebook cache.

Presets: `gptvq-2` (vectors of 4, 256 entries, one codebook per 256x256 tile: 2 index bits per weight) and
`aqlm-3` (vectors of 8, 4096 entries, two additive codebooks per tensor: 3 index bits per weight). Options written
in the recipe override the preset's.

`finetune_steps` (off by default) is AQLM's codebook update (GPTVQ's codebook update): once a block's linears are
quantized, their codebooks are trained by Adam, codes fixed, so that the block's output matches the float block's
on the calibration inputs (qtool/quant/blockwise.py, one block at a time), then rounded to float16.

Not implemented: AQLM's alternation of code and codebook updates within a layer, its per-channel scales."""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Literal

import torch

from qtool.calibration.stats import LinearStats
from qtool.layouts.vq.layout import CODEBOOK_BUDGET_BYTES, MAX_INDEX_BITS, VQWeight, is_power_of_two
from qtool.options import INT_LIMIT, option
from qtool.quant.blockwise import tune_block
from qtool.quant.vq import TunableCodebooks, vq_gptq
from qtool.stages.base import HessianStage, QuantResult, block_size_option, damp_option, sequential_option

PRESETS: dict[str, dict] = {
    "gptvq-2": {
        "vector_size": 4,
        "entries": 256,
        "residuals": 1,
        "scope": "tile",
        "tile_rows": 256,
        "tile_cols": 256,
    },
    "aqlm-3": {
        "vector_size": 8,
        "entries": 4096,
        "residuals": 2,
        "scope": "tensor",
        "tile_rows": None,
        "tile_cols": None,
    },
}


@dataclass
class VQOptions:
    preset: Literal["gptvq-2", "aqlm-3"] | None = option(
        "gptvq-2", help="gptvq-2 or aqlm-3: the defaults of the options below that the recipe leaves out"
    )
    vector_size: int | None = option(None, min=1, max=16, help="x: input columns per vector")
    entries: int | None = option(
        None,
        min=1,
        max=1 << MAX_INDEX_BITS,
        help="entries per codebook, a power of two (index bits y = log2 entries)",
    )
    residuals: int | None = option(None, min=1, max=8, help="z: additive codebooks per scope")
    scope: Literal["tensor", "tile"] | None = option(None, help="one codebook set per tensor, or per tile")
    tile_rows: int | None = option(None, min=1, help="scope tile: output rows per tile")
    tile_cols: int | None = option(
        None, min=1, help="scope tile: input columns per tile (a multiple of vector_size)"
    )
    kmeans_iters: int = option(20, min=1, max=1000, help="Lloyd iterations per codebook")
    beam: int = option(
        1, min=1, max=64, help="beam width of the code search over residual codebooks (1: greedy)"
    )
    reindex: bool = option(
        True, help="sort every codebook's entries by access frequency (the codebook cache)"
    )
    damp: float = damp_option()
    block_size: int = block_size_option()
    seed: int = option(
        0, min=0, max=INT_LIMIT, help="seed of the k-means initialisation (mixed with each layer's name)"
    )
    sequential: bool = sequential_option()
    finetune_steps: int = option(
        0,
        min=0,
        max=100000,
        help="codebook fine-tuning: Adam steps per block on the "
        "codebooks (codes fixed) against the float block's "
        "output; 0 is off",
    )
    finetune_lr: float = option(
        0.02,
        min=1e-6,
        max=1.0,
        help="codebook fine-tuning: Adam learning rate, relative "
        "to the RMS of each layer's entries (an entry moves "
        "by about lr x RMS per step)",
    )
    finetune_samples: int = option(
        1, min=1, max=4096, help="codebook fine-tuning: calibration windows per step"
    )

    def validate(self) -> tuple[str, str] | None:
        # The preset fills what the recipe left out, so the recipe as run shows every value used.
        base = PRESETS[self.preset] if self.preset else {}
        explicit_tiles = self.tile_rows is not None or self.tile_cols is not None
        for key, value in base.items():
            if getattr(self, key) is None and not (key.startswith("tile_") and explicit_tiles):
                setattr(self, key, value)
        for key in ("vector_size", "entries", "residuals", "scope"):
            if getattr(self, key) is None:
                return key, "missing; expected a value, or a preset (gptvq-2, aqlm-3) that sets it"
        if not is_power_of_two(self.entries):
            return "entries", (
                f"found {self.entries}; expected a power of two >= 2 (indices are stored at "
                f"log2(entries) bits)"
            )
        if self.scope == "tensor" and explicit_tiles and (self.tile_rows or self.tile_cols):
            return "scope", "found 'tensor' with tile_rows/tile_cols; expected scope tile, or no tile sizes"
        if self.scope == "tensor":
            self.tile_rows = self.tile_cols = None
        elif self.tile_rows is None and self.tile_cols is None:
            return "scope", "found 'tile' without tile_rows or tile_cols; expected at least one of them"
        if self.tile_cols is not None and self.tile_cols % self.vector_size:
            return "tile_cols", (
                f"found {self.tile_cols}; expected a multiple of vector_size {self.vector_size} "
                f"(a vector never straddles two tiles)"
            )
        nbytes = self.residuals * self.entries * self.vector_size * 2
        if nbytes > CODEBOOK_BUDGET_BYTES:
            return "entries", (
                f"found {self.entries} with vector_size {self.vector_size} and residuals "
                f"{self.residuals}: one scope's float16 codebooks take {nbytes // 1024} KiB, more "
                f"than the {CODEBOOK_BUDGET_BYTES // 1024} KiB of shared memory one thread block "
                f"can hold on an H100 (the kernels keep a scope's warm entries there); expected "
                f"residuals·entries·vector_size·2 bytes at most that"
            )
        return None


class VQStage(HessianStage):
    name = "vq"
    options_cls = VQOptions
    layout_cls = VQWeight
    help = "vector quantization: Hessian-weighted (residual) k-means codebooks with GPTQ error feedback"

    def layer_problem(self, n: int, k: int) -> tuple[str, str] | None:
        """(key, message) for a linear of `n` x `k` this stage cannot quantize, else None."""
        o: VQOptions = self.options
        d = o.vector_size
        if k % d:
            return "vector_size", f"found {d}, but {{}} has in_features {k}; expected a divisor of it"
        rows = [min(o.tile_rows, n - s) for s in range(0, n, o.tile_rows)] if o.tile_rows else [n]
        cols = [min(o.tile_cols, k - s) for s in range(0, k, o.tile_cols)] if o.tile_cols else [k]
        least = min(rows) * min(cols) // d
        if least < o.entries:
            scope = "tensor" if o.scope == "tensor" else f"smallest tile ({min(rows)}x{min(cols)})"
            return "entries", (
                f"found {o.entries}, but {{}} has only {least} vectors of {d} in its {scope}, too "
                f"few to fit a codebook of {o.entries} entries; expected at most {least}"
            )
        return None

    def check_config(self, config, where: str) -> None:
        self.check_layers(config, where)

    def distributed_problem(self) -> tuple[str, str] | None:
        if self.options.finetune_steps > 0:
            return "finetune_steps", (
                f"found {self.options.finetune_steps}: vq fine-tunes each block's codebooks on "
                f"the windows of one process; expected 0 with several processes (or one "
                f"process)"
            )
        return None

    def finetunes(self) -> bool:
        return self.options.finetune_steps > 0

    def finetune_block(
        self,
        block,
        layouts: dict[str, VQWeight],
        originals: dict[str, torch.Tensor],
        inputs: list[torch.Tensor],
        kwargs: dict,
        targets: list[torch.Tensor],
    ) -> tuple[dict[str, VQWeight], dict]:
        o: VQOptions = self.options
        tunables = {rel: TunableCodebooks(layout, inputs[0].device) for rel, layout in layouts.items()}
        res = tune_block(
            block,
            {f"{rel}.weight": t for rel, t in tunables.items()},
            [t.delta for t in tunables.values()],
            inputs,
            kwargs,
            targets,
            steps=o.finetune_steps,
            lr=o.finetune_lr,
            samples=o.finetune_samples,
        )
        tuned = {rel: t.layout() for rel, t in tunables.items()} if res.kept else layouts
        return tuned, {
            "finetune": {
                "error_before": round(res.error_before, 8),
                "error_after": round(res.error_after, 8),
                "kept": res.kept,
            }
        }

    def quantize(self, name: str, weight: torch.Tensor, stats: LinearStats | None) -> QuantResult:
        o: VQOptions = self.options
        if stats is None or not stats.has_hessian:
            raise RuntimeError(f"vq needs the Hessian of {name}")
        self.refuse_layer(name, *weight.shape)
        seed = (o.seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 63)
        out = vq_gptq(
            weight.float().cpu(),
            stats.hessian().cpu(),
            o.vector_size,
            o.entries,
            o.residuals,
            tile_rows=o.tile_rows,
            tile_cols=o.tile_cols,
            iters=o.kmeans_iters,
            beam=o.beam,
            damp=o.damp,
            block_size=o.block_size,
            seed=seed,
        )
        packed = VQWeight.from_codes(out.codes, out.codebooks, o.tile_rows, o.tile_cols, reindex=o.reindex)
        return QuantResult(packed, packed.dequantize(torch.float32).to(weight.device))
