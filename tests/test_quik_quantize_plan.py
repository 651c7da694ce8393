"""The quik quantize kernel's launch plan (qtool/layouts/quik/cuda.py), on the CPU: which kernel takes a row, how many row
teams a block holds in shared memory, and how rows spread over the SMs. H100/H200 numbers: 132 SMs, 232448 bytes
of opt-in shared memory per block."""

from __future__ import annotations

import pytest

from qtool.layouts.quik import cuda as quik

SMS, OPTIN = 132, 232448


def test_teams_fill_shared_memory_up_to_32_warps():
    # K = 4096: 8 KB rows beside 16 KB of column maps; 26 would fit, 32 warps / 4 per team caps it at 8
    assert quik.quant_teams(4096, OPTIN, stages=1, team=4) == 8
    assert quik.quant_teams(4096, OPTIN, stages=1, team=1) == 26
    assert quik.quant_teams(4096, OPTIN, stages=3, team=1) == 8
    # K = 11008: 22 KB rows, 44 KB of maps
    assert quik.quant_teams(11008, OPTIN, stages=1, team=1) == 8
    assert quik.quant_teams(11008, OPTIN, stages=2, team=1) == 4
    # a row that does not fit twice beside its maps
    assert quik.quant_teams(60000, OPTIN, stages=1, team=1) == 0


@pytest.mark.parametrize(
    "m,plan",
    [
        (1, (4, 1)),
        (132, (4, 1)),
        (133, (4, 2)),
        (256, (4, 2)),
        (1056, (4, 8)),
        (1057, (4, 8)),
        (2048, (2, 16)),
        (100000, (2, 16)),
    ],
)
def test_rows_spread_over_all_sms_first_then_the_smaller_team_at_equal_warps(m, plan):
    # K = 4096: up to 16 two-warp or 8 four-warp teams per block (32 warps); teams of 4 until the rows per SM
    # fill 16 two-warp teams as well
    assert quik.warp_plan(m, 4096, SMS, OPTIN) == plan


def test_long_rows_keep_four_warp_teams():
    # K = 11008: only 8 rows fit, so teams of 4 put twice the warps on an SM
    assert quik.warp_plan(2048, 11008, SMS, OPTIN) == (4, 8)
    assert quik.warp_plan(2048, 60000, SMS, OPTIN) == (4, 0)


def test_kernel_choice():
    assert quik.quantize_kernel(2048, 4096, True, SMS, OPTIN) == "warp"
    assert quik.quantize_kernel(1, 11008, True, SMS, OPTIN) == "warp"
    # rows not 16-byte aligned, or too long for shared memory: the block-per-row kernel
    assert quik.quantize_kernel(2048, 4096, False, SMS, OPTIN) == "block"
    assert quik.quantize_kernel(2048, 32768, True, SMS, OPTIN) == "warp"  # one team of one 64 KB row fits
    assert quik.quantize_kernel(2048, 32768, True, SMS, 101376) == "block"


def _tiny_layer() -> quik.QuikPrepared:
    import torch

    n, k, ko = 4, 64, 8
    qweight = torch.zeros(n, (k - ko) * 4 // 32, dtype=torch.int32)
    return quik.build(
        4,
        4,
        k,
        qweight,
        torch.ones(n),
        torch.zeros(n),
        torch.zeros(n, ko),
        torch.arange(ko, k, dtype=torch.int32),
        torch.arange(ko, dtype=torch.int32),
        None,
    )


def test_unknown_kernel_or_plan_is_a_one_line_error():
    import torch

    p = _tiny_layer()
    x = torch.zeros(4, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"found 'bogus', expected one of \('block', 'warp'\)"):
        quik.quantize(x, p, kernel="bogus")
    with pytest.raises(ValueError, match=r"found 5 row buffers per team, expected one of \(1, 2, 3\)"):
        quik.quantize(x, p, kernel="warp", stages=5)
    with pytest.raises(ValueError, match=r"found teams of 3 warps, expected one of \(1, 2, 4\)"):
        quik.quantize(x, p, kernel="warp", stages=3, team=3)
    with pytest.raises(ValueError, match="rows must be 16-byte aligned"):
        quik.quantize(torch.zeros(4, 67, dtype=torch.float16)[:, :64], p, kernel="warp")


def _layer(n: int, k: int, ko: int, bits: int = 4) -> quik.QuikPrepared:
    import torch

    kb = k - ko
    qweight = torch.zeros(n, -(-kb * bits // 32), dtype=torch.int32)
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(0)).to(torch.int32)
    return quik.build(
        bits,
        bits,
        k,
        qweight,
        torch.ones(n),
        torch.zeros(n),
        torch.zeros(n, ko),
        perm[ko:].sort().values,
        perm[:ko].sort().values,
        None,
    )


def test_fused_form_first_rows_cover_the_first_tiles_token_tiles():
    # 4096 output rows are 32 row blocks: 132 tiles span 5 token tiles, 128 exactly 4
    assert quik.wsq_first_rows(2048, 4096, 132) == 1280
    assert quik.wsq_first_rows(2048, 4096, 128) == 1024
    assert quik.wsq_first_rows(2048, 11008, 132) == 512  # 86 row blocks
    assert quik.wsq_first_rows(300, 72, 132) == 300  # 2 tiles in all, M rows at most
    assert quik.wsq_first_rows(2048, 4096, 1) == 256


def test_fused_form_copy_warps_and_shared_memory():
    p = _layer(64, 4096, 256)  # kp 3840: 7680 bytes of map, 512 of flags, 512 of outlier offsets, 8 KB rows
    assert quik.wsq_shared_bytes(p, 3) == 4 * 40960 + 1024 + 2 * 8192 + 7680 + 512 + 512 + 3 * 8192
    assert quik.wsq_copy_warps(p) == 3
    assert quik.wsq_copy_warps(_layer(64, 6000, 8)) == 2
    assert quik.wsq_copy_warps(_layer(64, 11008, 896)) == 1  # 22 KB rows: one beside the 42 KB of maps


def test_fused_form_takes_w4a4_prefills_only():
    import torch

    p = _layer(4096, 4096, 256)
    x = torch.zeros(2048, 4096, dtype=torch.float16)
    assert quik.fused_quantize_reason(x, p) is None
    assert (
        quik.fused_quantize_reason(x[:128], p) == "128 tokens (the fused form has 256-token tiles: M > 128)"
    )
    assert quik.fused_quantize_reason(x, _layer(4096, 4096, 256, bits=8)) == "w8a8 (built for w4a4)"
    assert "activation rows" in quik.fused_quantize_reason(x.float(), p)
    # 11008 x 4096: 79 + 28 stages per tile, the 5-stage ring's length
    assert quik.fused_quantize_reason(
        torch.zeros(300, 11008, dtype=torch.float16), _layer(64, 11008, 896)
    ) == ("107 stages per tile (the 5-stage ring of the two-kernel path is faster from 64)")
    assert quik.fused_quantize_reason(x[:, :4000], _layer(100, 4000, 37)) == (
        "out_features 100 (output rows must be 16-byte aligned for the copy engine)"
    )


def test_linear_takes_the_fused_form_from_six_rounds_of_tiles():
    assert quik.fused_quantize_pays(2048, 11008, 132)  # 688 tiles: 6 rounds
    assert not quik.fused_quantize_pays(2048, 4096, 132)  # 256 tiles: 2 rounds
    assert not quik.fused_quantize_pays(1024, 11008, 132)  # 344 tiles: 3 rounds
    assert quik.fused_quantize_pays(4096, 4096, 40)
