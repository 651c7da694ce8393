"""The operand order and arithmetic the qoq W4A8 GEMM relies on (kernels/qoq/gemm.cu, qoq_frags and qoq_correct),
checked on the CPU: the weight words and group words read the way the kernel builds its u8 wgmma A fragments,
multiplied with the activation codes at the MMA k positions, less zc·rowsum, must give the layout's exact integer
products. The GPU tests check the kernel itself; this pins the contract between `qtool.layouts.qoq.cuda.build`,
`quantize_torch` and the kernel, and runs everywhere."""

from __future__ import annotations

import types

import pytest
import torch

from qtool.layouts.qoq import cuda as qoq
from tests.gpu.helpers import QoQFieldLayer


def _a_operand(p: qoq.QoQPrepared) -> torch.Tensor:
    """The u8 weight matrix [N, kp] in MMA k order, as the kernel's fragments hold it."""
    n = p.wq.shape[0]
    words = p.wq.to(torch.int64) & 0xFFFFFFFF
    out = torch.empty(n, p.kp, dtype=torch.int64)
    for s in range(p.kp // 128):
        for j in range(4):  # k-step of 32 codes
            w = words[:, 16 * s + 4 * j : 16 * s + 4 * j + 4]  # word 4j + t of the stage, t = 0..3
            halves = [w & 0x0F0F0F0F, (w >> 4) & 0x0F0F0F0F]  # a0/a1 (k 4t..4t+3), a2/a3 (k 16+4t..)
            if p.group_size is not None:
                gw = p.gwords[:, (128 * s + 32 * j) // p.group_size].to(torch.int64)[:, None]
                c4, s1 = (gw & 0xFF) * 0x01010101, (gw >> 8) & 0xFF
                halves = [(h * s1 + c4) & 0xFFFFFFFF for h in halves]  # one 32-bit IMAD per 4 codes
            for h in range(2):
                for t in range(4):
                    for i in range(4):
                        out[:, 128 * s + 32 * j + 16 * h + 4 * t + i] = (halves[h][:, t] >> (8 * i)) & 0xFF
    return out


@pytest.mark.parametrize(
    "n,k,group_size",
    [(24, 256, None), (16, 576, None), (24, 384, 32), (16, 576, 64), (8, 512, 128), (8, 100, None)],
)
def test_fragments_times_positions_equal_integer_products(n, k, group_size):
    gen = torch.Generator().manual_seed(n * k + (group_size or 0))
    layer = QoQFieldLayer(n, k, 4, group_size, bias=False, generator=gen)
    p = qoq.prepare(layer)
    x = (torch.randn(5, k, generator=gen) * 3).half()
    codes, _, rowsum = qoq.quantize_torch(x)
    a = torch.zeros(5, p.kp, dtype=torch.int64)
    a[:, p.dest.long()] = codes.to(torch.int64)
    wa = _a_operand(p)
    if group_size is not None:  # every byte is Q8hat + 128 in [0, 255]: no carry crossed a byte
        ref_u8 = layer.wint.to(torch.int64) + 128
        assert torch.equal(wa[:, p.dest.long()], ref_u8)
    acc = a @ wa.t()
    zc = p.zeros.to(torch.int64)[None, :] if group_size is None else 128
    acc = acc - zc * rowsum.to(torch.int64)[:, None]
    assert torch.equal(acc, codes.to(torch.int64) @ layer.wint.to(torch.int64).t())


def test_quantize_torch_is_the_layout_formula():
    x = torch.tensor([[0.0, 0.0, 0.0], [1.0, -2.0, 0.5], [-3.0, 1.5, 3.0]], dtype=torch.float16)
    codes, sx, rowsum = qoq.quantize_torch(x)
    assert codes[0].tolist() == [0, 0, 0] and float(sx[0]) == 1.0
    # r = 127/2 = 63.5: 1 -> 63.5 -> 64 (ties to even), 0.5 -> 31.75 -> 32
    assert codes[1].tolist() == [64, -127, 32] and int(rowsum[1]) == -31
    assert float(sx[1]) == float(torch.tensor(2.0) / 127)
    # r = RN(127/3) = 42.33333206..., 1.5·r = 63.49999809... is a tie in float32 and rounds to 63.5, then to 64; the
    # exact product rounded once to an integer (an fma) would give 63
    assert codes[2].tolist() == [-127, 64, 127] and int(rowsum[2]) == 64


def test_group_words_reject_groups_outside_the_protective_range():
    s1 = torch.tensor([[16, 16, 16]], dtype=torch.uint8)
    z = torch.tensor([[8, 7, 9]], dtype=torch.uint8)
    qmax = torch.tensor([[15, 15, 15]])  # z = 7: (15 - 7)·16 = 128 overflows; z = 9: 128 - 144 < 0
    with pytest.raises(ValueError, match=r"group \(0, 1\)"):
        qoq.group_words(s1, z, qmax)
    with pytest.raises(ValueError, match=r"group \(0, 0\) has s1 16, z 9"):
        qoq.group_words(s1[:, 2:], z[:, 2:], qmax[:, 2:])
    w = qoq.group_words(s1[:, :1], z[:, :1], qmax[:, :1])
    assert int(w) == (128 - 128) | (16 << 8)
    # The group the quantizer produces for the range [-113, 119] (s1 = 16, z = 7) never holds q = 15: its largest
    # code is round(119/16) + 7 = 14, whose byte 14·16 + 16 = 240 fits.
    w = qoq.group_words(s1[:, 1:2], z[:, 1:2], torch.tensor([[14]]))
    assert int(w) == (128 - 112) | (16 << 8)


def test_unsupported_reasons_are_one_line():
    cpu = torch.device("cpu")
    assert "CUDA" in qoq.unsupported_reason(4, None, 256, 64, cpu)
    for args in ((4, 96, 576, 64), (8, 128, 512, 64), (3, None, 256, 64)):
        reason = qoq.unsupported_reason(*args, torch.device("cuda"))
        assert reason and "\n" not in reason
    assert "multiple of group_size" in qoq.unsupported_reason(4, 128, 576, 64, torch.device("cuda"))


@pytest.mark.parametrize("n,k,g", [(328, 2048, 128), (128, 256, 32), (13, 640, 64)])
def test_stage_words_are_the_group_words_stage_major(n, k, g):
    """The warp-specialized GEMM copies one (row tile, stage) of group words at a time: stage_words must hold word
    (f, s·128/g + w) at [f // 128, s, f % 128, w], and zeros for the rows past N."""
    from qtool.layouts.qoq import cuda as qoq

    words = torch.randint(0, 2**15, (n, k // g), dtype=torch.int32)
    st = qoq.stage_words(words, g)
    gps = 128 // g
    assert st.shape == ((n + 127) // 128, k // 128, 128, gps) and st.is_contiguous()
    f = torch.arange(n)
    for s in range(k // 128):
        assert torch.equal(st[f // 128, s, f % 128], words[:, s * gps : (s + 1) * gps])
    assert not st.permute(0, 2, 1, 3).reshape(-1, k // 128, gps)[n:].any()


def test_gemm_form_dispatch(monkeypatch):
    """The 4-bit GEMM forms by token count and shape (qtool/layouts/qoq/cuda.py gemm_kernel, from the H100 sweep): 16-,
    32- and then 64-token `ws` tiles split along K into shares of at least 10 stages within one wave where 128-token tiles would leave
    half the GPU idle, the persistent form at 128 or 256 tokens where they would not, the H200 rule above 512
    tokens, `sync` at GEMV sizes, whenever a split is asked for without a form and for unaligned operands."""
    from qtool.layouts.qoq import cuda as qoq

    monkeypatch.setattr(qoq.tma, "usable", lambda t: True)
    a = qoq.QoQActivations(codes=torch.zeros(1, 1), scale=torch.zeros(1), rowsum=torch.zeros(1))

    def pick(k, n, ms):
        p = types.SimpleNamespace(wq=torch.zeros(1, 1), kp=k)
        return [qoq.gemm_kernel(m, n, a, p) for m in ms]

    ms = (4, 5, 16, 64, 65, 128, 256, 512, 2048)
    assert pick(4096, 4096, ms) == [
        ("sync", 64, None, None),
        ("ws", 16, 3, 0),
        ("ws", 16, 3, 0),
        ("ws", 64, 3, 0),
        ("ws", 64, 2, 0),
        ("ws", 64, 2, 0),
        ("ws", 64, 1, 0),
        ("wsp", 128, None, None),
        ("wsp", 256, None, None),
    ]
    assert pick(4096, 11008, ms) == [
        ("sync", 64, None, None),
        ("ws", 16, 1, 0),
        ("ws", 16, 1, 0),
        ("ws", 64, 1, 0),
        ("wsp", 128, None, None),
        ("wsp", 128, None, None),
        ("wsp", 256, None, None),
        ("wsp", 128, None, None),
        ("wsp", 256, None, None),
    ]
    assert pick(11008, 4096, ms)[1:7] == [
        ("ws", 16, 4, 0),
        ("ws", 16, 4, 0),
        ("ws", 64, 4, 0),
        ("ws", 64, 2, 0),
        ("ws", 64, 2, 0),
        ("ws", 64, 1, 0),
    ]
    assert pick(256, 64, (16,)) == [("ws", 16, 1, 0)]  # two stages: no share would have ten
    assert pick(4096, 4096, (17, 32, 33)) == [("ws", 32, 3, 0), ("ws", 32, 3, 0), ("ws", 64, 3, 0)]
    p = types.SimpleNamespace(wq=torch.zeros(1, 1), kp=4096)
    assert qoq.gemm_kernel(512, 4096, a, p, split=1) == ("sync", 256, 1, None)
    assert qoq.gemm_kernel(512, 4096, a, p, tokens=128) == ("ws", 128, None, None)
    monkeypatch.setattr(qoq.tma, "usable", lambda t: False)  # unaligned operands: the cp.async form
    assert qoq.gemm_kernel(2048, 4096, a, p) == ("sync", 256, None, None)
