"""The operand order the quik GEMM kernel relies on (kernels/quik/gemm.cu, runtime contract), checked on the CPU:
reading the weight words the way the kernel builds its wgmma A fragments, against the activation bytes at the MMA
k positions of each stage, must give the reference's integer sums. The GPU tests check the kernel itself; this
pins the contract it shares with `qtool.layouts.quik.cuda.build` and `quantize_torch`, and runs everywhere."""

from __future__ import annotations

import torch

from qtool.layouts.quik import cuda as quik
from qtool.layouts.quik.layout import QuikWeight
from qtool.layouts.quik.module import QuikLinear


def _layer(n: int, k: int, ko: int, bits: int, seed: int) -> QuikLinear:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (n, k - ko), generator=g)
    scales = torch.rand(n, generator=g) + 0.5
    idx = torch.randperm(k, generator=g)[:ko].to(torch.int32)
    wo = torch.randn(n, ko, generator=g)
    return QuikLinear(QuikWeight.from_codes(codes, scales, idx, wo, bits, bits))


def _s8(v: torch.Tensor) -> torch.Tensor:
    return torch.where(v >= 128, v - 256, v)


def _a_operand(p: quik.QuikPrepared) -> torch.Tensor:
    """The weight matrix [N, kp] in MMA k order, as the kernel's fragments hold it (4-bit: 16x the code)."""
    n = p.wq.shape[0]
    words = p.wq.to(torch.int64) & 0xFFFFFFFF
    out = torch.empty(n, p.kp, dtype=torch.int64)
    for s in range(p.kp // 128):
        for j in range(4):  # k-step of 32 codes
            for kk in range(32):
                h, t, i = kk // 16, (kk % 16) // 4, kk % 4  # a0/a1 (h = 0) or a2/a3 (h = 1), lane t, byte i
                if p.bits == 4:  # word 4j+t of the stage: low nibbles -> a0/a1, high nibbles -> a2/a3
                    byte = (words[:, 16 * s + 4 * j + t] >> (8 * i)) & 0xFF
                    val = ((byte << 4) & 0xF0 if h == 0 else byte & 0xF0) ^ 0x80
                else:  # words 8j+t -> a0/a1, 8j+4+t -> a2/a3
                    val = ((words[:, 32 * s + 8 * j + 4 * h + t] >> (8 * i)) & 0xFF) ^ 0x80
                out[:, 128 * s + 32 * j + kk] = _s8(val)
    return out


def test_weight_fragments_times_activation_bytes_equal_reference_sums():
    for bits, (n, k, ko) in [(4, (24, 300, 20)), (8, (16, 260, 0)), (4, (8, 128, 0)), (8, (8, 520, 130))]:
        layer = _layer(n, k, ko, bits, seed=bits * 1000 + k)
        p = quik.prepare(layer)
        x = torch.randn(5, k, generator=torch.Generator().manual_seed(k))
        x[:, layer.outlier_idx.long()] *= 30
        a = quik.quantize_torch(x.half(), p)
        acc = _a_operand(p) @ a.codes.to(torch.int64).t()  # [N, M]
        if bits == 4:
            assert bool((acc % 16 == 0).all())
            acc = acc // 16
        ref, _ = layer.accumulate(x.half().float())
        assert torch.equal(acc.t(), ref.to(torch.int64)), f"w{bits} N={n} K={k} k={ko}"


def test_checkpoint_tensors_used_as_stored_when_stages_are_whole():
    layer = _layer(8, 128 + 64, 64, 4, seed=3)  # 128 base columns, 64 outliers: no padding needed
    p = quik.prepare(layer)
    assert p.wq.data_ptr() == layer.qweight.data_ptr()
    odd = quik.prepare(_layer(8, 300, 20, 4, seed=4))  # 280 base columns: padded to 384
    assert odd.wq.shape == (8, 384 // 8) and odd.wo.shape == (8, 64)


def test_activation_positions_keep_each_column_in_its_group():
    for bits in (4, 8):
        pos = quik.act_positions(200, bits)
        assert len(set(pos.tolist())) == 200 and int(pos.max()) < 224
        assert bool(((pos // 32) == (torch.arange(200) // 32)).all())
    assert quik.act_positions(200, 8).tolist() == list(range(200))


def test_rows_wider_than_the_quantize_kernel_take_the_reference_with_a_reason():
    reason = quik.unsupported_reason(4, 4, torch.device("cpu"), quik.QUANT_MAX_K + 8)
    assert reason is not None and f"in_features {quik.QUANT_MAX_K + 8}" in reason
    assert "w4a8" in quik.unsupported_reason(4, 8, torch.device("cpu"))
