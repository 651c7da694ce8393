"""The CUDA work that `qtool bench kernels` times: random packed layers, cuBLAS baselines, ceilings."""

from __future__ import annotations

import functools
from typing import Any

import torch

from qtool.bench.kernels import rotations
from qtool.bench.stats import fp16_bytes, gemm_flops, quant_bytes
from qtool.bench.timing import Fns


def random_mixed_weight(k: int, n: int, outlier_fraction: float, device: torch.device, gen: torch.Generator):
    """A random mixed-2-4-16 layer built on the GPU (block4, g1 = g2 = 16): every code word is valid; the outliers
    sit at random positions of the 2-bit stripes."""
    from qtool.layouts.mixed.layout import MixedWeight

    s = k // 16
    s4, s2 = s // 4, s - s // 4
    bits = torch.full((s // 4, 4), 2, dtype=torch.uint8)
    bits[torch.arange(s // 4), torch.randint(0, 4, (s // 4,))] = 4

    def rint(*shape):
        return torch.randint(-(2**31), 2**31, shape, dtype=torch.int32, device=device, generator=gen)

    nnz = int(outlier_fraction * n * k)
    flat = torch.unique(torch.randint(0, n * s2 * 16, (nnz,), device=device, generator=gen))
    rows, c2 = flat // (s2 * 16), flat % (s2 * 16)
    cols2 = torch.nonzero((bits.reshape(-1) == 2).repeat_interleave(16))[:, 0].to(device)
    cols = cols2[c2]
    rowptr = torch.zeros(n + 1, dtype=torch.int32, device=device)
    rowptr[1:] = torch.cumsum(torch.bincount(rows, minlength=n), 0).to(torch.int32)
    return MixedWeight(
        group_size=16,
        scale_group_size=16,
        assign="block4",
        in_features=k,
        out_features=n,
        qweight_a=rint(n, k // 16),
        qweight_b=rint(n, s4),
        stripe_bits=bits.reshape(-1).to(device),
        scale_codes=rint(n, -(-s2 // 8)),
        zeros2=rint(n, -(-s2 // 16)),
        scales_2nd=(torch.rand(n // 16, s2, device=device, generator=gen) * 0.004 + 0.0002).half(),
        zeros_2nd=torch.randint(0, 16, (n // 16, s2), device=device, generator=gen).to(torch.uint8),
        scales4=(torch.rand(n, s4, device=device, generator=gen) * 0.004 + 0.002).half(),
        zeros4=rint(n, -(-s4 // 8)),
        outlier_values=(torch.randn(len(flat), device=device, generator=gen) * 0.05).half(),
        outlier_cols=torch.where(cols >= 1 << 15, cols - (1 << 16), cols).to(torch.int16),
        outlier_rowptr=rowptr,
    )


def random_vq_weight(k: int, n: int, preset: str, device: torch.device, gen: torch.Generator):
    """A random re-indexed VQ layer (`VQWeight`) of the preset's configuration (qtool.stages.vq.PRESETS), built on
    `device`. Codes are drawn with entry probabilities u^4 (u uniform, one draw per entry: a few hot entries, the rule
    of the layout tests), then every codebook is re-indexed by its scope's access counts as the `vq` stage does, with
    the tier boundaries that counting gives, so the layer passes the checks a loaded checkpoint's does; codebook
    entries are random normal (their order carries nothing, so they are not permuted with the codes)."""
    from qtool.layouts.bitpack import pack_codes
    from qtool.layouts.vq.layout import VQWeight, tile_counts
    from qtool.stages.vq import PRESETS

    cfg = PRESETS[preset]
    d, e, z, tr, tc = (cfg[f] for f in ("vector_size", "entries", "residuals", "tile_rows", "tile_cols"))
    bits, v = e.bit_length() - 1, k // d
    r_tiles, c_tiles = tile_counts(n, k, tr, tc)
    probs = torch.rand(e, device=device, generator=gen) ** 4
    cdf = torch.cumsum(probs, 0) / probs.sum()
    u = torch.rand(z, n, v, device=device, generator=gen)
    codes = torch.searchsorted(cdf, u).clamp_(max=e - 1)
    rt = torch.arange(n, device=device) // (tr or n)
    ct = torch.arange(v, device=device) * d // (tc or k)
    scopes = r_tiles * c_tiles
    scope = (rt[:, None] * c_tiles + ct[None, :]).expand(z, n, v) + torch.arange(z, device=device)[
        :, None, None
    ] * scopes
    flat = scope * e + codes
    counts = torch.bincount(flat.reshape(-1), minlength=z * scopes * e).reshape(-1, e)
    order = torch.argsort(-counts, dim=1, stable=True)
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(e, device=device).expand_as(order))
    codes = rank.reshape(-1)[flat]
    # tier_bounds of every scope at once, on the host as the checkpoint check computes them
    c = torch.gather(counts, 1, order).cpu().to(torch.float64)
    mu, sigma = c.mean(dim=1, keepdim=True), c.std(dim=1, unbiased=False, keepdim=True)
    tiers = torch.stack([(c > mu + 3 * sigma).sum(1), (c > mu).sum(1)], dim=1).to(torch.int32)
    books = (torch.randn(r_tiles, c_tiles, z, e, d, device=device, generator=gen) / (z * k) ** 0.5).half()
    return VQWeight(
        vector_size=d,
        entries=e,
        residuals=z,
        tile_rows=tr,
        tile_cols=tc,
        reindexed=True,
        in_features=k,
        out_features=n,
        indices=pack_codes(codes.reshape(z * n, v), bits).reshape(z, n, -1),
        codebooks=books,
        entry_tiers=tiers.reshape(z, r_tiles, c_tiles, 2).permute(1, 2, 0, 3).contiguous().to(device),
    )


def random_packed(
    n: int,
    k: int,
    bits: int,
    group_size: int | None,
    symmetric: bool,
    device: torch.device,
    gen: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Random grouped_int tensors: every bit pattern of a word is a valid code, so qweight is random int32."""
    words = (k * bits + 31) // 32
    g = group_size or k
    groups = (k + g - 1) // g
    qw = torch.randint(-(2**31), 2**31, (n, words), dtype=torch.int32, device=device, generator=gen)
    tail = (k * bits) % 32
    if tail:  # the spec wants the unused high bits of the last word zero
        qw[:, -1] &= (1 << tail) - 1
    scales = (torch.rand(n, groups, device=device, generator=gen) * 0.004 + 0.002).half()
    zeros = None
    if not symmetric:
        zeros = torch.randint(0, 1 << bits, (n, groups), dtype=torch.uint8, device=device, generator=gen)
    return qw, scales, zeros


WS_FUSIONS = ("direct", "shfl")  # the warp-specialized VQ GEMM's fusions (kernels/vq/gemm_ws.cu F = 0, 1)


class CudaCases:
    def __init__(self, device: int | None = None, seed: int = 0) -> None:
        self.dev = torch.device("cuda", torch.cuda.current_device() if device is None else device)
        props = torch.cuda.get_device_properties(self.dev)
        self.props = props
        self.l2 = int(getattr(props, "L2_cache_size", 50 * 2**20))
        self.gen = torch.Generator(device=self.dev).manual_seed(seed)

    def device_info(self) -> dict[str, Any]:
        try:
            import cupy

            cupy_v = cupy.__version__
        except Exception:
            cupy_v = None
        p = self.props
        return {
            "name": p.name,
            "capability": f"{p.major}.{p.minor}",
            "sms": p.multi_processor_count,
            "l2_mb": round(self.l2 / 2**20, 1),
            "memory_gb": round(p.total_memory / 2**30, 1),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "cupy": cupy_v,
        }

    def _randn(self, *shape: int, dtype: torch.dtype = torch.float16) -> torch.Tensor:
        return torch.randn(*shape, device=self.dev, generator=self.gen, dtype=torch.float32).to(dtype)

    def copy_variants(self) -> list[tuple[str, Fns, int]]:
        numel = 256 * 2**20  # 512 MiB of fp16 each way: far beyond L2
        src = self._randn(numel)
        dst = torch.empty_like(src)
        nbytes = 2 * src.numel() * src.element_size()
        return [
            ("memcpy", [lambda: dst.copy_(src)], nbytes),
            ("elementwise", [lambda: torch.neg(src, out=dst)], nbytes),
        ]

    def matmul_peak(self) -> tuple[Fns, int]:
        s = 8192
        a, b = self._randn(s, s), self._randn(s, s)
        c = torch.empty(s, s, device=self.dev, dtype=torch.float16)
        return [lambda: torch.mm(a, b, out=c)], gemm_flops(s, s, s)

    def launch_floor(self) -> Fns:
        a = torch.zeros(32, device=self.dev)
        b = torch.empty_like(a)
        return [lambda: torch.neg(a, out=b) for _ in range(32)]

    def paths(self, k: int, n: int, m: int, bits: int, group_size: int | None) -> tuple[list[str], str]:
        from qtool.layouts.grouped_int.cuda import (
            FMA_MAX_TOKENS,
            GEMV_MAX_M,
            choose_path,
            mma_eligible,
            unsupported_reason,
        )

        dispatched = choose_path(m, torch.float16, bits, group_size, k, n)
        if unsupported_reason(bits, group_size, k) is not None:
            return ["reference"], "reference"
        cands = ["dequant+cublas"]
        if mma_eligible(torch.float16, group_size, k):
            cands.insert(0, "mma")
        if m <= max(GEMV_MAX_M, 64):
            cands.insert(0, "gemv")
        if m <= FMA_MAX_TOKENS:
            cands.insert(0, "gemv-fma")
        return cands, dispatched

    def quant(
        self, k: int, n: int, m: int, bits: int, group_size: int | None, symmetric: bool, path: str
    ) -> Fns:
        from qtool.layouts.grouped_int import cuda as gi

        r = rotations(quant_bytes(m, n, k, bits, group_size, symmetric), self.l2)
        fns = []
        for _ in range(r):
            qw, sc, z = random_packed(n, k, bits, group_size, symmetric, self.dev, self.gen)
            p = gi.prepare(qw, sc, z, bits, group_size, k, n)
            x = self._randn(m, k)
            if path in ("gemv", "gemv-fma"):
                out = torch.empty(m, n, device=self.dev, dtype=torch.float16)
                op = gi.gemv if path == "gemv" else gi.gemv_fma
                fns.append(lambda x=x, p=p, out=out, op=op: op(x, p, out=out))
            elif path == "mma":
                out = torch.empty(m, n, device=self.dev, dtype=torch.float16)
                fns.append(lambda x=x, p=p, out=out: gi.mma(x, p, out=out))
            elif path == "dequant+cublas":
                fns.append(lambda x=x, p=p: gi.dequant_matmul(x, p))
            else:
                raise ValueError(f"path: found {path!r}, expected gemv-fma, gemv, mma or dequant+cublas")
        return fns

    def fp16(self, k: int, n: int, m: int) -> Fns:
        r = rotations(fp16_bytes(m, n, k), self.l2)
        fns = []
        for _ in range(r):
            w, x = self._randn(n, k), self._randn(m, k)
            out = torch.empty(m, n, device=self.dev, dtype=torch.float16)
            fns.append(lambda w=w, x=x, out=out: torch.matmul(x, w.t(), out=out))
        return fns

    def int8(self, k: int, n: int, m: int) -> tuple[Fns, int]:
        m_eff = max(m, 32)  # torch._int_mm needs M > 16
        r = rotations(n * k + m_eff * k + 4 * m_eff * n, self.l2)
        fns = []
        for _ in range(r):
            a = torch.randint(-128, 128, (m_eff, k), dtype=torch.int8, device=self.dev, generator=self.gen)
            b = torch.randint(-128, 128, (n, k), dtype=torch.int8, device=self.dev, generator=self.gen).t()
            fns.append(lambda a=a, b=b: torch._int_mm(a, b))  # b is [K, N] column-major
        fns[0]()
        return fns, m_eff

    def fp8(self, k: int, n: int, m: int) -> tuple[Fns, int]:
        if (self.props.major, self.props.minor) < (8, 9):
            raise RuntimeError(
                f"FP8 needs compute capability 8.9+, found {self.props.major}.{self.props.minor}"
            )
        m_eff = (m + 15) // 16 * 16  # _scaled_mm wants dimensions divisible by 16
        r = rotations(n * k + m_eff * k + 2 * m_eff * n, self.l2)
        one = torch.ones((), device=self.dev, dtype=torch.float32)
        fns = []
        for _ in range(r):
            a = self._randn(m_eff, k, dtype=torch.float32).to(torch.float8_e4m3fn)
            b = self._randn(n, k, dtype=torch.float32).to(torch.float8_e4m3fn).t()
            fns.append(
                lambda a=a, b=b: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.float16)
            )
        fns[0]()
        return fns, m_eff

    def tinygemm(self, k: int, n: int, m: int, group_size: int) -> tuple[Fns, int]:
        """torchao's int4 kernel on random layers (bfloat16 activations), each layer checked against its
        dequantized weight before any is timed."""
        from qtool.bench import tinygemm as tg

        reason = tg.available(self.dev) or tg.unsupported_reason(k, n, group_size)
        if reason is not None:
            raise RuntimeError(reason)
        r = rotations(n * k // 2 + 4 * n * (k // group_size) + 2 * m * k + 2 * m * n, self.l2)
        fns = []
        for _ in range(r):
            codes, scales, zeros = tg.random_layer(k, n, group_size, self.dev, self.gen)
            p = tg.pack(codes, scales, zeros, group_size)
            x = self._randn(m, k, dtype=torch.bfloat16)
            tg.check(p, codes, scales, zeros, x)
            del codes
            fns.append(lambda x=x, p=p: tg.matmul(x, p))
        return fns, m

    def _mixed_layer(self, k: int, n: int, outlier_fraction: float):
        """A random mixed-2-4-16 layer (random_mixed_weight) prepared for the kernels."""
        from qtool.layouts.mixed import cuda as mixed

        # the checkpoint tensors too: the direct GEMV and dequant + cuBLAS are candidates of the same rows
        return mixed.prepare(
            random_mixed_weight(k, n, outlier_fraction, self.dev, self.gen), keep_checkpoint=True
        )

    def mixed_paths(self, k: int, n: int, m: int, outlier_fraction: float) -> tuple[list[str], str, int]:
        """(candidate paths, the dispatched one, bytes a call must move) of a mixed-2-4-16 row."""
        from qtool.layouts.mixed import cuda as mixed

        cands = []
        if m <= mixed.GEMV_MAX_M:
            cands.append("mixed-gemv")
            if outlier_fraction > 0:
                cands.append("mixed-gemv+spmv")
            cands.append("mixed-gemv-direct")  # the GEMV on the checkpoint layout, beside the tiled one
        gemm = mixed.gemm_capable(self.dev)
        layer = self._mixed_layer(k, n, outlier_fraction)
        if gemm and m > 1:  # the warp-specialized GEMM from 2 tokens: where it overtakes the GEMV
            cands.append("mixed-gemm-ws")
        if m >= mixed.GEMV_MAX_M:
            if gemm:
                cands.append("mixed-gemm")
            cands.append("mixed-dq+cublas")
        path = mixed.choose_path(m, torch.float16, 16, k, gemm)
        if path == "gemm":
            dispatched = "mixed-gemm-ws" if mixed.takes_gemm_ws(m, layer) else "mixed-gemm"
        elif path != "gemv":
            dispatched = "mixed-dq+cublas"
        else:
            fused = mixed.outlier_mode() == "fused"
            dispatched = "mixed-gemv" if fused or outlier_fraction == 0 else "mixed-gemv+spmv"
        nbytes = layer.nbytes() + 2 * m * k + 2 * m * n
        return cands, dispatched, nbytes

    def mixed(self, k: int, n: int, m: int, outlier_fraction: float, path: str) -> Fns:
        from qtool.layouts.mixed import cuda as mixed

        first = self._mixed_layer(k, n, outlier_fraction)
        fns = []
        for i in range(rotations(first.nbytes() + 2 * m * k + 2 * m * n, self.l2)):
            p = first if i == 0 else self._mixed_layer(k, n, outlier_fraction)
            x = self._randn(m, k)
            out = torch.empty(m, n, device=self.dev, dtype=torch.float16)
            if path == "mixed-gemv":
                fns.append(lambda x=x, p=p, out=out: mixed.gemv(x, p, out=out, outliers="fused"))
            elif path == "mixed-gemv+spmv":
                fns.append(lambda x=x, p=p, out=out: mixed.gemv(x, p, out=out, outliers="spmv"))
            elif path == "mixed-gemv-direct":
                fns.append(
                    lambda x=x, p=p, out=out: mixed.gemv(x, p, out=out, outliers="fused", layout="direct")
                )
            elif path == "mixed-gemm":
                fns.append(lambda x=x, p=p, out=out: mixed.gemm(x, p, out=out))
            elif path == "mixed-gemm-ws":
                fns.append(lambda x=x, p=p, out=out: mixed.gemm_ws(x, p, out=out))
            elif path == "mixed-dq+cublas":
                fns.append(lambda x=x, p=p: mixed.dequant_matmul(x, p))
            else:
                raise ValueError(
                    f"path: found {path!r}, expected mixed-gemv, mixed-gemv+spmv, mixed-gemv-direct, "
                    "mixed-gemm, mixed-gemm-ws or mixed-dq+cublas"
                )
        return fns

    def _vq_layer(self, k: int, n: int, preset: str, copy: int):
        """A random re-indexed VQ layer of the preset's configuration (random_vq_weight) prepared for the kernels.
        Layers are kept per (shape, preset) and copy, so every M and cache variant times the same weights."""
        from qtool.layouts.vq import cuda as vq

        key = (k, n, preset, copy)
        cache = self.__dict__.setdefault("_vq_layers", {})
        if key in cache:
            return cache[key]
        if cache and next(iter(cache))[:2] != (k, n):
            cache.clear()  # one shape at a time
        p = vq.prepare(random_vq_weight(k, n, preset, self.dev, self.gen))
        cache[key] = p
        return p

    def vq_info(self, k: int, n: int, m: int, preset: str, cache: str) -> tuple[int, dict[str, Any]]:
        """(bytes a call must move: indices, codebooks, x and y once; the launch plan with its measured inputs)."""
        from qtool.layouts.vq import cuda as vq

        p = self._vq_layer(k, n, preset, 0)
        plan = vq.plan_for(p, vq.token_slots(m), cache, self.dev.index)
        info = {
            f: getattr(plan, f)
            for f in (
                "form",
                "n_reg",
                "n_shared",
                "splits",
                "rows_per_block",
                "grid_x",
                "smem",
                "balance",
                "wk",
                "tiles_per_split",
                "cluster",
                "prefetch",
                "dependent",
            )
        }
        return p.nbytes() + 2 * m * k + 2 * m * n, {**info, **plan.why, "hot": p.hot}

    def vq(self, k: int, n: int, m: int, preset: str, cache: str, form: str | None = None) -> Fns:
        """The GEMV of the `cache` variant, in the dispatched form unless `form` names the other."""
        from qtool.layouts.vq import cuda as vq

        form = form or vq.DEFAULT_FORM

        first = self._vq_layer(k, n, preset, 0)
        fns = []
        for i in range(rotations(first.nbytes() + 2 * m * k + 2 * m * n, self.l2)):
            p = self._vq_layer(k, n, preset, i)
            x = self._randn(m, k)
            out = torch.empty(m, n, device=self.dev, dtype=torch.float16)
            fns.append(lambda x=x, p=p, out=out: vq.gemv(x, p, out=out, cache=cache, form=form))
        return fns

    def _vq_gemm_layer(self, k: int, n: int, preset: str, copy: int):
        """The GEMV's random layer of that copy (above) as the fused GEMM takes it."""
        from qtool.layouts.vq import cuda_gemm as vq_gemm
        from qtool.stages.vq import PRESETS

        c, p = PRESETS[preset], self._vq_layer(k, n, preset, copy)
        return vq_gemm.prepare(
            p.indices,
            p.codebooks,
            c["vector_size"],
            c["entries"],
            c["residuals"],
            k,
            n,
            c["tile_rows"],
            c["tile_cols"],
        )

    def vq_gemm_paths(self, k: int, n: int, m: int, preset: str) -> tuple[list[str], str, int, int]:
        """(candidate paths, the dispatched one, bytes a call must move, index bits per weight) of a VQ GEMM row: one
        path per way the decoded entries reach the MMA fragments (`vq-gemm-<fusion>`), and where it is built the
        warp-specialized GEMM's (regs form `vq-gemm-ws-<fusion>`, tile form `vq-gemm-wst`); the default
        dispatched."""
        from qtool.layouts.vq import cuda_gemm as vq_gemm

        p = self._vq_gemm_layer(k, n, preset, 0)
        nbytes = p.indices.numel() * 4 + p.codebooks.numel() * 2 + 2 * m * k + 2 * m * n
        tn = vq_gemm.tokens_for(p.config, m)
        fusions = [f for f in vq_gemm.FUSIONS if vq_gemm.fusion_reason(p, f, tn) is None]
        default = vq_gemm.DEFAULT_FUSION[p.config]
        default = default if default in fusions else "direct"
        ws = (
            [f"vq-gemm-ws-{f}" for f in WS_FUSIONS] + ["vq-gemm-wst"]
            if p.config in vq_gemm.WS_CONFIGS
            else []
        )
        if ws and vq_gemm.GEMM_WS:
            default = f"ws-{default}"
        return (
            [f"vq-gemm-{f}" for f in fusions] + ws,
            f"vq-gemm-{default}",
            nbytes,
            p.residuals * p.index_bits // p.vector_size,
        )

    def vq_gemm(self, k: int, n: int, m: int, preset: str, path: str) -> Fns:
        from qtool.layouts.vq import cuda_gemm as vq_gemm

        form = "tile" if path == "vq-gemm-wst" else "regs"
        fusion = "direct" if form == "tile" else path.removeprefix("vq-gemm-").removeprefix("ws-")
        ws = path.startswith("vq-gemm-ws")
        if not path.startswith("vq-gemm-") or fusion not in (WS_FUSIONS if ws else vq_gemm.FUSIONS):
            raise ValueError(
                f"path: found {path!r}, expected vq-gemm-<{'|'.join(vq_gemm.FUSIONS)}>, "
                f"vq-gemm-ws-<{'|'.join(WS_FUSIONS)}> or vq-gemm-wst"
            )
        gemm = functools.partial(vq_gemm.gemm_ws, form=form) if ws else vq_gemm.gemm
        first = self._vq_gemm_layer(k, n, preset, 0)
        set_bytes = first.indices.numel() * 4 + first.codebooks.numel() * 2 + 2 * m * k + 2 * m * n
        fns = []
        for i in range(rotations(set_bytes, self.l2)):
            p = self._vq_gemm_layer(k, n, preset, i)
            x = self._randn(m, k)
            out = torch.empty(m, n, device=self.dev, dtype=torch.float16)
            fns.append(lambda x=x, p=p, out=out: gemm(x, p, out=out, fusion=fusion))
        return fns

    def w4a8(self, k: int, n: int, m: int, group_size: int | None, path: str) -> Fns:
        """The qoq W4A8 layer on random valid fields (s1 <= 8 keeps every z in [0, 15] valid): "w4a8" is the
        float16 layer call (qoq.linear), "w4a8-gemm" qoq.gemm on codes quantized beforehand (kernels/NOTES.md)."""
        from qtool.layouts.qoq import cuda as qoq

        groups = k // group_size if group_size else 1
        fns = []
        for _ in range(rotations(n * k // 2 + 4 * n * groups + 3 * m * k + 2 * m * n, self.l2)):
            qw = torch.randint(
                -(2**31), 2**31, (n, k // 8), dtype=torch.int32, device=self.dev, generator=self.gen
            )
            scales = (torch.rand(n, device=self.dev, generator=self.gen) * 0.004 + 0.002).half()
            zeros = torch.randint(
                0,
                16,
                (n, groups) if group_size else (n,),
                dtype=torch.uint8,
                device=self.dev,
                generator=self.gen,
            )
            s1 = (
                torch.randint(1, 9, (n, groups), dtype=torch.uint8, device=self.dev, generator=self.gen)
                if group_size
                else None
            )
            p = qoq.build(4, group_size, k, qw, scales, zeros, s1, None)
            x = self._randn(m, k)
            if path == "w4a8":
                fns.append(lambda x=x, p=p: qoq.linear(x, p))
            elif path == "w4a8-gemm":
                a = qoq.quantize_activations(x, p)
                fns.append(lambda a=a, p=p: qoq.gemm(a, p))
            else:
                raise ValueError(f"path: found {path!r}, expected one of w4a8, w4a8-gemm")
        return fns


class QuikCudaCases(CudaCases):
    """Adds the quik kernels: random packed layers built on the GPU (every code word is valid)."""

    def _quik_layer(self, k: int, n: int, bits: int, outliers: int):
        from qtool.layouts.quik import cuda as quik

        perm = torch.randperm(k, device=self.dev, generator=self.gen)
        idx = perm[:outliers].sort().values.to(torch.int32)
        keep = torch.ones(k, dtype=torch.bool, device=self.dev)
        keep[idx.long()] = False
        base_idx = torch.nonzero(keep)[:, 0].to(torch.int32)
        words = (k - outliers + 127) // 128 * 128 * bits // 32
        return quik.build(
            bits,
            bits,
            k,
            torch.randint(
                -(2**31), 2**31, (n, words), dtype=torch.int32, device=self.dev, generator=self.gen
            ),
            (torch.rand(n, device=self.dev, generator=self.gen) * 0.004 + 0.002).half(),
            # Timing only: wreduced need not match the random codes (the kernels read it, never check it).
            torch.randn(n, device=self.dev, generator=self.gen),
            self._randn(n, outliers) * 0.05,
            base_idx,
            idx,
            None,
        )

    def quik(self, k: int, n: int, m: int, bits: int, outliers: int, rung: str) -> Fns:
        from qtool.layouts.quik import cuda as quik

        set_bytes = n * k * bits // 8 + 2 * n * outliers + 2 * m * k + 2 * m * n
        fns = []
        for _ in range(rotations(set_bytes, self.l2)):
            p = self._quik_layer(k, n, bits, outliers)
            x = self._randn(m, k)
            if rung == "fused":  # what a model runs: the dispatch's choice of the two forms below
                fns.append(lambda x=x, p=p: quik.linear(x, p))
            elif rung == "two-kernel":
                fns.append(lambda x=x, p=p: quik.gemm(quik.quantize(x, p), p))
            elif rung == "one-kernel":
                reason = quik.fused_quantize_reason(x, p)
                if reason is not None:
                    raise ValueError(reason)
                fns.append(lambda x=x, p=p: quik.quantize_gemm(x, p)[0])
            elif rung == "fused-quant":
                fns.append(
                    lambda x=x, p=p: quik.epilogue_torch(
                        quik.gemm(a := quik.quantize(x, p), p, fused=False), a, p
                    )
                )
            elif rung == "unfused":
                fns.append(
                    lambda x=x, p=p: quik.epilogue_torch(
                        quik.gemm(a := quik.quantize_torch(x, p), p, fused=False), a, p
                    )
                )
            else:
                raise ValueError(
                    f"rung: found {rung!r}, expected unfused, fused-quant, fused, two-kernel or one-kernel"
                )
        return fns
