"""The CPU side of the mixed-2-4-16 kernels' dispatch (qtool/layouts/mixed/cuda.py): the per-block table the kernels read,
which layers and calls they take, and the reference forward still used without a GPU."""

from __future__ import annotations

import pytest
import torch

from qtool.layouts.mixed import cuda as mixed


def _decode(info: int) -> tuple[int, int, list[int]]:
    info &= 0xFFFFFFFF
    return info & 0xFFFF, (info >> 16) & 7, [(info >> (24 + 2 * i)) & 3 for i in range(4)]


def test_block_info_ranks_counts_and_stripe_order():
    bits = torch.tensor([4, 2, 2, 2, 2, 2, 4, 2, 4, 4, 4, 4, 2, 2, 2, 2, 2, 4, 2, 4], dtype=torch.uint8)
    info, block4 = mixed.block_info(bits)
    assert info.dtype == torch.int32 and not block4
    assert [_decode(int(v)) for v in info] == [
        (0, 1, [1, 2, 3, 0]),
        (1, 1, [0, 1, 3, 2]),
        (2, 4, [0, 1, 2, 3]),
        (6, 0, [0, 1, 2, 3]),
        (6, 2, [0, 2, 1, 3]),
    ]
    _, block4 = mixed.block_info(torch.tensor([2, 4, 2, 2, 2, 2, 2, 4], dtype=torch.uint8))
    assert block4


def test_paths_and_unsupported_layers():
    assert mixed.choose_path(1, torch.float16, 16, 4096) == "gemv"
    assert mixed.choose_path(16, torch.float16, 16, 4096) == "gemv"
    assert mixed.choose_path(17, torch.float16, 16, 4096) == "dequant+cublas"
    assert mixed.choose_path(1, torch.bfloat16, 16, 4096) == "reference"
    assert mixed.choose_path(1, torch.float16, 32, 4096) == "reference"
    assert mixed.unsupported_reason(16, 4096) is None
    assert "multiple of 64" in mixed.unsupported_reason(16, 4112)
    assert "cover 16" in mixed.unsupported_reason(8, 4096)
    assert [mixed.token_slots(m) for m in (1, 2, 3, 5, 9, 16)] == [1, 2, 4, 8, 16, 16]
    assert mixed.gemv_warps(4096, 4) == 2 and mixed.gemv_warps(11008, 4) == 4 and mixed.gemv_warps(64, 8) == 1
    assert mixed.outlier_mode("spmv") == "spmv" and mixed.outlier_mode() == mixed.OUTLIERS
    with pytest.raises(ValueError, match="outliers: found 'both'"):
        mixed.outlier_mode("both")


def _tiled_dense(t: mixed.Tiled, binfo: torch.Tensor, n: int, k: int, g2: int) -> torch.Tensor:
    """The dense weight as the tiled GEMV reads its streams (kernels/mixed/gemv.cu, "The tiled GEMV"): codes 2j and
    2j+1 of a word in field j of its low and high halves, the scale codes, zeros and second-order entries where
    the kernel takes them."""
    nblk = k // 64
    w = lambda x: x.to(torch.int64) & 0xFFFFFFFF  # noqa: E731
    ta, tm = w(t.ta).reshape(n, nblk, 4), w(t.tm).reshape(n, nblk, 2)
    tz, tt = w(t.tz), w(t.tt).reshape(-1, nblk, 2)
    half = lambda bits: (bits & 0xFFFF).to(torch.int16).view(torch.float16).to(torch.float32)  # noqa: E731
    rows = torch.arange(n)
    zrow = tz[rows // 4] >> (8 * (rows % 4))[:, None]  # [n, nblk]
    h = rows // g2
    s2 = torch.stack([half(tt[..., 0]), half(tt[..., 0] >> 16), half(tt[..., 1])], dim=-1)[h]  # [n, nblk, 3]
    u = torch.stack([(tt[..., 1] >> (16 + 4 * i)) & 15 for i in range(3)], dim=-1)[h]
    my = tm[..., 1]
    out = torch.empty(n, nblk, 4, 16)
    pos = torch.stack([(w(binfo) >> (24 + 2 * i)) & 3 for i in range(4)], dim=-1)  # [nblk, 4]
    for i in range(3):
        q = torch.stack([(ta[..., i] >> (2 * (j // 2) + 16 * (j % 2))) & 3 for j in range(16)], dim=-1)
        z = (zrow >> (2 * i)) & 3
        c = (my >> (16 + 4 * i)) & 15
        out[:, :, i] = (q - z[..., None]) * ((c + u[..., i]) * s2[..., i])[..., None]
    q = torch.stack(
        [
            ((ta[..., 3] if j < 8 else tm[..., 0]) >> (4 * ((j % 8) // 2) + 16 * (j % 2))) & 15
            for j in range(16)
        ],
        dim=-1,
    )
    out[:, :, 3] = (q - (my >> 28)[..., None]) * half(my)[..., None]
    dense = torch.empty(n, nblk, 4, 16)
    dense.scatter_(2, pos[None, :, :, None].expand(n, nblk, 4, 16), out)
    return dense.reshape(n, k)


@pytest.mark.parametrize("n,k,g2", [(36, 320, 4), (64, 1024, 16), (24, 64, 12)])
def test_tiled_streams_hold_the_checkpoint_layer(n, k, g2):
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
    layer = MixedWeight.from_codes(
        codes,
        is4,
        16,
        g2,
        "block4",
        torch.randint(0, 16, (n, s2), generator=g),
        torch.randint(0, 4, (n, s2), generator=g),
        torch.rand(nh, s2, generator=g) + 0.1,
        torch.randint(0, 16, (nh, s2), generator=g),
        torch.rand(n, s4, generator=g) + 0.1,
        torch.randint(0, 16, (n, s4), generator=g),
        torch.zeros(0, dtype=torch.long),
        torch.zeros(0, dtype=torch.long),
        torch.zeros(0),
    )
    binfo, block4 = mixed.block_info(layer.stripe_bits)
    assert block4 and mixed.tiled_eligible(block4, g2) and not mixed.tiled_eligible(block4, 6)
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
    assert [tuple(x.shape) for x in (t.ta, t.tm, t.tz, t.tt)] == [
        (n, k // 16),
        (n, k // 32),
        (-(-n // 4), k // 64),
        (nh, k // 32),
    ]
    assert all(x.dtype == torch.int32 and x.is_contiguous() for x in (t.ta, t.tm, t.tz, t.tt))
    assert torch.equal(_tiled_dense(t, binfo, n, k, g2), layer.dense())


def test_tiled_config_and_layout_choice():
    # 4-row blocks; the next block's loads ahead of the arithmetic at one token only
    assert mixed.tiled_config(4096, 1) == (4, mixed.gemv_warps(4096, mixed.TILED_WARPS), True)
    assert mixed.tiled_config(4096, 1, warps=4) == (4, 2, True)
    assert mixed.tiled_config(4096, 4) == (4, mixed.gemv_warps(4096, mixed.TILED_WARPS), False)


def test_bytes_the_gemv_reads_on_each_layout():
    """Prepared.nbytes: the tiled GEMV reads 25.5 bytes per row and 64-channel block at g2 = 16 (plus binfo and the
    outliers), within 1% of what the checkpoint layer stores (the zeros padded from 6 to 8 bits, the second-order
    zero in 4 bits instead of 8); the direct GEMV reads the checkpoint tensors and the fp32 s2f, more."""
    from qtool.bench.cuda_cases import random_mixed_weight

    k, n = 1024, 64
    w = random_mixed_weight(k, n, 0.002, torch.device("cpu"), torch.Generator().manual_seed(0))
    binfo, block4 = mixed.block_info(w.stripe_bits)
    p = mixed.Prepared(
        qweight_a=w.qweight_a,
        qweight_b=w.qweight_b,
        scale_codes=w.scale_codes,
        zeros2=w.zeros2,
        s2f=mixed.second_order_table(w.scales_2nd, w.zeros_2nd),
        scales4=w.scales4,
        zeros4=w.zeros4,
        binfo=binfo,
        rowptr=w.outlier_rowptr,
        ocols=w.outlier_cols,
        ovals=w.outlier_values,
        in_features=k,
        out_features=n,
        scale_group_size=16,
        s2=3 * k // 64,
        s4=k // 64,
        block4=block4,
        nnz=w.num_outliers,
        source_ptr=0,
    )
    assert mixed.gemv_layout(p) == "direct"
    with pytest.raises(ValueError, match="layout: found 'tiled' for a layer without tiled streams"):
        mixed.gemv_layout(p, "tiled")
    mixed.add_tiled(p, w.scales_2nd, w.zeros_2nd)
    assert mixed.gemv_layout(p) == "tiled"
    outliers = 4 * (n + 1) + 4 * w.num_outliers
    assert p.nbytes("tiled") == n * (k // 64) * 51 // 2 + 4 * (k // 64) + outliers
    stored = w.stored_bits() // 8 - k // 16  # stripe_bits is not read
    assert abs(p.nbytes("tiled") - stored) < 0.01 * stored and p.nbytes("tiled") < p.nbytes("direct")


def test_gemm_path_tiles_and_shared_memory(monkeypatch):
    monkeypatch.setattr(mixed, "GEMM_WS", 0)  # gemm.cu: the GEMV up to GEMV_MAX_M
    assert mixed.choose_path(17, torch.float16, 16, 4096, gemm_ok=True) == "gemm"
    assert mixed.choose_path(16, torch.float16, 16, 4096, gemm_ok=True) == "gemv"
    monkeypatch.setattr(mixed, "GEMM_WS", 1)  # gemm_ws: the GEMV up to GEMV_BEFORE_GEMM_WS_M
    top = mixed.GEMV_BEFORE_GEMM_WS_M
    assert [mixed.choose_path(m, torch.float16, 16, 4096, gemm_ok=True) for m in (1, top, top + 1, 16)] == [
        "gemv",
        "gemv",
        "gemm",
        "gemm",
    ]
    assert mixed.choose_path(top + 1, torch.float16, 16, 4096) == "gemv"  # no GEMM on this GPU
    assert mixed.choose_path(300, torch.bfloat16, 16, 4096, gemm_ok=True) == "reference"
    assert [mixed.gemm_tokens(m) for m in (17, 64, 65, 128, 200, 5000)] == [64, 64, 128, 128, 256, 256]
    # ring stages of 24 bytes per row (ta, tm), 12 per four-row group (tz, tt), binfo, and TN activation rows
    assert mixed.gemm_smem(128, 4) == 4 * 20 * 1024 + 1024 and mixed.gemm_smem(64, 6) == 6 * 12 * 1024 + 1024
    assert all(mixed.gemm_smem(tn, st) <= 227 * 1024 for tn, st in mixed.GEMM_BUILT.items())
    # Llama-2-7B at a 128-token prefill, two blocks per SM on 132 SMs: qkv, o, gate/up, down
    assert [
        mixed.plan_split(n, 128, k, 128, 2, 132)
        for k, n in [(4096, 12288), (4096, 4096), (4096, 22016), (11008, 4096)]
    ] == [2, 8, 1, 8]


def test_swiglu_of_a_row_interleaved_gate_up_layer_on_the_reference_path():
    """MixedLinear.forward_swiglu reads its rows as gate 2j, 2j + 1, up 2j, 2j + 1 in each run of four."""
    from qtool.bench.cuda_cases import random_mixed_weight
    from qtool.layouts.mixed.module import MixedLinear

    layer = MixedLinear(
        random_mixed_weight(128, 48, 0.01, torch.device("cpu"), torch.Generator().manual_seed(1))
    )
    x = torch.randn(3, 128)
    y = layer(x).reshape(3, 12, 4)
    gate, up = y[..., :2].reshape(3, 24), y[..., 2:].reshape(3, 24)
    assert torch.equal(layer.forward_swiglu(x), torch.nn.functional.silu(gate) * up)
    assert torch.equal(
        mixed.swiglu_interleaved(torch.arange(8.0)[None]),
        torch.nn.functional.silu(torch.tensor([[0.0, 1, 4, 5]])) * torch.tensor([[2.0, 3, 6, 7]]),
    )
    with pytest.raises(ValueError, match="expected a CUDA tensor"):
        mixed.prepare(layer)
