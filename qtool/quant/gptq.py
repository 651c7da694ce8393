"""GPTQ (Frantar et al., 2022): quantize a weight matrix column by column, folding each column's rounding error
into the columns not yet quantized through the inverse Hessian, in lazy batches of `block_size` columns."""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

from qtool.quant.clip import clipped_grid_params
from qtool.quant.grid import GridSpec, grid_params


class ColumnGrid(Protocol):
    """A grid that is not the affine one of a GridSpec (e.g. the two-level grid of quant/progressive.py): it picks
    each group's parameters and rounds columns itself; GPTQ only feeds back the errors."""

    def group_params(self, w: torch.Tensor, h_block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-row (scale, zero) of the group whose (error-updated) columns are `w` [rows, cols]."""
        ...

    def quantize_column(
        self, w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes, the weights they dequantize to) of one column `w` [rows] with its group's parameters."""
        ...


def inverse_hessian_factor(h: torch.Tensor) -> torch.Tensor:
    """The upper Cholesky factor U of H⁻¹ (H⁻¹ = UᵀU), which the column walk reads row by row.

    With J the reversal of rows and columns, J H J = L Lᵀ gives H⁻¹ = (J L⁻¹ J)ᵀ (J L⁻¹ J), and J L⁻¹ J is upper
    triangular with a positive diagonal: U, by the uniqueness of the factor. One factorization and one triangular
    inverse instead of factorize, invert, factorize again: on an H200 at 11008 columns 57.5 ms instead of 112.8,
    which was most of a down_proj solve, in every rank of a run over several GPUs."""
    lower = torch.linalg.cholesky(torch.flip(h, (0, 1)))
    eye = torch.eye(h.shape[0], dtype=h.dtype, device=h.device)
    return torch.flip(torch.linalg.solve_triangular(lower, eye, upper=False), (0, 1))


def _group_params(
    w: torch.Tensor,
    spec: GridSpec,
    ratios: list[float] | None,
    h_block: torch.Tensor | None,
    grid: ColumnGrid | None = None,
):
    if grid is not None:
        return grid.group_params(w, h_block)
    if ratios is None:
        return grid_params(w, spec)
    return clipped_grid_params(w, spec, ratios, h_block)


class GPTQOutput(NamedTuple):
    codes: torch.Tensor  # [N, K - keep_last] int64, original column order
    scales: torch.Tensor  # [N, G], G groups over the quantized columns
    zeros: torch.Tensor  # [N, G]
    kept: torch.Tensor  # [N, keep_last]: the last columns, unquantized but carrying the propagated error


def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    spec: GridSpec,
    *,
    damp: float = 0.01,
    block_size: int = 128,
    act_order: bool = False,
    static_groups: bool = False,
    clip_ratios: list[float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return (codes [N,K] int64, scales [N,G], zeros [N,G]) in the original column order.

    Computes in the dtype of `weight` (float32 in the pipeline, float64 in tests). Groups are formed over the
    original column order; with `act_order` that requires `static_groups` (scales fixed before the loop), so the
    packed layout needs no per-column group index.
    """
    out = gptq_run(
        weight,
        hessian,
        spec,
        damp=damp,
        block_size=block_size,
        act_order=act_order,
        static_groups=static_groups,
        clip_ratios=clip_ratios,
    )
    return out.codes, out.scales, out.zeros


def gptq_run(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    spec: GridSpec,
    *,
    damp: float = 0.01,
    block_size: int = 128,
    act_order: bool = False,
    static_groups: bool = False,
    clip_ratios: list[float] | None = None,
    keep_last: int = 0,
    sparsity_24: bool = False,
    grid: ColumnGrid | None = None,
) -> GPTQOutput:
    """GPTQ with the extensions used by outlier-aware (`keep_last`, `sparsity_24`) and progressive (`grid`)
    quantization.

    `keep_last`: the last `keep_last` columns are never quantized; they still receive the error feedback of every
    quantized column, so the rounding error accumulates into them (the caller permutes the columns it wants to
    keep in full precision to the end, with the Hessian permuted the same way). Grids span only the quantized
    columns, so weights in kept columns do not widen any scale.

    `sparsity_24`: prune to 2:4 in the same pass (SparseGPT): at the start of every group of 4 consecutive
    quantized columns, the 2 weights of each row with the smallest `w² / [H⁻¹]_jj²` (on the error-updated
    weights) are set to the zero point, and their removal error is fed back like a rounding error. A partial
    last group of r < 4 columns keeps at most 2 (prunes r - 2 when r = 3).

    `grid`: group parameters and column codes come from it instead of `spec`'s affine grid (`spec` still gives
    the group size; `clip_ratios` is not used, the grid clips as it chooses).
    """
    w = weight.clone()
    h = hessian.to(w.dtype).clone()
    n, k = w.shape
    if not 0 <= keep_last < k:
        raise ValueError(f"keep_last must be in 0..{k - 1}, got {keep_last}")
    kq = k - keep_last  # quantized columns: 0..kq-1
    g = spec.group_size or kq
    if act_order and spec.group_size is not None and not static_groups:
        raise ValueError("act_order with groups needs static_groups")
    if act_order and (keep_last or sparsity_24):
        raise ValueError(
            "act_order cannot be combined with keep_last or sparsity_24 (both fix the column order)"
        )
    if grid is not None and sparsity_24:
        raise ValueError("sparsity_24 needs the affine grid (its pruned weights are the zero point)")

    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0

    num_groups = spec.num_groups(kq) if spec.group_size is not None else 1
    scales = torch.zeros(n, num_groups, dtype=w.dtype, device=w.device)
    zeros = torch.zeros_like(scales)
    bounds = spec.group_bounds(kq) if spec.group_size is not None else [(0, kq)]
    if static_groups or spec.group_size is None:
        for j, (s, e) in enumerate(bounds):
            scales[:, j], zeros[:, j] = _group_params(w[:, s:e], spec, clip_ratios, h[s:e, s:e], grid)

    perm = torch.arange(k, device=w.device)
    if act_order:
        perm = torch.argsort(torch.diagonal(h), descending=True)
        w, h = w[:, perm], h[perm][:, perm]
    group_of = perm // g  # group of each (permuted) column

    h += damp * torch.mean(torch.diagonal(h)) * torch.eye(k, dtype=h.dtype, device=h.device)
    hinv = inverse_hessian_factor(h)

    # Dynamic groups take their range from the error-updated weights when the group starts; keeping each group
    # inside one lazy batch makes those the fully updated values. 2:4 groups must not straddle a batch either.
    dynamic = not (static_groups or spec.group_size is None)
    bs = max(g, block_size // g * g) if dynamic else block_size
    if sparsity_24 and bs % 4:
        if dynamic:
            raise ValueError(f"sparsity_24 with dynamic groups needs group_size a multiple of 4, got {g}")
        bs = (bs + 3) // 4 * 4

    codes = torch.zeros(n, kq, dtype=torch.int64, device=w.device)
    if grid is None and not sparsity_24 and _batch_kernel_usable(w, bs):
        _batched_on_gpu(w, hinv, h, codes, scales, zeros, group_of, spec, clip_ratios, kq, bs, g, dynamic)
        if act_order:
            codes = codes[:, torch.argsort(perm)]
        return GPTQOutput(codes, scales, zeros, w[:, kq:].clone())
    # The column loop runs K times per layer and dominates quantization time on small models: it keeps the
    # per-column torch calls few (group lookups as Python ints, scale/zero views cached per group, codes converted
    # once per batch, results written in place) while doing exactly the arithmetic of the textbook loop.
    group_list = group_of.tolist()
    maxq = float(spec.maxq)
    for i1 in range(0, kq, bs):
        i2 = min(i1 + bs, kq)
        # The batch is held transposed (a column per row, contiguous): the loop's per-column operations then read
        # and write contiguous memory, element for element the same arithmetic as on the [N, B] matrix.
        w1t = w[:, i1:i2].T.contiguous()
        err1t = torch.zeros_like(w1t)
        q1t = torch.empty_like(w1t)
        hinv1 = hinv[i1:i2, i1:i2]
        dinv = torch.diagonal(hinv1)
        pruned = torch.zeros(n, i2 - i1, dtype=torch.bool, device=w.device) if sparsity_24 else None
        cur_j, s, z = -1, None, None
        for i in range(i2 - i1):
            col = i1 + i
            if dynamic and col % g == 0:
                e = min(col + g, kq)
                j = col // g
                # The group's columns as a view of the [N, B] batch, the layout the range search always read
                # (its sums may be ordered by layout on a GPU, where the batch kernel passes that view too).
                rows = w1t.T.contiguous()[:, i : i + (e - col)]
                scales[:, j], zeros[:, j] = _group_params(rows, spec, clip_ratios, h[col:e, col:e], grid)
                cur_j = -1  # the group's scale and zero point just changed
            if pruned is not None and i % 4 == 0:
                m = min(4, i2 - i1 - i)
                if m > 2:
                    score = (
                        w1t[i : i + m].T.contiguous() ** 2 / torch.diagonal(hinv1)[i : i + m][None, :] ** 2
                    )
                    drop = torch.topk(score, m - 2, dim=1, largest=False).indices
                    pruned[:, i : i + m].scatter_(1, drop, True)
            j = group_list[col]
            if j != cur_j:
                cur_j, s, z = j, scales[:, j].contiguous(), zeros[:, j].contiguous()
            wcol, q, e_col = w1t[i], q1t[i], err1t[i]
            if grid is not None:
                codes_i, wq = grid.quantize_column(wcol, s, z)
                q.copy_(codes_i)
                torch.sub(wcol, wq, out=e_col)
            else:
                torch.div(wcol, s, out=q)
                q.round_().add_(z).clamp_(0, maxq)
                if pruned is not None:
                    q.copy_(torch.where(pruned[:, i], z, q))  # the zero point dequantizes to exactly 0
                torch.sub(wcol, s * (q - z), out=e_col)
            e_col.div_(
                dinv[i]
            )  # a 0-d tensor, not a Python float: torch may turn x / float into x * (1 / float)
            w1t[i:] -= hinv1[i, i:][:, None] * e_col[None, :]
        codes[:, i1:i2] = q1t.T.to(torch.int64)
        w[:, i2:] -= err1t.T.contiguous() @ hinv[i1:i2, i2:]

    if act_order:
        codes = codes[:, torch.argsort(perm)]
    return GPTQOutput(codes, scales, zeros, w[:, kq:].clone())


def _batch_kernel_usable(w: torch.Tensor, bs: int) -> bool:
    if not w.is_cuda:
        return False
    from qtool.cuda import gptq as gptq_cuda  # the CPU path never imports the GPU runtime

    return gptq_cuda.usable(w, bs)


def _batched_on_gpu(
    w: torch.Tensor,
    hinv: torch.Tensor,
    h: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_of: torch.Tensor,
    spec: GridSpec,
    clip_ratios: list[float] | None,
    kq: int,
    bs: int,
    g: int,
    dynamic: bool,
) -> None:
    """`gptq_run`'s loop for the affine grid with the column walk of each lazy batch in one kernel
    (qtool/cuda/gptq.py): the same operations in the same order, so the same codes, scales and zeros bit for bit.
    A dynamic group's range is still taken in torch when the walk reaches the group, from the updated weights."""
    from qtool.cuda import gptq as gptq_cuda

    groups = group_of.to(torch.int32)
    maxq = float(spec.maxq)
    for i1 in range(0, kq, bs):
        i2 = min(i1 + bs, kq)
        w1 = w[:, i1:i2].clone()
        err1 = torch.zeros_like(w1)
        q1 = torch.empty_like(w1)
        hinv1 = hinv[i1:i2, i1:i2]
        starts = list(range(i1, i2, g)) if dynamic else [i1]
        for a, b in zip(starts, [*starts[1:], i2], strict=True):
            if dynamic:
                e = min(a + g, kq)
                scales[:, a // g], zeros[:, a // g] = _group_params(
                    w1[:, a - i1 : e - i1], spec, clip_ratios, h[a:e, a:e]
                )
            gptq_cuda.columns(
                w1, q1, err1, hinv1, scales, zeros, groups[i1:i2].contiguous(), a - i1, b - i1, maxq
            )
        codes[:, i1:i2] = q1.to(torch.int64)
        w[:, i2:] -= err1 @ hinv[i1:i2, i2:]
