"""The quik quantize kernel's launch plan (qtool/cuda/quik.py), on the CPU: which kernel takes a row, how many row
teams a block holds in shared memory, and how rows spread over the SMs. H100/H200 numbers: 132 SMs, 232448 bytes
of opt-in shared memory per block."""

from __future__ import annotations

import pytest

from qtool.cuda import quik

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


@pytest.mark.parametrize("m,plan", [(1, (4, 1)), (132, (4, 1)), (133, (4, 2)), (256, (4, 2)), (1056, (4, 8)),
                                    (1057, (4, 8)), (2048, (2, 16)), (100000, (2, 16))])
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
    return quik.build(4, 4, k, qweight, torch.ones(n), torch.zeros(n), torch.zeros(n, ko),
                      torch.arange(ko, k, dtype=torch.int32), torch.arange(ko, dtype=torch.int32), None)


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
