"""Vector quantization of one weight matrix (VQ-LLM's VQ<x, y, z>, produced as GPTVQ and AQLM produce it):
Hessian-weighted k-means codebooks, greedy residual codebooks (or beam search over the residual codes), and GPTQ's
error feedback across vector columns. The layout and every convention are in formats/vq.md.

A vector is `d` consecutive input-dim weights of one output row. Its distance to an entry is weighted per
dimension by `1/U_jj²`, `U` the upper Cholesky factor of the damped inverse Hessian (GPTVQ): the columns whose
rounding GPTQ cannot compensate weigh most."""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import torch
from torch import nn

from qtool.layouts.vq.layout import VQWeight
from qtool.quant.gptq import inverse_hessian_factor

# Vectors per assignment chunk times entries: bounds the distance matrix to 2^24 elements (64 MiB in float32).
_CHUNK_ELEMENTS = 1 << 24


def fp16(t: torch.Tensor) -> torch.Tensor:
    """Round to float16 and back: codebook entries are stored in float16 and every fit sees what is stored."""
    return t.to(torch.float16).to(t.dtype)


def _chunks(n: int, entries: int) -> range:
    step = max(1, _CHUNK_ELEMENTS // max(entries, 1))
    return range(0, n, step)


def distances(
    x: torch.Tensor, w: torch.Tensor | None, codebook: torch.Tensor, exact: bool = True
) -> torch.Tensor:
    """Weighted squared distances [n, E] of vectors `x` [n, d] (per-dimension weights `w` [n, d] or [d], or None
    for 1) to the entries `codebook` [E, d]. Without `exact` the per-vector constant Σ w x² is left out (the
    argmin over entries is the same)."""
    if w is None:
        w = torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
    wx = w * x
    # Σ w(x - c)² = Σ w x² - 2 Σ (w x) c + Σ w c²: the two terms that depend on the entry are one matmul with
    # inner dimension 2d (a matmul of inner dimension d, then an add over [n, E], costs twice the memory passes).
    wn = w.expand_as(x)
    d = torch.cat([wx, wn], dim=1) @ torch.cat([-2 * codebook, codebook.pow(2)], dim=1).T
    if exact:
        d += (wx * x).sum(-1, keepdim=True)
    return d


def nearest(
    x: torch.Tensor, w: torch.Tensor | None, codebook: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(index [n] int64, weighted squared error [n]) of the nearest entry to every vector, in chunks (ties: the
    lower index)."""
    n = x.shape[0]
    idx = torch.empty(n, dtype=torch.int64, device=x.device)
    err = torch.empty(n, dtype=x.dtype, device=x.device)
    for s in _chunks(n, codebook.shape[0]):
        e = min(s + max(1, _CHUNK_ELEMENTS // codebook.shape[0]), n)
        wi = None if w is None else (w if w.dim() == 1 else w[s:e])
        err[s:e], idx[s:e] = distances(x[s:e], wi, codebook, exact=False).min(dim=1)
    ww = torch.ones_like(x) if w is None else w.expand_as(x)
    err += (ww * x * x).sum(-1)
    return idx, err


def kmeans(
    x: torch.Tensor, w: torch.Tensor | None, entries: int, iters: int, generator: torch.Generator
) -> torch.Tensor:
    """Weighted k-means (Lloyd) of the vectors `x` [n, d] into `entries` centroids [E, d], each dimension of each
    vector weighted by `w` (assignment and means alike). Initialised with `entries` distinct vectors drawn by
    `generator`; an entry left empty takes the vector with the largest error; stops early when no assignment
    changes. Needs n >= entries (the stage refuses fewer)."""
    n, d = x.shape
    if n < entries:
        raise ValueError(f"k-means of {n} vectors into {entries} entries")
    perm = torch.randperm(n, generator=generator)[:entries].to(x.device)
    c = x[perm].clone()
    wfull = torch.ones_like(x) if w is None else w.expand_as(x)
    prev = None
    for _ in range(iters):
        idx, err = nearest(x, w, c)
        if prev is not None and torch.equal(idx, prev):
            break
        prev = idx
        num = torch.zeros_like(c).index_add_(0, idx, wfull * x)
        den = torch.zeros_like(c).index_add_(0, idx, wfull)
        filled = den > 0
        c = torch.where(filled, num / den.clamp_min(torch.finfo(x.dtype).tiny), c)
        empty = (~filled).all(dim=1).nonzero().flatten()
        if empty.numel():
            worst = torch.argsort(err, descending=True, stable=True)[: empty.numel()]
            c[empty] = x[worst]
    return c


def fit_residual_codebooks(
    x: torch.Tensor,
    w: torch.Tensor | None,
    entries: int,
    residuals: int,
    iters: int,
    generator: torch.Generator,
) -> torch.Tensor:
    """Greedy residual k-means (AQLM's initialisation): codebook r is fitted to what codebooks 0..r-1 leave, each
    rounded to float16 before the next is fitted. Returns [residuals, E, d] (float16 values in x's dtype)."""
    res = x.clone()
    books = []
    for _ in range(residuals):
        c = fp16(kmeans(res, w, entries, iters, generator))
        idx, _ = nearest(res, w, c)
        res -= c[idx]
        books.append(c)
    return torch.stack(books)


def encode(x: torch.Tensor, w: torch.Tensor | None, codebooks: torch.Tensor, beam: int = 1) -> torch.Tensor:
    """Codes [z, n] of the vectors `x` [n, d] in the additive codebooks [z, E, d]: greedy residual assignment
    (`beam` 1), or a beam search keeping the `beam` best partial sums after each codebook (AQLM's beam search over
    codes), choosing the sum of least weighted error."""
    z, entries, _ = codebooks.shape
    n = x.shape[0]
    if beam <= 1 or z == 1:
        res = x.clone()
        codes = torch.empty(z, n, dtype=torch.int64, device=x.device)
        for r in range(z):
            codes[r], _ = nearest(res, w, codebooks[r])
            res -= codebooks[r][codes[r]]
        return codes
    out = torch.empty(z, n, dtype=torch.int64, device=x.device)
    step = max(1, _CHUNK_ELEMENTS // (entries * beam))
    for s in range(0, n, step):
        e = min(s + step, n)
        xs = x[s:e]
        m = e - s
        ws = None if w is None else (w if w.dim() == 1 else w[s:e])
        # Beams: residuals [m, B, d], codes [m, B, r], errors [m, B]; the first step starts from one beam.
        res = xs[:, None, :]
        codes = torch.empty(m, 1, 0, dtype=torch.int64, device=x.device)
        for r in range(z):
            b = res.shape[1]
            wb = None if ws is None else (ws.repeat_interleave(b, 0) if ws.dim() == 2 else ws)
            dist = distances(res.reshape(m * b, -1), wb, codebooks[r]).reshape(m, b * entries)
            keep = min(beam, b * entries)
            err, flat = torch.topk(dist, keep, dim=1, largest=False, sorted=True)
            parent, entry = flat // entries, flat % entries
            res = torch.gather(res, 1, parent[..., None].expand(-1, -1, res.shape[-1])) - codebooks[r][entry]
            codes = torch.cat(
                [torch.gather(codes, 1, parent[..., None].expand(-1, -1, r)), entry[..., None]], -1
            )
        out[:, s:e] = codes[:, 0, :].T  # topk is sorted: beam 0 has the least error
    return out


def decode(codes: torch.Tensor, codebooks: torch.Tensor) -> torch.Tensor:
    """The vectors [n, d] the codes [z, n] select, summed over the codebooks [z, E, d]."""
    return sum(codebooks[r][codes[r]] for r in range(codes.shape[0]))


class VQOutput(NamedTuple):
    codes: torch.Tensor  # [z, N, K/d] int64
    codebooks: torch.Tensor  # [R, C, z, E, d]: row tiles x column tiles, float16 values in the weight's dtype
    dequantized: torch.Tensor  # [N, K]


def tile_bounds(size: int, tile: int | None) -> list[tuple[int, int]]:
    """[start, end) of each tile along one axis; the last tile is ragged (shorter) when `tile` does not divide
    `size`; None: one tile."""
    if tile is None or tile >= size:
        return [(0, size)]
    return [(s, min(s + tile, size)) for s in range(0, size, tile)]


def vq_gptq(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    vector_size: int,
    entries: int,
    residuals: int,
    *,
    tile_rows: int | None = None,
    tile_cols: int | None = None,
    iters: int = 20,
    beam: int = 1,
    damp: float = 0.01,
    block_size: int = 128,
    seed: int = 0,
) -> VQOutput:
    """GPTVQ: quantize `weight` [N, K] vector column by vector column (d input columns at a time), folding each
    column's error into the columns not yet quantized through the inverse Hessian, as GPTQ does.

    The codebooks of a tile (`tile_rows` x `tile_cols`; None: the whole axis) are fitted when the loop reaches the
    tile's first column, on the error-updated weights of its columns, so a per-tensor codebook (no tiles) is
    fitted on the original weights. Computes in the dtype of `weight` (float32 in the pipeline, float64 in
    tests)."""
    d = vector_size
    w = weight.clone()
    n, k = w.shape
    if k % d:
        raise ValueError(f"in_features {k} is not a multiple of vector_size {d}")
    if tile_cols is not None and tile_cols % d:
        raise ValueError(f"tile_cols {tile_cols} is not a multiple of vector_size {d}")
    h = hessian.to(w.dtype).clone()
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    h += damp * torch.mean(torch.diagonal(h)) * torch.eye(k, dtype=h.dtype, device=h.device)
    hinv = inverse_hessian_factor(h)
    weights = 1.0 / torch.diagonal(hinv).pow(2)  # per input column
    gen = torch.Generator().manual_seed(seed)

    rows, cols = tile_bounds(n, tile_rows), tile_bounds(k, tile_cols)
    books = torch.zeros(len(rows), len(cols), residuals, entries, d, dtype=w.dtype, device=w.device)
    codes = torch.zeros(residuals, n, k // d, dtype=torch.int64, device=w.device)
    q = torch.zeros_like(w)
    bs = max(d, block_size // d * d)
    for ci, (c0, c1) in enumerate(cols):
        wv = weights[c0:c1].reshape(-1, d)  # [vectors per row, d]
        for ri, (r0, r1) in enumerate(rows):
            x = w[r0:r1, c0:c1].reshape(-1, d)
            books[ri, ci] = fit_residual_codebooks(x, wv.repeat(r1 - r0, 1), entries, residuals, iters, gen)
        for i1 in range(c0, c1, bs):
            i2 = min(i1 + bs, c1)
            w1 = w[:, i1:i2].clone()
            err1 = torch.zeros_like(w1)
            hinv1 = hinv[i1:i2, i1:i2]
            for i in range(0, i2 - i1, d):
                col = i1 + i
                wd = weights[col : col + d]
                for ri, (r0, r1) in enumerate(rows):
                    c = encode(w1[r0:r1, i : i + d], wd, books[ri, ci], beam)
                    codes[:, r0:r1, col // d] = c
                    q[r0:r1, col : col + d] = decode(c, books[ri, ci])
                for j in range(i, i + d):
                    e = (w1[:, j] - q[:, i1 + j]) / hinv1[j, j]
                    w1[:, j:] -= e[:, None] * hinv1[j, j:][None, :]
                    err1[:, j] = e
            w[:, i2:] -= err1 @ hinv[i1:i2, i2:]
    return VQOutput(codes, books, q)


class TunableCodebooks(nn.Module):
    """A `vq` layer as a function of its codebooks, for fine-tuning them against the block output (AQLM's
    codebook update, GPTVQ's codebook update): the codes stay as quantized; every entry is its stored float16 value
    plus `δ · rms`, `δ` a trained float32 parameter starting at 0 and `rms` the root mean square of the layer's
    stored entries, so that a learning rate means the same relative move in every layer and model, whatever the
    size of its weights. An entry no vector selects gets no gradient and stays as stored."""

    def __init__(self, layout: VQWeight, device: torch.device) -> None:
        super().__init__()
        self.source = layout
        n_rt, n_ct, z, e, _ = layout.codebooks.shape
        codes = layout.codes()
        rt, ct = layout.scope_of()
        scope = (rt[:, None] * n_ct + ct[None, :]) * z  # [N, K/d]: first codebook of each vector's scope
        # Row of codebooks.reshape(-1, d) that vector (n, j) takes from codebook r.
        self.register_buffer("rows", torch.stack([(scope + r) * e + codes[r] for r in range(z)]))
        base = layout.codebooks.to(torch.float32)
        self.register_buffer("base", base.clone())
        self.register_buffer("rms", base.pow(2).mean().sqrt().clamp_min(torch.finfo(torch.float16).tiny))
        self.delta = nn.Parameter(torch.zeros_like(base))
        self.to(device)

    def books(self) -> torch.Tensor:
        return self.base + self.delta * self.rms

    def forward(self) -> torch.Tensor:
        """The dequantized weight [N, K] float32 (differentiable in the codebooks), summed over the codebooks in
        order r = 0, 1, ... as `VQWeight.dequantize` sums them."""
        books = self.books()
        flat = books.reshape(-1, books.shape[-1])
        w = sum(flat[self.rows[r]] for r in range(self.rows.shape[0]))
        return w.reshape(self.source.out_features, self.source.in_features)

    def layout(self) -> VQWeight:
        """The layer with the tuned codebooks rounded to float16 (what is stored; finite, within float16's range).
        Codes, their order by access count and the tiers are those of the quantized layer: tuning moves entries,
        never which vectors select them."""
        big = torch.finfo(torch.float16).max
        with torch.no_grad():
            books = self.books().cpu().clamp(-big, big).to(torch.float16)
        return replace(self.source, codebooks=books.contiguous())


def kmeans_batched(x: torch.Tensor, entries: int, iters: int, generator: torch.Generator) -> torch.Tensor:
    """Unweighted k-means of `P` independent sets of vectors `x` [P, n, d] at once (CQ's codebooks: one per KV
    head and channel group), with the initialisation, empty-entry and stopping rules of `kmeans`. Returns
    [P, E, d]."""
    p, n, d = x.shape
    if n < entries:
        raise ValueError(f"k-means of {n} vectors into {entries} entries")
    perm = torch.stack([torch.randperm(n, generator=generator)[:entries] for _ in range(p)]).to(x.device)
    c = torch.gather(x, 1, perm[..., None].expand(-1, -1, d))
    base = (torch.arange(p, device=x.device) * entries)[:, None]
    prev = None
    for _ in range(iters):
        idx, err = nearest_batched(x, c)
        if prev is not None and torch.equal(idx, prev):
            break
        prev = idx
        flat = (idx + base).reshape(-1)
        num = torch.zeros(p * entries, d, dtype=x.dtype, device=x.device).index_add_(
            0, flat, x.reshape(-1, d)
        )
        cnt = torch.bincount(flat, minlength=p * entries).to(x.dtype)[:, None]
        new = (num / cnt.clamp_min(1)).reshape(p, entries, d)
        filled = (cnt > 0).reshape(p, entries, 1)
        c = torch.where(filled, new, c)
        for i in (~filled[..., 0]).any(dim=1).nonzero().flatten().tolist():
            empty = (~filled[i, :, 0]).nonzero().flatten()
            worst = torch.argsort(err[i], descending=True, stable=True)[: empty.numel()]
            c[i, empty] = x[i, worst]
    return c


def nearest_batched(x: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(index [P, n], squared error [P, n]) of the nearest entry of c [P, E, d] to each vector of x [P, n, d]."""
    p, n, _ = x.shape
    idx = torch.empty(p, n, dtype=torch.int64, device=x.device)
    err = torch.empty(p, n, dtype=x.dtype, device=x.device)
    step = max(1, _CHUNK_ELEMENTS // max(p * c.shape[1], 1))
    # As in `distances`: the entry-dependent terms -2 x·c + |c|² as one batched matmul of inner dimension d + 1.
    rhs = torch.cat([-2 * c, c.pow(2).sum(-1, keepdim=True)], dim=-1).transpose(1, 2)
    for s in range(0, n, step):
        xs = x[:, s : s + step]
        lhs = torch.cat([xs, torch.ones_like(xs[..., :1])], dim=-1)
        err[:, s : s + step], idx[:, s : s + step] = torch.bmm(lhs, rhs).min(dim=-1)
    err += x.pow(2).sum(-1)
    return idx, err
