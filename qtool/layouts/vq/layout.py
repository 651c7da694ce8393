"""The `vq` layout (formats/vq.md): VQ-LLM's VQ<x, y, z> weights. Each output row is cut into vectors of `d`
consecutive input columns; a vector is the sum of one entry from each of `z` additive codebooks of `E = 2^b`
float16 entries, selected by `b`-bit indices. Codebooks belong to a scope: the whole tensor, or one tile of
`tile_rows` x `tile_cols` weights (GPTVQ's codebook switching; ragged edge tiles).

Entries are re-indexed offline by access frequency (VQ-LLM Sec. V-B): entry 0 of every codebook is its most used,
so a kernel's codebook cache places entries by index alone (registers, then shared memory, then global memory);
`entry_tiers` stores the descriptive hot/warm boundaries derived from the counts."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qtool.errors import CheckpointError
from qtool.layouts.base import StoredLayout, posint
from qtool.layouts.bitpack import pack_codes, packed_words, unpack_codes

FORMAT = "vq"
FIELDS = ("indices", "codebooks", "entry_tiers")
MAX_INDEX_BITS = 16
# Shared memory one thread block may hold on an H100 (227 KiB): one scope's codebooks must fit it, so the
# all-in-shared baseline (SC) and the shared tier of the codebook cache can hold a whole scope.
CODEBOOK_BUDGET_BYTES = 227 * 1024


def index_bits(entries: int) -> int:
    return entries.bit_length() - 1


def is_power_of_two(v: int) -> bool:
    return v >= 2 and v & (v - 1) == 0


def tile_counts(
    out_features: int, in_features: int, tile_rows: int | None, tile_cols: int | None
) -> tuple[int, int]:
    """(row tiles, column tiles); None: one tile along that axis."""

    def count(size: int, tile: int | None) -> int:
        return 1 if tile is None else -(-size // tile)

    return count(out_features, tile_rows), count(in_features, tile_cols)


def shapes_for(
    out_features: int,
    in_features: int,
    vector_size: int,
    entries: int,
    residuals: int,
    tile_rows: int | None,
    tile_cols: int | None,
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    n, k, d, z = out_features, in_features, vector_size, residuals
    r, c = tile_counts(n, k, tile_rows, tile_cols)
    return {
        "indices": ((z, n, packed_words(k // d, index_bits(entries))), torch.int32),
        "codebooks": ((r, c, z, entries, d), torch.float16),
        "entry_tiers": ((r, c, z, 2), torch.int32),
    }


def bits_for(
    out_features: int,
    in_features: int,
    vector_size: int,
    entries: int,
    residuals: int,
    tile_rows: int | None,
    tile_cols: int | None,
) -> int:
    """Stored bits of one layer: indices (row padding included), codebooks and tier boundaries."""
    total = 0
    for shape, dtype in shapes_for(
        out_features, in_features, vector_size, entries, residuals, tile_rows, tile_cols
    ).values():
        numel = 1
        for s in shape:
            numel *= s
        total += numel * torch.empty((), dtype=dtype).element_size() * 8
    return total


def tier_bounds(counts: torch.Tensor) -> tuple[int, int]:
    """(hot, warm) boundaries of one codebook from its entries' access counts in descending order: hot entries are
    used more than mean + 3·std (VQ-LLM Fig. 8's measure), warm ones more than the mean, the rest are cold."""
    c = counts.to(torch.float64)
    mu, sigma = c.mean(), c.std(unbiased=False)
    return int((c > mu + 3 * sigma).sum()), int((c > mu).sum())


def _tile_index(size: int, tile: int | None, device=None) -> torch.Tensor:
    pos = torch.arange(size, device=device)
    return torch.zeros_like(pos) if tile is None else pos // tile


def scheme_problem(cfg: dict) -> tuple[str, object, str] | None:
    """(key, found, expected) for layer parameters outside the layout's domain, else None."""
    for key in ("in_features", "out_features", "vector_size", "residuals"):
        if not posint(cfg.get(key)):
            return key, cfg.get(key), "a positive integer"
    k, d = cfg["in_features"], cfg["vector_size"]
    if k % d:
        return "vector_size", d, f"a divisor of in_features {k}"
    e = cfg.get("entries")
    if not posint(e) or not is_power_of_two(e) or index_bits(e) > MAX_INDEX_BITS:
        return "entries", e, f"a power of two in 2..{1 << MAX_INDEX_BITS}"
    if cfg.get("index_bits") != index_bits(e):
        return "index_bits", cfg.get("index_bits"), f"{index_bits(e)} (log2 of entries {e})"
    for key in ("tile_rows", "tile_cols"):
        t = cfg.get(key)
        if t is not None and not posint(t):
            return key, t, "a positive integer or null"
    if cfg.get("tile_cols") is not None and cfg["tile_cols"] % d:
        return "tile_cols", cfg["tile_cols"], f"a multiple of vector_size {d}"
    if not isinstance(cfg.get("reindexed"), bool):
        return "reindexed", cfg.get("reindexed"), "true or false"
    return None


@dataclass
class VQWeight(StoredLayout):
    FORMAT = FORMAT
    FIELDS = FIELDS
    scheme_problem = staticmethod(scheme_problem)

    vector_size: int  # d: input columns per vector
    entries: int  # E = 2^b entries per codebook
    residuals: int  # z: additive codebooks per scope
    tile_rows: int | None  # rows per codebook scope (None: all)
    tile_cols: int | None  # input columns per codebook scope (None: all)
    reindexed: bool  # entries sorted by access frequency (entry_tiers meaningful)
    in_features: int  # K
    out_features: int  # N
    indices: torch.Tensor  # int32 [z, N, words(K/d, b)]
    codebooks: torch.Tensor  # float16 [R, C, z, E, d]
    entry_tiers: torch.Tensor  # int32 [R, C, z, 2]: hot and warm boundaries

    # ---- construction -------------------------------------------------------------------------------------

    @classmethod
    def from_codes(
        cls,
        codes: torch.Tensor,
        codebooks: torch.Tensor,
        tile_rows: int | None,
        tile_cols: int | None,
        reindex: bool = True,
    ) -> VQWeight:
        """Build from the codes [z, N, K/d] and the codebooks [R, C, z, E, d] (any float dtype; rounded to float16),
        re-indexing every codebook by descending access frequency when `reindex` (ties: the lower index first)."""
        codes = codes.to(torch.int64).cpu().clone()
        books = codebooks.to(torch.float16).cpu().clone()
        r_tiles, c_tiles, z, e, d = books.shape
        _, n, v = codes.shape
        k = v * d
        if (r_tiles, c_tiles) != tile_counts(n, k, tile_rows, tile_cols):
            raise ValueError(
                f"vq layout: {r_tiles}x{c_tiles} codebook scopes for {n}x{k} weights and tiles "
                f"{tile_rows}x{tile_cols}"
            )
        tiers = torch.zeros(r_tiles, c_tiles, z, 2, dtype=torch.int32)
        if reindex:
            counts = entry_counts(codes, e, d, tile_rows, tile_cols)
            for ri in range(r_tiles):
                for ci in range(c_tiles):
                    for r in range(z):
                        order = torch.argsort(-counts[ri, ci, r], stable=True)
                        books[ri, ci, r] = books[ri, ci, r][order]
                        new = torch.empty_like(order)
                        new[order] = torch.arange(e)
                        sel = _scope_mask(n, v, d, tile_rows, tile_cols, ri, ci)
                        codes[r][sel] = new[codes[r][sel]]
                        tiers[ri, ci, r] = torch.tensor(tier_bounds(counts[ri, ci, r][order]))
        b = index_bits(e)
        return cls(
            d,
            e,
            z,
            tile_rows,
            tile_cols,
            reindex,
            k,
            n,
            pack_codes(codes.reshape(z * n, v), b).reshape(z, n, -1),
            books.contiguous(),
            tiers,
        )

    # ---- reading ------------------------------------------------------------------------------------------

    @property
    def index_bits(self) -> int:
        return index_bits(self.entries)

    def codes(self) -> torch.Tensor:
        """The indices [z, N, K/d] (int64)."""
        z, n, v = self.residuals, self.out_features, self.in_features // self.vector_size
        return unpack_codes(self.indices.reshape(z * n, -1), self.index_bits, v).reshape(z, n, v)

    def scope_of(self, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(row tile of every output row [N], column tile of every vector [K/d])."""
        d = self.vector_size
        rt = _tile_index(self.out_features, self.tile_rows, device)
        ct = _tile_index(self.in_features, self.tile_cols, device)[::d]
        return rt, ct

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W [N, K]: every vector is the sum of its entries, in float32 in codebook order, cast to `dtype`."""
        codes = self.codes()
        rt, ct = self.scope_of()
        books = self.codebooks.to(torch.float32)
        w = sum(books[rt[:, None], ct[None, :], r, codes[r]] for r in range(self.residuals))
        return w.reshape(self.out_features, self.in_features).to(dtype)

    # ---- storage ------------------------------------------------------------------------------------------

    def config(self) -> dict:
        return {
            "format": FORMAT,
            "vector_size": self.vector_size,
            "entries": self.entries,
            "index_bits": self.index_bits,
            "residuals": self.residuals,
            "tile_rows": self.tile_rows,
            "tile_cols": self.tile_cols,
            "reindexed": self.reindexed,
            "in_features": self.in_features,
            "out_features": self.out_features,
        }

    @classmethod
    def describe(cls, cfg: dict) -> str:
        """VQ-LLM's notation (y written as index bits) and the codebook scope."""
        scope = (
            "tensor"
            if cfg.get("tile_rows") is None and cfg.get("tile_cols") is None
            else f"tile {cfg.get('tile_rows') or 'N'}x{cfg.get('tile_cols') or 'K'}"
        )
        return f"vq VQ<{cfg['vector_size']},{cfg['index_bits']},{cfg['residuals']}> {scope}"

    def notation(self) -> str:
        """VQ-LLM's VQ<x, y, z>, with y written as index bits as the paper's examples do."""
        return f"VQ<{self.vector_size},{self.index_bits},{self.residuals}>"

    def bits_report(self) -> dict[str, float]:
        """Bits per weight of this layer: as stored (indices, codebooks and tiers), and the indices alone (the
        paper's z·y/x)."""
        nk = self.in_features * self.out_features
        return {
            "stored": self.stored_bits() / nk,
            "indices": self.residuals * self.index_bits / self.vector_size,
        }

    @staticmethod
    def expected_shapes(cfg: dict) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return shapes_for(
            cfg["out_features"],
            cfg["in_features"],
            cfg["vector_size"],
            cfg["entries"],
            cfg["residuals"],
            cfg.get("tile_rows"),
            cfg.get("tile_cols"),
        )

    @classmethod
    def from_tensors(cls, name: str, cfg: dict, tensors: dict[str, torch.Tensor]) -> VQWeight:
        """Validate stored tensors against the layer config; errors name the tensor."""
        layout = cls.checked(name, cfg, tensors)
        if not bool(torch.isfinite(layout.codebooks).all()):
            raise CheckpointError(
                f"tensor {name}.codebooks: found non-finite entries, expected finite float16"
            )
        v = layout.in_features // layout.vector_size
        words = (
            layout.indices.reshape(layout.residuals * layout.out_features, -1).to(torch.int64) & 0xFFFFFFFF
        )
        spare = words.shape[1] * 32 - v * layout.index_bits
        if spare and bool((words[:, -1] >> (32 - spare)).any()):
            raise CheckpointError(
                f"tensor {name}.indices: found nonzero padding bits after the last index of a "
                f"row, expected zeros"
            )
        tiers = layout.entry_tiers
        if not layout.reindexed:
            if bool(tiers.any()):
                raise CheckpointError(
                    f"tensor {name}.entry_tiers: found nonzero boundaries without re-indexed "
                    f"entries, expected zeros"
                )
            return layout
        # On the CPU: tensors may be loaded straight onto a GPU, the tile indices are built on the CPU.
        counts = entry_counts(
            layout.codes().cpu(), layout.entries, layout.vector_size, layout.tile_rows, layout.tile_cols
        )
        if bool((counts[..., 1:] > counts[..., :-1]).any()):
            raise CheckpointError(
                f"tensor {name}.indices: entries are not in descending order of use, expected "
                f"re-indexed codebooks (reindexed: true)"
            )
        expect = torch.tensor([tier_bounds(c) for c in counts.reshape(-1, layout.entries)], dtype=torch.int32)
        if not torch.equal(tiers.reshape(-1, 2).cpu(), expect):
            raise CheckpointError(
                f"tensor {name}.entry_tiers: found boundaries that the indices' access counts do "
                f"not give, expected (hot, warm) = (count > mean + 3 std, count > mean)"
            )
        return layout


def _scope_mask(
    n: int, v: int, d: int, tile_rows: int | None, tile_cols: int | None, ri: int, ci: int
) -> torch.Tensor:
    rows = _tile_index(n, tile_rows) == ri
    cols = _tile_index(v * d, tile_cols)[::d] == ci
    return rows[:, None] & cols[None, :]


def entry_counts(
    codes: torch.Tensor, entries: int, vector_size: int, tile_rows: int | None, tile_cols: int | None
) -> torch.Tensor:
    """How often each entry of each codebook is used [R, C, z, E] (int64), from the codes [z, N, K/d]."""
    z, n, v = codes.shape
    rt = _tile_index(n, tile_rows)
    ct = _tile_index(v * vector_size, tile_cols)[::vector_size]
    r_tiles, c_tiles = int(rt[-1]) + 1, int(ct[-1]) + 1
    scope = (rt[:, None] * c_tiles + ct[None, :]).reshape(-1)  # [N·V]
    out = torch.empty(z, r_tiles * c_tiles, entries, dtype=torch.int64)
    for r in range(z):
        flat = scope * entries + codes[r].reshape(-1)
        out[r] = torch.bincount(flat, minlength=r_tiles * c_tiles * entries).reshape(-1, entries)
    return out.reshape(z, r_tiles, c_tiles, entries).permute(1, 2, 0, 3).contiguous()
