"""The quantized KV cache's storage (qtool/kv_cache/cuda.py torch forms, formats/qoq.md "KV cache"): codes packed
two per byte, low nibble first; the stored (codes, scale, zero) dequantize to exactly what the reference attention
path (qtool/kv_cache/quantized.py) feeds attention; a write touches only its positions."""

from __future__ import annotations

import pytest
import torch

from qtool.kv_cache import cuda as kvc
from qtool.kv_cache.quantized import fake_quantize_kv


def test_int4_codes_pack_low_nibble_first_and_round_trip():
    codes = torch.tensor([[1, 2, 15, 0, 7, 8, 3, 12]], dtype=torch.uint8)
    packed = kvc.pack_codes(codes, "int4")
    assert packed.tolist() == [[0x21, 0x0F, 0x87, 0xC3]]
    assert torch.equal(kvc.unpack_codes(packed, "int4"), codes)
    assert torch.equal(kvc.pack_codes(codes, "int8"), codes)


@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_stored_cache_dequantizes_to_what_the_reference_path_attends_to(mode):
    gen = torch.Generator().manual_seed(3)
    b, t, h, kvh, d, length = 2, 5, 6, 2, 64, 16
    qkv = (torch.randn(b, t, h + 2 * kvh, d, generator=gen) * 2).half()
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = torch.arange(length, dtype=torch.float32)[:, None] * inv[None]
    cos, sin = ang.cos().half(), ang.sin().half()
    pos = torch.tensor([1, 2, 3, 8, 9])
    cache = kvc.allocate(mode, b, kvh, length, d, torch.device("cpu"))
    cache.k.fill_(0xA5)
    q, dk, dv = kvc.reference_write(qkv, cos, sin, pos, cache, h)
    x = qkv.transpose(1, 2)
    k = kvc.rope_half(x[:, h : h + kvh], cos[pos], sin[pos])
    bits = kvc.BITS[mode]
    assert torch.equal(dk, fake_quantize_kv(k, bits))
    assert torch.equal(dv, fake_quantize_kv(x[:, h + kvh :], bits))
    assert torch.equal(kvc.dequantize(cache, "k", torch.float32)[:, :, pos].half(), dk)
    assert torch.equal(kvc.dequantize(cache, "v", torch.float32)[:, :, pos].half(), dv)
    assert torch.equal(q, kvc.rope_half(x[:, :h], cos[pos], sin[pos]))
    untouched = torch.ones(length, dtype=torch.bool)
    untouched[pos] = False
    assert bool((cache.k[:, :, untouched] == 0xA5).all())


def test_cache_bytes_per_token_are_a_quarter_of_fp16_plus_params():
    # Llama-2-7B layer: 32 KV heads of 128; FP16 stores 2 * 32 * 128 * 2 bytes per token
    fp16 = 2 * 32 * 128 * 2
    assert kvc.bytes_per_token("int4", 32, 128) == fp16 // 4 + 2 * 32 * 4
    assert kvc.bytes_per_token("fp8", 32, 128) == fp16 // 2
    cache = kvc.allocate("int4", 3, 32, 10, 128, torch.device("cpu"))
    assert cache.nbytes() == 3 * 10 * kvc.bytes_per_token("int4", 32, 128)


def test_unsupported_head_dims_are_refused_in_one_line():
    with pytest.raises(
        ValueError, match="KV cache int4: found head_dim 260, expected a multiple of 8 up to 256"
    ):
        kvc.check_shape("int4", 260)
    with pytest.raises(
        ValueError, match="KV cache int8: found head_dim 256, expected a multiple of 4 up to 128"
    ):
        kvc.check_shape("int8", 256)


def test_tensor_core_attention_splits_the_cache_only_where_pairs_leave_sms_idle():
    sms = 132  # an H100/H200
    assert kvc.attention_splits(8, 1024, sms) == 4  # Llama-3-8B, batch 1: capped at 4 parts
    assert kvc.attention_splits(32, 1024, sms) == 4  # Llama-2-7B, batch 1
    assert kvc.attention_splits(64, 1024, sms) == 2
    assert kvc.attention_splits(8, 100, sms) == 1  # a short cache stays one block per pair
    assert (
        kvc.attention_splits(128, 1024, sms) == 1
    )  # Llama-3-8B, batch 16: one block a multiprocessor already
    assert kvc.attention_splits(5120, 1024, sms) == 1
    assert kvc.tc_warps(128, sms) == 8 and kvc.tc_warps(512, sms) == 4


def test_attention_form_refuses_options_of_another_form_in_one_line():
    assert kvc.attention_form("int4", 1, 128) == "tc"  # one query head per KV head too
    assert kvc.attention_form("int4", 4, 96) == "fma"  # a head dim the tensor-core form does not take
    assert kvc.attention_form("fp8", 4, 128) == "fma"
    assert kvc.attention_form("int4", 4, 128, wpl=1) == "fma"
    with pytest.raises(ValueError, match=r"splits: found 0, expected 1 to 32"):
        kvc.attention_form("int4", 2, 64, kernel="tc", splits=0)
    with pytest.raises(ValueError, match=r"warps: found 5, expected one of \(4, 8\)"):
        kvc.attention_form("int4", 2, 64, warps=5)
    with pytest.raises(ValueError, match="kernel fma: found warps, splits, copy_steps or early_stages"):
        kvc.attention_form("int4", 2, 64, kernel="fma", splits=2)
    with pytest.raises(ValueError, match="kernel fma: found warps, splits, copy_steps or early_stages"):
        kvc.attention_form("int4", 2, 64, kernel="fma", copy_steps=2)
    with pytest.raises(ValueError, match=r"copy_steps: found 3, expected one of \(1, 2, 4\)"):
        kvc.attention_form("int4", 2, 64, copy_steps=3)
    assert kvc.attention_form("int4", 2, 64, copy_steps=4) == "tc"
    with pytest.raises(ValueError, match="kernel tc: found a int4 cache of head dim 64, wpl"):
        kvc.attention_form("int4", 2, 64, kernel="tc", wpl=1)
    with pytest.raises(ValueError, match="kernel tc: found a fp8 cache of head dim 128"):
        kvc.attention_form("fp8", 2, 128, kernel="tc")
    with pytest.raises(ValueError, match="kernel: found 'x'"):
        kvc.attention_form("int4", 2, 64, kernel="x")


def test_tensor_core_entries_and_their_shared_memory():
    """The one-step form keeps its entry names and its shared memory; the stages of CS steps hold CS steps' rows
    and parameter runs of 16 CS + 4 words (kernels/kv_cache/quantized.cu TcStage)."""
    assert kvc.tc_entry(128, 8) == "kv_attention_tc_int4_d128_w8"
    assert kvc.tc_entry(64, 4, 4) == "kv_attention_tc_int4_d64_w4_c4"
    # the dispatched steps a stage: 4 with 8 warps, 2 with 4 (head dim 128, measured), 1 at head dim 64
    assert [kvc.tc_copy_steps(128, w) for w in kvc.TC_WARPS] == [2, 4]
    assert [kvc.tc_copy_steps(64, w) for w in kvc.TC_WARPS] == [1, 1]
    assert kvc.TC_EARLY_STAGES == 1
    # D = 128, 4 warps: query rows, sums and barriers (2176 bytes), then 4 rings of 2 stages
    assert kvc.tc_shared_bytes(128, 4) == 2176 + 4 * 2 * (32 * 64 + 160)
    assert kvc.tc_shared_bytes(128, 4, 2) == 2176 + 4 * 2 * (2 * 32 * 64 + 2 * 4 * 36)
    assert kvc.tc_shared_bytes(128, 8, 4) == 2304 + 8 * 2 * (4 * 32 * 64 + 2 * 4 * 68)
    # the merge (NW x 8 rows of D + 2 floats) never outgrows the rings
    for d, w, cs in ((64, 4, 1), (64, 8, 1), (128, 4, 1), (128, 8, 1)):
        assert kvc.tc_shared_bytes(d, w, cs) >= 4 * w * 8 * (d + 2)
