"""The grouped_int path choice per token count (qtool/layouts/grouped_int/cuda.py `choose_path`), without a GPU: the
thresholds measured in kernels/NOTES.md, and the fallbacks for other cards and dtypes."""

from __future__ import annotations

import pytest
import torch

from qtool.layouts.grouped_int.cuda import choose_path, fma_warps, ws_plan

F16 = torch.float16


def test_small_batches_take_the_skinny_kernels():
    assert choose_path(1, F16, 4, 128, 4096, 4096, hopper=True) == "gemv-fma"
    assert choose_path(8, F16, 4, 128, 4096, 4096, hopper=False) == "gemv"


def test_hopper_batches_up_to_256_take_the_wgmma_kernel():
    assert choose_path(17, F16, 4, 128, 4096, 4096, hopper=True) == "mma"
    assert choose_path(256, F16, 8, 128, 4096, 4096, hopper=True) == "mma"
    assert choose_path(256, F16, 8, 128, 4096, 4096, hopper=False) == "dequant+cublas"


def test_batches_up_to_512_on_wide_layers_take_the_wgmma_kernel():
    # its warp-specialized form beat dequantize + cuBLAS at 512 tokens on all three Llama-2-7B shapes (H100)
    assert choose_path(512, F16, 4, 128, 4096, 4096, hopper=True) == "mma"
    assert choose_path(400, F16, 4, 128, 11008, 4096, hopper=True) == "mma"
    assert (
        choose_path(512, F16, 4, 128, 4096, 1024, hopper=True) == "dequant+cublas"
    )  # GQA key/value: cuBLAS won
    assert choose_path(512, F16, 4, 128, 4096, 4096, hopper=False) == "dequant+cublas"


def test_warp_specialized_tiles_follow_the_measured_best():
    # (token tile, split, blocks per SM) that the H100/H200 timings in kernels/NOTES.md found fastest, 132 SMs
    assert ws_plan(4096, 128, 4096, 132) == (128, 4, 1)
    assert ws_plan(4096, 256, 4096, 132) == (128, 2, 1)  # a 256-token tile would be split 4 ways
    assert ws_plan(11008, 256, 4096, 132) == (256, 1, 1)  # 86 tiles: one wave, no split
    assert ws_plan(4096, 256, 11008, 132) == (
        256,
        4,
        1,
    )  # long rows: the larger tile's stages pay for its partials
    assert ws_plan(1024, 128, 4096, 132) == (64, 8, 1)  # 8 row tiles: small token tiles, fewer shares
    assert ws_plan(4096, 65, 4096, 132) == (128, 4, 1)
    assert ws_plan(4096, 64, 4096, 132) == (64, 4, 1)
    assert ws_plan(11008, 64, 4096, 132) == (
        64,
        3,
        2,
    )  # 86 tiles: two blocks per SM fill the GPU 3 ways split
    assert ws_plan(22016, 32, 4096, 132) == (64, 1, 2)  # 172 tiles: one wave of two blocks per SM
    for n, m, kp in (
        (4096, 100, 4096),
        (1024, 512, 4096),
        (200, 300, 256),
        (11008, 512, 11008),
        (12288, 20, 4096),
    ):
        tn, split, per_sm = ws_plan(n, m, kp, 132)
        assert tn in (64, 128, 256) and tn >= m // 4 and per_sm in (1, 2) and (per_sm == 1 or tn == 64)
        assert kp // 64 // split >= 4 or split == 1
        # a split grid stays in one wave
        assert split == 1 or -(-n // 128) * -(-m // tn) * split <= per_sm * 132


def test_long_prefills_take_the_wgmma_kernel():
    assert choose_path(2048, F16, 4, 128, 11008, 4096, hopper=True) == "mma"
    assert choose_path(4096, F16, 8, None, 11008, 4096, hopper=True) == "mma"
    assert choose_path(2048, F16, 4, 128, 4096, 4096, hopper=True) == "mma"
    assert choose_path(1024, F16, 4, 128, 4096, 4096, hopper=True) == "mma"
    assert choose_path(768, F16, 4, 128, 4096, 4096, hopper=True) == "dequant+cublas"  # below MMA_LONG_MIN_M
    assert choose_path(2048, F16, 4, 128, 11008, 4096, hopper=False) == "dequant+cublas"
    assert choose_path(2048, torch.bfloat16, 4, 128, 11008, 4096, hopper=True) == "dequant+cublas"


def test_long_prefills_of_narrow_or_short_row_layers_stay_on_cublas():
    # 4096x1024 (a GQA key/value projection): 8 x 8 tiles of 256 tokens x 128 rows at M = 2048 cover under 3/4
    # of 132 SMs; 8 x 16 at M = 4096 cover them
    assert choose_path(2048, F16, 4, 128, 4096, 1024, hopper=True, sms=132) == "dequant+cublas"
    assert choose_path(4096, F16, 4, 128, 4096, 1024, hopper=True, sms=132) == "mma"
    assert choose_path(2048, F16, 4, 128, 4096, 1024, hopper=True, sms=64) == "mma"  # a smaller GPU
    # rows shorter than MMA_LONG_MIN_K (SmolLM2-135M's 576-wide projections); Qwen2-7B's 3584 are long enough
    assert choose_path(4096, F16, 4, 64, 576, 1536, hopper=True, sms=132) == "dequant+cublas"
    assert choose_path(1024, F16, 4, 128, 3584, 3584, hopper=True, sms=132) == "mma"


def test_unsupported_layers_take_the_reference():
    assert choose_path(2048, F16, 3, 128, 11008, 4096, hopper=True) == "reference"
    assert choose_path(4, torch.float32, 4, 128, 4096, 4096, hopper=True) == "reference"


def test_bad_threshold_in_the_environment_is_a_one_line_error(monkeypatch):
    from qtool.cuda.compile import CudaUnavailableError, env_int

    monkeypatch.setenv("QTOOL_MMA_LONG_MIN_K", "8k")
    with pytest.raises(CudaUnavailableError) as exc:
        env_int("QTOOL_MMA_LONG_MIN_K", 8192)
    assert str(exc.value) == "QTOOL_MMA_LONG_MIN_K: found '8k', expected an integer (default 8192)"
    monkeypatch.setenv("QTOOL_MMA_LONG_MIN_K", " 4096 ")
    assert env_int("QTOOL_MMA_LONG_MIN_K", 8192) == 4096
    monkeypatch.delenv("QTOOL_MMA_LONG_MIN_K")
    assert env_int("QTOOL_MMA_LONG_MIN_K", 8192) == 8192


def _cpu_prepared():
    """A 4-bit 8x128 layer of CPU tensors: enough for the checks that run before anything touches a GPU."""
    from qtool.layouts.grouped_int.cuda import Prepared

    return Prepared(
        torch.zeros(8, 16, dtype=torch.int32),
        torch.ones(8, 1, dtype=F16),
        None,
        torch.zeros(8, 1, dtype=torch.int32),
        4,
        128,
        128,
        8,
        128,
        1,
        0,
    )


def test_linear_refuses_an_unknown_path_in_one_line():
    from qtool.layouts.grouped_int.cuda import PATHS, linear

    with pytest.raises(ValueError) as exc:
        linear(torch.zeros(1, 128, dtype=F16), _cpu_prepared(), path="cublas")
    assert str(exc.value) == f"path: found 'cublas', expected one of {', '.join(PATHS)}"
    assert "gemv-fma" in PATHS and "reference" in PATHS


def test_the_cuda_core_kernel_takes_at_most_two_tokens(monkeypatch):
    # its 4-token builds lost to the tensor-core kernel (kernels/grouped_int/NOTES.md), so QTOOL_FMA_MAX_M stops at 2
    from qtool.layouts.grouped_int import cuda as gi

    assert gi.FMA_MAX_TOKENS == 2 and gi.FMA_MAX_M <= gi.FMA_MAX_TOKENS
    with pytest.raises(ValueError) as exc:
        gi.gemv_fma(torch.zeros(3, 128, dtype=F16), _cpu_prepared())
    assert str(exc.value) == "x: found M=3 tokens, expected 1..2 for this kernel"
    monkeypatch.setattr(gi, "FMA_MAX_M", 2)
    assert choose_path(2, F16, 4, 128, 4096, 4096, hopper=True) == "gemv-fma"
    assert choose_path(3, F16, 4, 128, 4096, 4096, hopper=True) == "gemv"


def test_one_token_4bit_rows_run_in_blocks_of_four_warps():
    assert fma_warps(4, 1, False, 128) == 4  # K = 4096: one piece per thread, as before
    assert fma_warps(4, 1, False, 344) == 4  # K = 11008: threads walk several pieces (measured faster)
    assert fma_warps(4, 1, False, 448) == 4  # K = 14336
    assert fma_warps(4, 1, False, 40) == 2  # short rows: no idle warps
    assert fma_warps(8, 1, True, 344) == 11  # 8-bit, persistent grid: one thread per piece
    assert fma_warps(8, 1, False, 344) == 11
    assert fma_warps(4, 2, False, 344) == 11  # two tokens: not measured, unchanged
    assert fma_warps(4, 1, False, 1024) == 4
    assert fma_warps(8, 1, False, 1024) == 16


def test_tensor_core_gemv_is_a_dependent_launch_only_where_its_grid_is_one_wave_of_16_warp_blocks(
    monkeypatch,
):
    from qtool.cuda import dependent_launch
    from qtool.layouts.grouped_int.cuda import gemv_dependent, gemv_warps

    sms = 132
    nt = 2  # M = 9..16
    w = gemv_warps(4096, nt, 4096, 4, sms)
    assert w == 16 and gemv_dependent(nt, w, 4096 // 16, sms)  # N = 4096: 256 blocks, two per SM
    assert gemv_dependent(nt, gemv_warps(4096, nt, 11008, 4, sms), 256, sms)  # 11008x4096
    w = gemv_warps(11008, nt, 4096, 4, sms)
    assert w == 4 and not gemv_dependent(nt, w, 688, sms)  # N = 11008: measured slower as a dependent
    assert not gemv_dependent(nt, 16, 2 * sms + 1, sms)  # more than one wave
    assert not gemv_dependent(4, 16, 256, sms)  # 17..32 tokens: no dependent entry (it would spill)
    assert gemv_dependent(1, 16, 64, sms)
    monkeypatch.setattr(dependent_launch, "ENABLED", False)
    assert not gemv_dependent(nt, 16, 256, sms)
