"""The CPU side of the warp-specialized VQ GEMM (kernels/vq/gemm_ws.cu, qtool/layouts/vq/cuda_gemm.py `gemm_ws`):
its builds (two forms) against the kernel's entries, their shared memory, the plan, and the engine's sizes."""

from __future__ import annotations

import re

import pytest

from qtool.cuda import f16_ws
from qtool.layouts.vq import cuda_gemm as g
from qtool.resources import kernels_dir


def test_builds_are_the_kernel_entries_and_fit():
    src = (kernels_dir() / "vq" / "gemm_ws.cu").read_text()
    regs = re.findall(r"^VQ_GEMM_WS_ENTRIES\((\d+), (\d+), (\d+)\)", src, flags=re.M)
    tile = re.findall(r"^VQ_GEMM_WST_ENTRY\((\d+), (\d+), (\d+), (\d+)\)", src, flags=re.M)
    built = {("regs", int(tn)): (int(sc), 0, int(b)) for tn, sc, b in regs}
    built |= {("tile", int(tn)): (int(sc), int(sa), int(b)) for tn, sc, sa, b in tile}
    assert built == g.WS_BUILT
    assert all(g.ws_fits(f, tn) for f, tn in g.WS_BUILT)
    # a slot: the activation tile, 2 KiB of index words, a 2 KiB scope, rounded up to 1 KiB; then the alignment
    assert g.ws_smem("regs", 16) == 12 * 6 * 1024 + 1024
    assert g.ws_smem("regs", 128) == 11 * 20 * 1024 + 1024
    assert ("regs", 256) not in g.WS_BUILT
    assert g.ws_smem("tile", 16) == 7 * 6 * 1024 + 4 * 16384 + 1024
    assert g.ws_entry("regs", 64, "shfl") == "vq_gemm_ws_d4_b8_z1_n64_s9_f1"
    assert g.ws_entry("tile", 128, "direct") == "vq_gemm_wst_d4_b8_z1_n128_s8_a4"
    # each ring as deep as fits the blocks per SM its registers allow, up to 12 copy slots
    for (f, tn), (sc, sa, blocks) in g.WS_BUILT.items():
        assert f16_ws.deepest(tn, g.WS_WORDS, sc, sa, blocks), (f, tn)


def test_plan():
    ms = (1, 16, 17, 32, 33, 64, 65, 128, 129, 256, 2048)
    assert [g.ws_plan(m) for m in ms] == [
        ("regs", t) for t in (16, 16, 32, 32, 64, 64, 128, 128, 128, 128, 128)
    ]
    assert [g.ws_plan(m, form="tile")[1] for m in (5, 40, 300)] == [16, 64, 128]
    assert g.ws_plan(5, tokens=64, form="tile") == ("tile", 64)
    with pytest.raises(ValueError, match="tokens, form: found 256, 'tile'"):
        g.ws_plan(300, tokens=256, form="tile")
    with pytest.raises(ValueError, match="tokens, form: found 48"):
        g.ws_plan(40, tokens=48)
    with pytest.raises(ValueError, match="form: found 'rows'"):
        g.ws_plan(40, form="rows")


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
