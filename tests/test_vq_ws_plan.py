"""The CPU side of the warp-specialized VQ GEMM (kernels/vq/gemm_ws.cu, qtool/layouts/vq/cuda_gemm.py `gemm_ws`):
its builds against the kernel's entries, their shared memory, and the token tile it picks."""

from __future__ import annotations

import re

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
        more = g.ws_smem(tn, sc + 1) + g.WS_STATIC_SMEM
        too_big = more > g.SMEM_BLOCK_MAX or blocks * (more + g.SMEM_RESERVED) > g.SMEM_PER_SM
        assert too_big or sc + 1 > 12, tn


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
