"""CUDA execution of the `vq` layout: the device view of a layer that both its kernels take (`Prepared`, from
`prepare`), and the decode GEMV for 1..GEMV_MAX_M tokens (kernels/vq/gemv.cu) with VQ-LLM's codebook cache, its
launch plan and the dispatch rule. The prefill GEMM (qtool/layouts/vq/cuda_gemm.py) takes the same view.

Two forms of the GEMV, one template (formats/vq.md "For the CUDA kernels"): `mma` (the default) puts every
looked-up entry into a tensor-core A fragment (mma.sync m16n8k16, fp32 accumulation); `fma` multiplies entries and
activations on the CUDA cores (fp16x2 products per vector, fp32 across vectors).

Cache variants: ``gc`` reads every entry from global memory (L1/L2), ``sc`` holds the block's whole codebook in
shared memory, ``tiered`` places entries by their re-indexed position: the hot tier [0, n_reg) is, in the `mma`
form, replicated 16 times in shared memory so the lanes of a half-warp never share a bank, in the `fma` form held
in registers (one entry per lane per 32, read with a warp shuffle); [n_reg, n_shared) is a single shared copy and
the rest is read from global memory. The tiers come from the slack of the GC build measured on the device
(`cache_tiers`, `cache_tiers_mma`): what a block can add without lowering the number of blocks a multiprocessor
holds.

Dataflow: a thread block holds one codebook at a time, i.e. one scope and one residual. Tiled scopes (GPTVQ) split
the reduction along the column tiles, a block walking through `tiles_per_split` of them (the traffic balance picks
how many); per-tensor codebooks (AQLM) along the residuals, and further along K only where the staged activations
would not fit. Partial sums go through the split-K workspace (qtool/cuda/split_k.py) and the last block of a row
block adds them in split order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from qtool.cuda import compile as cc
from qtool.cuda import dependent_launch, split_k

SOURCE = "vq/gemv.cu"
LAYOUT = "vq"
GEMV_MAX_M = 16
TOKEN_SLOTS = (1, 2, 4, 8, 16)  # the GEMV's builds: M is rounded up to one of these
THREADS = 256  # must match THREADS in kernels/vq/gemv.cu
CACHES = ("gc", "sc", "tiered")
FORMS = ("mma", "fma")
DEFAULT_FORM = "mma"
MMA_CHUNK = 64  # vectors per chunk of the mma form (MmaChunk<D, B>::CV)
REPLICAS = 16  # copies of a replicated entry in the mma form: one per bank pair
# What the tests run on a GPU (the template also builds d = 2 and 16-bit indices: untested, so not dispatched).
VECTOR_SIZES = (4, 8)
INDEX_BITS = (8, 12)
MAX_REG_SETS = 2  # register tier: at most 64 entries (each 32 cost d/2 registers and d/2 shuffles per lookup)
# Staged activations of one block (M slots x its K range, fp16): per-tensor codebooks split K beyond this.
X_STAGE_BYTES = 32 * 1024
RESERVED_SMEM = 1024  # shared memory the runtime reserves per block
# mma form, thread-block clusters (Hopper): the splits of one row block in a cluster of at most CLUSTER_MAX blocks
# add their partial sums through distributed shared memory (no workspace round trip, no counter). Environment:
# QTOOL_VQ_CLUSTER (1: off), QTOOL_VQ_PREFETCH (0: the next column tile's codebook is not loaded during the current
# one), QTOOL_VQ_DEPENDENT (0: an ordinary launch instead of a programmatic dependent one), QTOOL_VQ_MAX_WK (caps the
# warps sharing a row along K: fewer, larger blocks). The defaults are what scripts/vq_gemv_options.py picked on an
# H100 (kernels/vq/NOTES.md "Decode GEMV"): the dependent launch on; clusters and prefetch lost their A/B there and
# stay off.
CLUSTER_MAX = 1  # 16: Hopper's largest (non-portable) cluster
PREFETCH = 0  # 1
DEPENDENT = 1
CLUSTER_LIMIT = 16  # blocks per cluster on Hopper (above 8 with the non-portable attribute)


def knobs() -> tuple[int, int, int, int]:
    """(cluster cap, prefetch, dependent launch, warps along K cap) of the mma form, from the environment."""
    limit = min(CLUSTER_LIMIT, dependent_launch.cluster_limit())  # lower once the driver refused a size
    return (
        max(1, min(limit, cc.env_int("QTOOL_VQ_CLUSTER", CLUSTER_MAX))),
        1 if cc.env_int("QTOOL_VQ_PREFETCH", PREFETCH) else 0,
        1 if cc.env_int("QTOOL_VQ_DEPENDENT", DEPENDENT) and dependent_launch.ENABLED else 0,
        max(1, min(8, cc.env_int("QTOOL_VQ_MAX_WK", 8))),
    )


def chunk_vectors(bits: int) -> int:
    """Vectors per chunk: CH·b bits are whole 16-byte words (must match Chunk<B> in the kernel)."""
    return {8: 16, 12: 32, 16: 8}[bits]


def rows_per_thread(mt: int, bits: int) -> int:
    """Rows a thread takes per pass (must match Rows<MT, B> in the kernel)."""
    if mt <= 2:
        return 2 if chunk_vectors(bits) * bits // 32 > 4 else 4
    return 2 if mt <= 4 else 1


def unsupported_reason(
    vector_size: int, index_bits: int, tile_cols: int | None, in_features: int
) -> str | None:
    """Why the kernel cannot run a layer of these parameters (None when it can)."""
    if vector_size not in VECTOR_SIZES:
        return f"vector_size={vector_size} (the kernel covers {', '.join(map(str, VECTOR_SIZES))})"
    if index_bits not in INDEX_BITS:
        return f"index_bits={index_bits} (the kernel covers {', '.join(map(str, INDEX_BITS))})"
    if (
        tile_cols is not None
        and tile_cols < in_features
        and (tile_cols // vector_size) % chunk_vectors(index_bits)
    ):
        return (
            f"tile_cols={tile_cols} (the kernel needs column tiles of a multiple of "
            f"{chunk_vectors(index_bits)} vectors at {index_bits}-bit indices)"
        )
    return None


@dataclass(frozen=True)
class DeviceLimits:
    sms: int
    regs_per_sm: int = 65536
    threads_per_sm: int = 2048
    smem_per_sm: int = 233472
    smem_per_block: int = 232448  # opt-in maximum for one block


_LIMITS: dict[int, DeviceLimits] = {}


def device_limits(dev: int) -> DeviceLimits:
    if dev not in _LIMITS:
        p = torch.cuda.get_device_properties(dev)
        _LIMITS[dev] = DeviceLimits(
            sms=p.multi_processor_count,
            regs_per_sm=int(getattr(p, "regs_per_multiprocessor", 65536)),
            threads_per_sm=int(getattr(p, "max_threads_per_multi_processor", 2048)),
            smem_per_sm=int(getattr(p, "shared_memory_per_multiprocessor", 233472)),
            smem_per_block=int(getattr(p, "shared_memory_per_block_optin", 232448)),
        )
    return _LIMITS[dev]


def blocks_per_sm(num_regs: int, smem: int, lim: DeviceLimits, threads: int = THREADS) -> int:
    """Blocks of `threads` threads using `num_regs` registers each and `smem` bytes of shared memory that one
    multiprocessor holds at once (registers are allocated 8 at a time per thread)."""
    regs = -(-num_regs // 8) * 8
    return max(
        0,
        min(
            lim.threads_per_sm // threads,
            lim.regs_per_sm // (regs * threads),
            lim.smem_per_sm // (smem + RESERVED_SMEM),
        ),
    )


def cache_tiers(
    vector_size: int,
    entries: int,
    hot: int,
    num_regs: int,
    smem: int,
    lim: DeviceLimits,
    threads: int = THREADS,
) -> tuple[int, int, dict]:
    """(n_reg, n_shared, why) of the tiered cache from the GC build's measured registers per thread (`num_regs`)
    and shared memory per block (`smem`: its staged activations): the occupancy that build reaches stays, the
    registers and shared memory left at that occupancy hold entries. A register set of 32 entries costs d/2
    registers per thread and is used only if some entry is hot (`hot`: the largest `entry_tiers` hot boundary);
    the shared tier beyond the registers is rounded down to a power of two of at least 32 entries, or 0 (few
    distinct builds)."""
    blocks = max(1, blocks_per_sm(num_regs, smem, lim, threads))
    reg_budget = min(255, (lim.regs_per_sm // (blocks * threads)) // 8 * 8)
    reg_slack = max(0, reg_budget - (-(-num_regs // 8) * 8))
    sets = min(reg_slack // max(1, vector_size // 2), -(-hot // 32), MAX_REG_SETS)
    n_reg = min(entries, 32 * sets)
    smem_slack = max(0, min(lim.smem_per_sm // blocks - RESERVED_SMEM, lim.smem_per_block) - smem)
    fit = smem_slack // (2 * vector_size)
    n_shared = min(entries, n_reg + (1 << (fit.bit_length() - 1) if fit >= 32 else 0))
    why = {
        "gc_regs": num_regs,
        "gc_smem": smem,
        "blocks_per_sm": blocks,
        "reg_slack": reg_slack,
        "smem_slack": smem_slack,
        "hot": hot,
    }
    return n_reg, n_shared, why


def cache_tiers_mma(
    vector_size: int, entries: int, num_regs: int, smem: int, lim: DeviceLimits, threads: int = THREADS
) -> tuple[int, int, dict]:
    """(n_rep, n_shared, why) of the mma form's tiered cache from its GC build's measured registers per thread and
    shared memory per block: at the occupancy that build reaches, the shared memory left holds single copies of
    entries [0, n_shared) first (the whole codebook where it fits, else the largest power of two of at least 32),
    then, where what remains holds the whole codebook's 15 more copies each, every entry is replicated (n_rep =
    E). Never a part of it: on an H100 a partial replica tier lost to plain shared memory (GPTVQ-2 with 64 of 256
    entries replicated, AQLM-3 with 128 of 4096: a lane then picks its tier per lookup, and the lookups that stay
    in the single copy still conflict), while the whole GPTVQ-2 codebook replicated was 16-17% faster (formats/vq.md)."""
    blocks = max(1, blocks_per_sm(num_regs, smem, lim, threads))
    slack = max(0, min(lim.smem_per_sm // blocks - RESERVED_SMEM, lim.smem_per_block) - smem)
    eb = 2 * vector_size
    fit = slack // eb
    n_shared = entries if entries <= fit else (1 << (fit.bit_length() - 1) if fit >= 32 else 0)
    n_rep = entries if n_shared == entries and entries * REPLICAS * eb <= slack else 0
    why = {"gc_regs": num_regs, "gc_smem": smem, "blocks_per_sm": blocks, "smem_slack": slack}
    return n_rep, n_shared, why


def traffic_split(
    codebook_bytes: int, blocks: int, out_bytes: int, limit: int, cost_ratio: float = 1.0
) -> int:
    """VQ-LLM's split factor along the codebook-switch axes of the reduction (Sec. VI-A): reduce traffic
    s·out_bytes against codebook traffic blocks·codebook_bytes/s, balanced at s* = sqrt(blocks·codebook_bytes·
    cost_ratio / out_bytes) (cost_ratio: cost of a codebook byte over a partial-sum byte), within [1, limit]."""
    s = math.sqrt(max(0.0, blocks * codebook_bytes * cost_ratio) / max(1, out_bytes))
    return max(1, min(limit, round(s)))


@dataclass
class Plan:
    """Launch geometry of one (layer, token slot, cache)."""

    n_reg: int  # hot tier: registers (fma) or replicated entries (mma)
    n_shared: int
    split_vecs: int  # vectors per column range (a column tile for tiled scopes)
    tiles_per_split: int  # column ranges one block walks through (codebook switches inside the block)
    splits_k: int
    splits: int  # grid y = residuals x splits_k
    rows_per_block: int
    rbpt: int  # row blocks per row tile
    grid_x: int
    smem: int
    balance: int  # the traffic balance's split factor s*
    form: str = "fma"
    wk: int = 1  # mma form: warps along K per row
    cluster: tuple[int, int] = (1, 1)  # mma form: (1, splits of a row block)
    prefetch: int = 0  # mma form: next column tile's codebook and index words loaded during the current one
    dependent: int = 0  # mma form: launched as a programmatic dependent of the kernel ahead
    why: dict = field(default_factory=dict)


@dataclass
class Prepared:
    """Device-side view of one `vq` layer (the checkpoint tensors in place, 16-byte aligned) that the GEMV and the
    GEMM (qtool/layouts/vq/cuda_gemm.py) take, and the GEMV's launch plans. Tiles along an axis that has one are given
    by their size (`tile_rows` = N, `tile_vecs` = K/d), never None."""

    indices: torch.Tensor  # int32 [z, N, W]
    codebooks: torch.Tensor  # float16 [R, C, z, E, d]
    vector_size: int
    index_bits: int
    residuals: int
    tile_rows: int  # rows per row tile, at most N
    tile_vecs: int  # vectors per column tile, at most K/d
    in_features: int
    out_features: int
    hot: int = 0  # largest hot boundary over the codebooks (0 without re-indexing)
    source_ptr: int = 0
    plans: dict = field(default_factory=dict)

    @property
    def entries(self) -> int:
        return 1 << self.index_bits

    @property
    def config(self) -> tuple[int, int, int]:
        return self.vector_size, self.index_bits, self.residuals

    @property
    def codebook_bytes(self) -> int:
        """One scope's codebooks."""
        return self.residuals * self.entries * self.vector_size * 2

    @property
    def row_tiles(self) -> int:
        return self.codebooks.shape[0]

    @property
    def col_tiles(self) -> int:
        return self.codebooks.shape[1]

    def nbytes(self) -> int:
        """Bytes a GEMV must read of the layer: every index and every codebook once."""
        return sum(t.numel() * t.element_size() for t in (self.indices, self.codebooks))


def _aligned(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def view(
    indices: torch.Tensor,
    codebooks: torch.Tensor,
    vector_size: int,
    entries: int,
    residuals: int,
    in_features: int,
    out_features: int,
    tile_rows: int | None,
    tile_cols: int | None,
    hot: int = 0,
) -> Prepared:
    """Check a layout's CUDA tensors against its parameters (`tile_rows`/`tile_cols` as stored: None for one tile)
    and build the kernel view."""
    bits = entries.bit_length() - 1
    d, k, n = vector_size, in_features, out_features
    words = -(-(k // d) * bits // 32)
    if indices.dtype != torch.int32 or tuple(indices.shape) != (residuals, n, words):
        raise ValueError(
            f"indices: found {indices.dtype} {list(indices.shape)}, expected torch.int32 "
            f"{[residuals, n, words]}"
        )
    r_tiles = 1 if tile_rows is None else -(-n // tile_rows)
    c_tiles = 1 if tile_cols is None else -(-k // tile_cols)
    want = (r_tiles, c_tiles, residuals, entries, d)
    if tuple(codebooks.shape) != want:
        raise ValueError(f"codebooks: found {list(codebooks.shape)}, expected {list(want)}")
    for name, t in (("indices", indices), ("codebooks", codebooks)):
        if not t.is_cuda:
            raise ValueError(f"{name}: found device {t.device}, expected a CUDA tensor")
    books = _aligned(codebooks.to(dtype=torch.float16))
    v = k // d
    return Prepared(
        indices=_aligned(indices),
        codebooks=books,
        vector_size=d,
        index_bits=bits,
        residuals=residuals,
        tile_rows=n if tile_rows is None else min(tile_rows, n),
        tile_vecs=v if tile_cols is None or tile_cols >= k else tile_cols // d,
        in_features=k,
        out_features=n,
        hot=hot,
        source_ptr=indices.data_ptr(),
    )


def prepare(layout) -> Prepared:
    """The kernel view of a `VQWeight` (or a `VQLinear`) whose tensors are on CUDA."""
    tiers = layout.entry_tiers
    hot = int(tiers[..., 0].max()) if layout.reindexed and tiers.numel() else 0
    books = layout.codebooks.to(device=layout.indices.device) if layout.indices.is_cuda else layout.codebooks
    return view(
        layout.indices,
        books,
        layout.vector_size,
        layout.entries,
        layout.residuals,
        layout.in_features,
        layout.out_features,
        layout.tile_rows,
        layout.tile_cols,
        hot,
    )


def layer_view(layer: torch.nn.Module, device: torch.device) -> Prepared:
    """A VQLinear's view, kept on the layer (rebuilt when its tensors move or are replaced)."""
    return layer.derived(
        "cuda",
        lambda: prepare(layer),
        valid=lambda p: p.source_ptr == layer.indices.data_ptr() and p.indices.device == device,
    )


def token_slots(m: int) -> int:
    for s in TOKEN_SLOTS:
        if m <= s:
            return s
    raise ValueError(f"x: found M={m} tokens, expected 1..{GEMV_MAX_M} for the {LAYOUT} GEMV")


def module_for(
    p: Prepared, n_reg: int, n_shared: int, dev: int, form: str = "fma", prefetch: int = 1
) -> cc.KernelModule:
    hot = (
        ("-DVQ_NREG=0", f"-DVQ_NREP={n_reg}", f"-DVQ_PF={prefetch}")
        if form == "mma"
        else (f"-DVQ_NREG={n_reg}",)
    )
    opts = (f"-DVQ_D={p.vector_size}", f"-DVQ_B={p.index_bits}", *hot, f"-DVQ_NSH={n_shared}")
    return cc.load_module(SOURCE, extra_options=opts, device=dev)


def entry_name(form: str, mt: int) -> str:
    return f"vq_gemv_mma_m{mt}" if form == "mma" else f"vq_gemv_m{mt}"


def _split(p: Prepared, mt: int, form: str = "fma") -> tuple[int, int]:
    """(vectors per column range, ranges along K): a column tile for tiled scopes; per tensor, the whole K unless
    the staged activations would exceed X_STAGE_BYTES (ranges of whole chunks)."""
    v = p.in_features // p.vector_size
    ch = MMA_CHUNK if form == "mma" else chunk_vectors(p.index_bits)
    if p.tile_vecs < v:
        return p.tile_vecs, p.col_tiles
    want = max(1, -(-mt * v * p.vector_size * 2 // X_STAGE_BYTES))
    per = -(-v // want)
    vecs = -(-per // ch) * ch
    return vecs, -(-v // vecs)


def _geometry(p: Prepared, split_vecs: int) -> tuple[int, int]:
    """(lanes per row, padded chunks) of a block's K range in the fma form, as the kernel computes them."""
    nch = -(-split_vecs // chunk_vectors(p.index_bits))
    wl = 1
    while wl < nch and wl < 32:
        wl <<= 1
    return wl, -(-nch // wl) * wl


def x_stage_bytes(p: Prepared, mt: int, split_vecs: int, form: str = "fma") -> int:
    """Shared memory of a block beside the codebook: its staged activations (in the mma form the same bytes
    later hold the 256 row slots x mt float partial sums of its warps)."""
    if form == "mma":
        return max(mt * -(-split_vecs // MMA_CHUNK) * MMA_CHUNK * p.vector_size * 2, 256 * mt * 4)
    _, npad = _geometry(p, split_vecs)
    return mt * chunk_vectors(p.index_bits) * npad * p.vector_size * 2


def tiers_for(p: Prepared, cache: str, mt: int, dev: int, form: str = "fma") -> tuple[int, int, dict]:
    """(n_reg, n_shared, why) of a cache variant; `tiered` measures the GC build of this token slot."""
    if cache == "gc":
        return 0, 0, {}
    if cache == "sc":
        return 0, p.entries, {}
    if cache != "tiered":
        raise ValueError(f"cache: found {cache!r}, expected one of {', '.join(CACHES)}")
    fn = module_for(p, 0, 0, dev, form).fn(entry_name(form, mt))
    split_vecs, _ = _split(p, mt, form)
    smem = x_stage_bytes(p, mt, split_vecs, form) + int(fn.shared_size_bytes)
    if form == "mma":
        return cache_tiers_mma(p.vector_size, p.entries, int(fn.num_regs), smem, device_limits(dev))
    return cache_tiers(p.vector_size, p.entries, p.hot, int(fn.num_regs), smem, device_limits(dev))


def _check_tiers(p: Prepared, tiers: tuple[int, int], form: str) -> None:
    n_reg, n_shared = tiers
    top = p.entries if form == "mma" else 32 * MAX_REG_SETS
    if (
        n_reg % 32
        or n_reg > top
        or n_shared % 32
        or not (n_shared == 0 and (form == "fma" or n_reg == 0) or n_reg <= n_shared <= p.entries)
    ):
        raise ValueError(
            f"tiers: found {tiers}, expected n_reg a multiple of 32 up to {top} and n_shared 0"
            f"{'' if form == 'fma' else ' (with n_reg 0)'} or a multiple of 32 in [n_reg, {p.entries}]"
        )


def plan_for(
    p: Prepared,
    mt: int,
    cache: str,
    dev: int,
    tiers: tuple[int, int] | None = None,
    tiles_per_split: int | None = None,
    form: str = DEFAULT_FORM,
) -> Plan:
    """The launch geometry. The split along the reduction follows VQ-LLM's traffic balance: with the grid sized to
    fill the device (`target` blocks), a block that walks through more column tiles leaves fewer partial sums
    (s · 4·M·N bytes) but its row range shrinks, so the codebooks are loaded more often (target · C·z·E·d·2 / s
    bytes); s* = sqrt of their ratio (traffic_split), rounded to a whole number of column tiles per block and never
    below the z residual codebooks (one codebook per block). The geometry is the same for every cache variant.
    In the mma form a block holds 256 / wk rows, wk warps sharing a row along K: the smallest wk (1, 2, 4, 8, at
    most the range's chunks) whose grid fills the device. `tiers` and `tiles_per_split` override the derived
    values (tests)."""
    kn = knobs() if form == "mma" else (1, 0, 0, 8)
    key = (mt, cache, tiers, dev, tiles_per_split, form, kn)
    plan = p.plans.get(key)
    if plan is not None:
        return plan
    if form not in FORMS:
        raise ValueError(f"form: found {form!r}, expected one of {', '.join(FORMS)}")
    reason = unsupported_reason(p.vector_size, p.index_bits, p.tile_vecs * p.vector_size, p.in_features)
    if reason is not None:
        raise cc.CudaUnavailableError(f"{LAYOUT} layer: {reason}; use the reference path")
    cmax, prefetch, dependent, max_wk = kn
    if tiers is None:
        n_reg, n_shared, why = tiers_for(p, cache, mt, dev, form)
    else:
        _check_tiers(p, tiers, form)
        n_reg, n_shared = tiers
        why = {}
    lim = device_limits(dev)
    split_vecs, ranges = _split(p, mt, form)
    z = p.residuals
    if p.col_tiles > 1:
        splits_guess = (
            z * p.col_tiles
        )  # at most; the cluster's partial buffer is allotted whenever it may be used
    else:
        splits_guess = z * ranges
    xbytes = x_stage_bytes(p, mt, split_vecs, form)
    if form == "mma" and cmax > 1 and splits_guess > 1:
        xbytes = max(xbytes, 2 * 256 * mt * 4)  # `red`, then the row sums the cluster's blocks read
    entry = p.vector_size * 2
    if form == "mma":
        smem = n_reg * REPLICAS * entry + max(0, n_shared - n_reg) * entry + xbytes
    else:
        smem = max(0, n_shared - n_reg) * entry + xbytes
    if smem > lim.smem_per_block:
        raise cc.CudaUnavailableError(
            f"{LAYOUT} layer: {smem} bytes of shared memory per block for n_shared="
            f"{n_shared}, more than the {lim.smem_per_block} a block may hold"
        )
    fn = module_for(p, n_reg, n_shared, dev, form, prefetch).fn(entry_name(form, mt))
    resident = max(1, blocks_per_sm(int(fn.num_regs), smem, lim))
    target = lim.sms * resident
    n = p.out_features
    book = p.entries * p.vector_size * 2
    balance = traffic_split(p.col_tiles * z * book, target, 4 * n * mt, p.col_tiles * z)
    if p.col_tiles > 1:  # tiled: walk ceil(C / s_k) column tiles per block
        tps = tiles_per_split or -(-p.col_tiles // max(1, balance // z))
        if form == "mma" and cmax // z > 1 and tiles_per_split is None:
            tps = max(tps, -(-p.col_tiles // (cmax // z)))  # the splits fit one cluster
        splits_k = -(-p.col_tiles // tps)
    else:  # per tensor: split K further only where the staged activations need it
        tps, splits_k = 1, ranges
    splits = z * splits_k
    wk = 1
    if form == "mma":
        nch = -(-split_vecs // MMA_CHUNK)
        while (
            wk < max_wk and wk * 2 <= nch and p.row_tiles * -(-p.tile_rows // (256 // wk)) * splits < target
        ):
            wk *= 2
        rows = 256 // wk
    else:
        wl, _ = _geometry(p, split_vecs)
        unit = THREADS // wl * rows_per_thread(mt, p.index_bits)
        want = -(-n * splits // target)
        rows = min(max(unit, -(-want // unit) * unit), -(-p.tile_rows // unit) * unit)
    rbpt = -(-p.tile_rows // rows)
    grid_x = p.row_tiles * rbpt
    cy = 1
    if form == "mma" and 1 < splits <= cmax and xbytes >= 2 * 256 * mt * 4:
        cy = splits
    plan = Plan(
        n_reg=n_reg,
        n_shared=n_shared,
        split_vecs=split_vecs,
        tiles_per_split=tps,
        splits_k=splits_k,
        splits=splits,
        rows_per_block=rows,
        rbpt=rbpt,
        grid_x=grid_x,
        smem=smem,
        balance=balance,
        form=form,
        wk=wk,
        cluster=(1, cy),
        prefetch=prefetch if form == "mma" else 0,
        dependent=dependent if form == "mma" else 0,
        why={**why, "regs": int(fn.num_regs), "blocks_per_sm": resident},
    )
    p.plans[key] = plan
    return plan


def gemv(
    x: torch.Tensor,
    p: Prepared,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    cache: str = "tiered",
    tiers: tuple[int, int] | None = None,
    tiles_per_split: int | None = None,
    form: str = DEFAULT_FORM,
) -> torch.Tensor:
    """y = x · Wᵀ (+ bias) for 1..16 tokens through the `cache` variant of the `form` kernel; `tiers` = (n_reg,
    n_shared) and `tiles_per_split` override the derived values (tests)."""
    lead = x.shape[:-1]
    x2 = cc.f16_rows(x, p.in_features, LAYOUT)
    m = x2.shape[0]
    mt = token_slots(m)
    dev = cc.device_index(x.device)
    if tiles_per_split is not None and tiles_per_split < 1:
        raise ValueError(f"tiles_per_split: found {tiles_per_split}, expected a positive integer")
    plan = plan_for(p, mt, cache, dev, tiers, tiles_per_split, form)
    out = cc.f16_out(out, (m, p.out_features), x.device)
    b = None
    if bias is not None:
        if bias.numel() != p.out_features:
            raise ValueError(f"bias: found {list(bias.shape)}, expected [{p.out_features}]")
        b = bias.to(torch.float16).contiguous()
    ws = cnt = None
    if plan.splits > 1:
        got = split_k.workspace(dev, plan.splits * m * p.out_features, plan.grid_x)
        if (
            got is None
        ):  # growing it is not allowed while a graph is captured: a private one, captured with it
            got = (
                torch.empty(plan.splits * m * p.out_features, dtype=torch.float32, device=x.device),
                torch.zeros(plan.grid_x, dtype=torch.int32, device=x.device),
            )
        ws, cnt = got
    fn = module_for(p, plan.n_reg, plan.n_shared, dev, form, plan.prefetch or 0).fn(entry_name(form, mt))
    if plan.smem + int(fn.shared_size_bytes) > 48 * 1024:  # dynamic + static beyond the default 48 KB
        cc.allow_shared_memory(fn, plan.smem)
    words = p.indices.shape[-1]
    args = (
        cc.ptr(p.indices),
        cc.ptr(p.codebooks),
        cc.ptr(x2),
        cc.ptr(b),
        cc.ptr(out),
        cc.ptr(ws),
        cc.ptr(cnt),
        cc.i32(m),
        cc.i32(p.out_features),
        cc.i32(p.in_features),
        cc.i32(words),
        cc.i32(p.residuals),
        cc.i32(p.col_tiles),
        cc.i32(p.tile_rows),
        cc.i32(p.tile_vecs),
        cc.i32(plan.rows_per_block),
        cc.i32(plan.rbpt),
        cc.i32(plan.split_vecs),
        cc.i32(plan.splits_k),
        cc.i32(plan.tiles_per_split),
    )
    if form == "mma":
        args = (*args, cc.i32(plan.wk))
        cy = plan.cluster[1]
        dependent_launch.launch(
            fn,
            (plan.grid_x, plan.splits),
            (THREADS,),
            args,
            shared_mem=plan.smem,
            device=dev,
            dependent=bool(plan.dependent),
            cluster=(1, cy, 1) if cy > 1 else None,
        )
    else:
        cc.launch(fn, (plan.grid_x, plan.splits), (THREADS,), args, shared_mem=plan.smem, device=dev)
    return out.reshape(*lead, p.out_features)


def module_forward(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """CUDA forward of a VQLinear for 1..GEMV_MAX_M rows, or None when the caller runs another path (more rows:
    not this kernel's; the reference where the kernel cannot run, unless QTOOL_KERNELS=cuda makes that a
    one-line error)."""
    if cc.kernel_mode() == "reference":
        return None
    m = x.numel() // max(1, x.shape[-1])
    if not 1 <= m <= GEMV_MAX_M:
        return None
    reason = unsupported_reason(
        layer.vector_size, layer.entries.bit_length() - 1, layer.tile_cols, layer.in_features
    )
    if reason is None and x.dtype != torch.float16:
        reason = f"dtype {x.dtype} (the GEMV takes float16)"
    if not cc.use_kernels(LAYOUT, reason):
        return None
    return gemv(x, layer_view(layer, x.device), layer.bias)
