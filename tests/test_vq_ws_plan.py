"""The CPU side of the warp-specialized VQ GEMM (kernels/vq/gemm_ws.cu, qtool/layouts/vq/cuda_gemm.py `gemm_ws`):
its builds against the kernel's entries, their shared memory, and the token tile it picks."""

from __future__ import annotations

import re

from qtool.cuda import f16_ws
from qtool.layouts.vq import cuda_gemm as g
from qtool.resources import kernels_dir


def test_builds_are_the_kernel_entries_and_fit():
    src = (kernels_dir() / "vq" / "gemm_ws.cu").read_text()
    entries = re.findall(r"^VQ_GEMM_WS_ENTRIES\((\d+), (\d+), (\d+)\)", src, flags=re.M)
    assert {int(tn): (int(sc), int(b)) for tn, sc, b in entries} == g.WS_BUILT
    assert all(g.ws_fits(tn) for tn in g.WS_BUILT)
    # a slot: the activation tile, 2 KiB of index words, a 2 KiB scope, rounded up to 1 KiB; then the alignment
    assert g.ws_smem(16, 12) == 12 * 6 * 1024 + 1024
    assert g.ws_smem(256, 6) == 6 * 36 * 1024 + 1024
    # each ring as deep as fits the blocks per SM its registers allow, up to 12 copy slots
    for tn, (sc, blocks) in g.WS_BUILT.items():
        assert f16_ws.deepest(tn, g.WS_WORDS, sc, 0, blocks), tn


def test_token_tile():
    ms = (1, 16, 17, 32, 33, 64, 65, 128, 129, 256, 2048)
    assert [g.ws_tokens_for(m) for m in ms] == [16, 16, 32, 32, 64, 64, 128, 128, 256, 256, 256]


def test_the_built_configuration_is_the_kernels_and_carries_its_scope_in_the_ring():
    (cfg,) = g.WS_CONFIGS
    d, b, z = cfg
    assert g.WS_SCOPE_BYTES == z * (1 << b) * d * 2 <= g.RESIDENT_BYTES
    assert g.unsupported_reason(d, 1 << b, z, 4096, 256, 256) is None
    src = (kernels_dir() / "vq" / "gemm_ws.cu").read_text()
    assert f"VqCfg<{d}, {b}, {z}>" in src and f"vq_gemm_ws_d{d}_b{b}_z{z}_n" in src


def test_engine_sizes():
    """qtool/cuda/f16_ws.py against hand counts: a 16-token slot with 3984 bytes of words is 6 KiB; two 107 KiB tile
    blocks fit an SM, three do not; a ring that one more slot would not fit is the deepest."""
    assert f16_ws.smem(16, 3984, 7, 4) == 7 * 6144 + 4 * 16384 + 1024
    assert f16_ws.fits(16, 3984, 7, 4, 2) and not f16_ws.fits(16, 3984, 7, 4, 3)
    assert f16_ws.deepest(16, 3984, 7, 4, 2) and not f16_ws.deepest(16, 3984, 6, 4, 2)
    assert not f16_ws.fits(256, 4096, 7, 0, 1)  # 7 x 36 KiB: past a block's 227 KiB
    assert f16_ws.deepest(16, 4096, 12, 0, 2)  # 12 slots: the most built, though a 13th would fit
