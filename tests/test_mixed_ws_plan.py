"""The CPU side of the warp-specialized mixed-2-4-16 GEMM (kernels/mixed/gemm_ws.cu, qtool/layouts/mixed/cuda.py
`gemm_ws`): its builds (two forms) and their shared memory, the plan, and the row decode both Hopper GEMMs share
(kernels/mixed/tiled.cuh MixedRow), replayed here with the kernel's bit operations and fp16 roundings."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from qtool.cuda import f16_ws
from qtool.layouts.mixed import cuda as mixed
from qtool.resources import kernels_dir


def test_builds_are_the_kernel_entries_and_fit():
    src = (kernels_dir() / "mixed" / "gemm_ws.cu").read_text()
    regs = re.findall(r"^MIXED_GEMM_WS_ENTRY\((\d+), (\d+), (\d+)\)", src, flags=re.M)
    tile = re.findall(r"^MIXED_GEMM_WST_ENTRY\((\d+), (\d+), (\d+), (\d+)\)", src, flags=re.M)
    built = {("regs", int(tn)): (int(sc), 0, int(b)) for tn, sc, b in regs}
    built |= {("tile", int(tn)): (int(sc), int(sa), int(b)) for tn, sc, sa, b in tile}
    assert built == mixed.GEMM_WS_BUILT
    assert all(mixed.gemm_ws_fits(f, tn) for f, tn in mixed.GEMM_WS_BUILT)
    assert {tn for _, tn in mixed.GEMM_WS_BUILT} == set(mixed.GEMM_WS_TOKENS)
    assert all(
        (f, tn) in mixed.GEMM_WS_BUILT for f in mixed.GEMM_WS_FORM.values() for tn in mixed.GEMM_WS_TOKENS
    )
    # copy slots of the activation tile and 3472 bytes of tiled words, 16 KB per decoded tile, the alignment slack
    assert mixed.gemm_ws_smem(16, 7, 4) == 7 * 6 * 1024 + 4 * 16384 + 1024
    assert mixed.gemm_ws_smem(128, 11, 0) == 11 * 20 * 1024 + 1024
    assert mixed.gemm_ws_entry("regs", 128) == "mixed_gemm_ws_n128_s11"
    assert ("regs", 256) not in mixed.GEMM_WS_BUILT  # 224 registers x 3 warps on one scheduler do not launch
    assert mixed.gemm_ws_entry("tile", 64) == "mixed_gemm_wst_n64_s12_a4"
    # each ring as deep as fits the blocks per SM its registers allow, up to 12 copy slots
    for (f, tn), (sc, sa, blocks) in mixed.GEMM_WS_BUILT.items():
        assert f16_ws.deepest(tn, mixed.GEMM_WS_WORDS, sc, sa, blocks), (f, tn)


def test_plan():
    ms = (1, 16, 17, 32, 33, 64, 65, 128, 129, 256, 300, 2048)
    tiles = [16, 16, 32, 32, 64, 64, 128, 128, 128, 128, 128, 128]
    assert [mixed.gemm_ws_plan(m) for m in ms] == [("regs", t) for t in tiles]
    assert [mixed.gemm_ws_plan(m, outliers=True) for m in ms] == [("tile", t) for t in tiles]
    assert mixed.gemm_ws_plan(5, tokens=64, outliers=True) == ("tile", 64)
    assert mixed.gemm_ws_plan(5, form="regs") == ("regs", 16)
    assert mixed.gemm_ws_plan(300, tokens=128, form="tile") == ("tile", 128)
    assert mixed.gemm_ws_plan(300, form="tile") == ("tile", 128)
    with pytest.raises(ValueError, match="tokens, form: found 256, 'tile'"):
        mixed.gemm_ws_plan(300, tokens=256, form="tile")
    with pytest.raises(ValueError, match="tokens, form: found 48"):
        mixed.gemm_ws_plan(40, tokens=48)
    # Llama-2-7B o_proj at 16 tokens, two blocks per SM on 132 SMs: 32 tiles split 8 ways
    assert mixed.plan_split(4096, 16, 4096, 16, 2, 132) == 8


def test_gemm_path_takes_gemm_ws_up_to_its_limit_or_with_outliers(monkeypatch):
    from types import SimpleNamespace

    monkeypatch.setattr(mixed, "GEMM_WS", 1)
    top = mixed.GEMM_WS_MAX_M
    plain, spiky = SimpleNamespace(nnz=0), SimpleNamespace(nnz=5)
    assert [mixed.takes_gemm_ws(m, plain) for m in (5, top, top + 1, 4096)] == [True, True, False, False]
    assert all(mixed.takes_gemm_ws(m, spiky) for m in (17, top + 1, 4096))
    monkeypatch.setattr(mixed, "GEMM_WS", 0)
    assert not any(mixed.takes_gemm_ws(m, p) for m in (17, 4096) for p in (plain, spiky))


def _h(bits: np.ndarray) -> np.ndarray:
    """fp16 values (float64) of half bit patterns."""
    return bits.astype(np.uint16).view(np.float16).astype(np.float64)


def _bits(v: np.ndarray) -> np.ndarray:
    """float64 values rounded once to fp16 (round to nearest even), as bit patterns."""
    return v.astype(np.float16).view(np.uint16).astype(np.uint64)


def _halves(f, *words: np.ndarray) -> np.ndarray:
    """f applied to each half of 32-bit words (as fp16 values), rounded once per half: an f16x2 instruction."""
    with np.errstate(over="ignore", invalid="ignore"):  # the 3e3 scales reach fp16's infinity, as on the GPU
        lo = _bits(f(*[_h(w & 0xFFFF) for w in words]))
        hi = _bits(f(*[_h((w >> 16) & 0xFFFF) for w in words]))
    return lo | (hi << 16)


MAG0, MAG4, MAGI = 0x4C004C00, 0x3C003C00, 0x64006400


def _finish(m, nz, cu, sc):
    d = _halves(lambda a, b: a * 64 + b, m, nz)  # h2fma(m, 64, nz): exact
    if cu is not None:
        d = _halves(lambda a, b: a * b, d, cu)
    return _halves(lambda a, b: a * b, d, sc)


def _decoded_rows(t: mixed.Tiled, binfo: torch.Tensor, n: int, k: int, g2: int, form: str) -> torch.Tensor:
    """The dense weight as gemm_ws's tile form writes it (form "two": decode_stage, MixedRow::load and ::two, the
    chunk order of a row) or as its regs form's and gemm.cu's lanes decode their fragments ("pair": MixedRow::pair,
    one field per shift), each k16
    step placed at its stripe's columns (kcols), fp16."""
    nblk = k // 64
    w = lambda x: x.numpy().astype(np.int64).astype(np.uint64) & 0xFFFFFFFF  # noqa: E731
    ta, tm = w(t.ta).reshape(n, nblk, 4), w(t.tm).reshape(n, nblk, 2)
    tz, tt = w(t.tz), w(t.tt).reshape(-1, nblk, 2)
    rows = np.arange(n)
    zb = tz[rows // 4] >> (8 * (rows % 4))[:, None].astype(np.uint64)  # [n, nblk]
    S = tt[rows // g2]  # [n, nblk, 2]
    W = tm
    words = [ta[..., 0], ta[..., 1], ta[..., 2], ta[..., 3], W[..., 0]]
    dense = np.zeros((n, nblk, 4, 16), dtype=np.uint64)

    def prmt_lo(x):
        return (x & 0xFFFF) * 0x10001

    sc = [prmt_lo(S[..., 0]), prmt_lo(S[..., 0] >> 16), prmt_lo(S[..., 1]), prmt_lo(W[..., 1])]
    for i in range(4):
        if i < 3:
            z = (zb >> (2 * i)) & 3
            c = (W[..., 1] >> (16 + 4 * i)) & 15
            u = (S[..., 1] >> (16 + 4 * i)) & 15
            cu = _halves(lambda a, b: a - b, ((c + u) * 0x10001) | MAGI, np.full_like(c, MAGI))
        else:
            z, cu = W[..., 1] >> 28, None
        nz = z * 0x10001 + 0xE400E400
        nz4 = (z << 4) * 0x10001 + 0xD400D400
        v = [None] * 8
        if form == "pair":
            for f in range(8):
                if i < 3:
                    v[f] = _finish(((words[i] >> (2 * f)) & 0x00030003) | MAG0, nz, cu, sc[i])
                else:
                    sh = (words[3] if f < 4 else words[4]) >> (4 * (f & 3))
                    v[f] = _finish((sh & 0x000F000F) | MAG0, nz, None, sc[3])
        elif i < 3:
            for f in (0, 1, 4, 5):
                sh = words[i] >> (2 * f)
                v[f] = _finish((sh & 0x00030003) | MAG0, nz, cu, sc[i])
                v[f + 2] = _finish((sh & 0x00300030) | MAG4, nz4, cu, sc[i])
        else:
            for f in (0, 2, 4, 6):
                sh = (words[3] if f < 4 else words[4]) >> (4 * (f & 3))
                v[f] = _finish((sh & 0x000F000F) | MAG0, nz, None, sc[3])
                v[f + 1] = _finish((sh & 0x00F000F0) | MAG4, nz4, None, sc[3])
        for f in range(8):  # field f: columns 2f, 2f + 1 of the step, low and high half
            dense[..., i, 2 * f] = v[f] & 0xFFFF
            dense[..., i, 2 * f + 1] = v[f] >> 16
    info = w(binfo)
    pos = np.stack([(info >> (24 + 2 * i)) & 3 for i in range(4)], axis=-1).astype(np.int64)  # [nblk, 4]
    out = np.zeros_like(dense)
    np.put_along_axis(out, np.broadcast_to(pos[None, :, :, None], dense.shape), dense, axis=2)
    return torch.from_numpy(out.reshape(n, k).astype(np.uint16).view(np.float16))


@pytest.mark.parametrize("form", ["two", "pair"])
@pytest.mark.parametrize("n,k,g2,scale", [(36, 320, 4, 1.0), (64, 1024, 16, 1e-3), (24, 128, 12, 3e3)])
def test_row_decode_is_the_reference_cast_bit_for_bit(n, k, g2, scale, form):
    """Every weight as the exact (q - z)·ŝ rounded once, as layer.dense().half() casts it: random codes, scales
    spread over the fp16 range (subnormal products at 1e-3, 64·s past fp16's largest at 3e3)."""
    from qtool.layouts.mixed.layout import MixedWeight

    g = torch.Generator().manual_seed(n * k + g2)
    s = k // 16
    is4 = torch.zeros(s, dtype=torch.bool)
    is4[torch.arange(s // 4) * 4 + torch.randint(0, 4, (s // 4,), generator=g)] = True
    s4, s2 = s // 4, s - s // 4
    codes = torch.randint(0, 4, (n, k), generator=g)
    cols4 = is4.repeat_interleave(16)
    codes[:, cols4] = torch.randint(0, 16, (n, int(cols4.sum())), generator=g)
    nh = -(-n // g2)
    spread = lambda *shape: scale * torch.exp(torch.randn(*shape, generator=g) * 2)  # noqa: E731
    layer = MixedWeight.from_codes(
        codes,
        is4,
        16,
        g2,
        "block4",
        torch.randint(0, 16, (n, s2), generator=g),
        torch.randint(0, 4, (n, s2), generator=g),
        spread(nh, s2),
        torch.randint(0, 16, (nh, s2), generator=g),
        spread(n, s4),
        torch.randint(0, 16, (n, s4), generator=g),
        torch.zeros(0, dtype=torch.long),
        torch.zeros(0, dtype=torch.long),
        torch.zeros(0),
    )
    binfo, _ = mixed.block_info(layer.stripe_bits)
    t = mixed.tiled_streams(
        layer.qweight_a,
        layer.qweight_b,
        layer.scale_codes,
        layer.zeros2,
        layer.scales_2nd,
        layer.zeros_2nd,
        layer.scales4,
        layer.zeros4,
        binfo,
        g2,
    )
    got = _decoded_rows(t, binfo, n, k, g2, form)
    ref = layer.dense().half()
    same = (got.view(torch.int16) == ref.view(torch.int16)) | (got.isnan() & ref.isnan())
    assert bool(same.all()), f"{int((~same).sum())} of {same.numel()} weights differ"


def _layer_with_outliers(n: int, k: int, rows: torch.Tensor, cols: torch.Tensor, seed: int):
    """A random block4 layer (g2 4) whose outliers sit at (rows, cols), each in a 2-bit stripe."""
    from qtool.layouts.mixed.layout import MixedWeight

    g = torch.Generator().manual_seed(seed)
    s = k // 16
    is4 = torch.zeros(s, dtype=torch.bool)
    is4[torch.arange(s // 4) * 4 + torch.randint(0, 4, (s // 4,), generator=g)] = True
    codes = torch.randint(0, 4, (n, k), generator=g)
    cols4 = is4.repeat_interleave(16)
    codes[:, cols4] = torch.randint(0, 16, (n, int(cols4.sum())), generator=g)
    s2, s4, nh = s - s // 4, s // 4, -(-n // 4)
    layer = MixedWeight.from_codes(
        codes,
        is4,
        16,
        4,
        "block4",
        torch.randint(0, 16, (n, s2), generator=g),
        torch.randint(0, 4, (n, s2), generator=g),
        torch.rand(nh, s2, generator=g) * 0.01 + 1e-3,
        torch.randint(0, 16, (nh, s2), generator=g),
        torch.rand(n, s4, generator=g) * 0.01 + 1e-3,
        torch.randint(0, 16, (n, s4), generator=g),
        rows,
        cols,
        torch.randn(rows.numel(), generator=g) * 0.5,
    )
    return layer, is4


def _two_bit_positions(is4: torch.Tensor, n: int, count: int, g: torch.Generator):
    """`count` distinct (rows, cols) in the 2-bit stripes of an [n, 16·len(is4)] weight."""
    cols2 = torch.nonzero(~is4.repeat_interleave(16)).flatten()
    flat = torch.randperm(n * cols2.numel(), generator=g)[:count]
    return flat // cols2.numel(), cols2[flat % cols2.numel()]


def _view(layer) -> mixed.Prepared:
    """The kernel view's outlier fields of a CPU layer (what tile_outliers reads)."""
    binfo, block4 = mixed.block_info(layer.stripe_bits)
    return mixed.Prepared(
        binfo=binfo,
        rowptr=layer.outlier_rowptr,
        ocols=layer.outlier_cols,
        ovals=layer.outlier_values,
        in_features=layer.in_features,
        out_features=layer.out_features,
        scale_group_size=layer.scale_group_size,
        s2=int(layer.scales_2nd.shape[1]),
        s4=int(layer.scales4.shape[1]),
        block4=block4,
        nnz=int(layer.outlier_values.numel()),
        source_ptr=0,
    )


def _replay(layer, ot: mixed.TileOutliers) -> tuple[torch.Tensor, list]:
    """The dense fp16 weight with the tile entries added as the tile form adds them (row r of block b, column
    16 i + j of stage gs: stripe pos[i] of binfo, channel j; the fp16 sum), and the (row, col) of each entry."""
    n, k = layer.out_features, layer.in_features
    nblk, nb = k // 64, -(-n // 128)
    optr, olist = ot.optr.to(torch.int64), ot.olist.to(torch.int64) & 0xFFFFFFFF
    assert optr.shape == (nb * nblk + 1,) and int(optr[0]) == 0 and bool((optr[1:] >= optr[:-1]).all())
    assert int((optr[1:] - optr[:-1]).max()) <= mixed.GEMM_WS_OUT_CAP
    info = mixed.block_info(layer.stripe_bits)[0].to(torch.int64) & 0xFFFFFFFF
    pos = torch.stack([(info >> (24 + 2 * i)) & 3 for i in range(4)], dim=-1)
    got, seen = layer.dense().half(), []
    for key in range(nb * nblk):
        b, gs = divmod(key, nblk)
        for e in olist[optr[key] : optr[key + 1]].tolist():
            off, bits = e & 0xFFFF, e >> 16
            r, tc = off >> 6, off & 63
            row, col = 128 * b + r, 64 * gs + 16 * int(pos[gs, tc // 16]) + tc % 16
            seen.append((row, col))
            v = torch.tensor([bits], dtype=torch.int32).to(torch.int16).view(torch.float16)
            got[row, col] = (got[row, col].float() + v.float()).half()
    return got, seen


@pytest.mark.parametrize("n,k", [(300, 320), (128, 4096), (36, 128)])
def test_tile_outliers_land_where_the_dense_weight_adds_them(n, k):
    """Each entry, read as the tile form reads it, names an outlier of the layer, once; added as the tile adds it,
    the dense weight is the dequantize kernel's (mixed_outliers_into_dense): the fp16 sum at every outlier."""
    g = torch.Generator().manual_seed(n + k)
    # the stripes first (a layer without outliers of the same seed), so that the outliers avoid the 4-bit ones
    layer, is4 = _layer_with_outliers(
        n, k, torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), 7
    )
    rows, cols = _two_bit_positions(is4, n, max(1, n * k // 500), g)
    layer, _ = _layer_with_outliers(n, k, rows, cols, 7)  # same seed: the same stripes and codes
    ot = mixed.tile_outliers(_view(layer))
    assert ot is not None and ot.rest is None
    got, seen = _replay(layer, ot)
    r0, c0, v0 = layer.outliers()
    want = layer.dense().half()
    want[r0, c0] = (want[r0, c0].float() + v0.half().float()).half()
    assert sorted(seen) == sorted(zip(r0.tolist(), c0.tolist(), strict=True))
    assert bool((got.view(torch.int16) == want.view(torch.int16)).all())


def test_outliers_past_a_block_stage_cap_are_left_to_spmv():
    """A block-stage with more outliers than the copy slot holds: the first GEMM_WS_OUT_CAP in CSR order go into the
    tile, the rest into `rest` (a CSR view of only them, for mixed_spmv); together, each outlier once."""
    n, k = 256, 256
    g = torch.Generator().manual_seed(3)
    _, is4 = _layer_with_outliers(n, k, torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), 5)
    two = torch.nonzero(~is4[:4].repeat_interleave(16)).flatten()  # block 0's stage 0: its 48 2-bit columns
    flat = torch.randperm(128 * two.numel(), generator=g)[: mixed.GEMM_WS_OUT_CAP + 9]
    r1, c1 = _two_bit_positions(is4, n, 200, g)  # and some elsewhere
    away = (r1 >= 128) | (c1 >= 64)
    rows = torch.cat([flat // two.numel(), r1[away]])
    cols = torch.cat([two[flat % two.numel()], c1[away]])
    layer, _ = _layer_with_outliers(n, k, rows, cols, 5)
    ot = mixed.tile_outliers(_view(layer))
    assert ot.rest is not None and ot.rest.nnz == 9
    _, seen = _replay(layer, ot)
    assert len(seen) == rows.numel() - 9
    rest = ot.rest
    counts = (rest.rowptr[1:] - rest.rowptr[:-1]).to(torch.int64)
    left = list(
        zip(
            torch.repeat_interleave(torch.arange(n), counts).tolist(),
            (rest.ocols.to(torch.int64) & 0xFFFF).tolist(),
            strict=True,
        )
    )
    r0, c0, _ = layer.outliers()
    assert sorted(seen + left) == sorted(zip(r0.tolist(), c0.tolist(), strict=True))
    assert all(r < 128 and c < 64 for r, c in left)
    # the CSR order within the block-stage: the kept ones come first
    in00 = [(r, c) for r, c in zip(r0.tolist(), c0.tolist(), strict=True) if r < 128 and c < 64]
    assert sorted(left) == sorted(in00[mixed.GEMM_WS_OUT_CAP :])
    assert mixed.tile_outliers(_view(_layer_with_outliers(n, k, rows[:0], cols[:0], 5)[0])) is None
