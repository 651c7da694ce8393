"""Bit-stream packing of unsigned integer codes into int32 words (see formats/grouped-int.md)."""

from __future__ import annotations

import torch


def packed_words(num_codes: int, bits: int) -> int:
    """Number of 32-bit words holding `num_codes` codes of `bits` bits."""
    return (num_codes * bits + 31) // 32


def _positions(num_codes: int, bits: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    start = torch.arange(num_codes, device=device, dtype=torch.int64) * bits
    return start // 32, start % 32


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack `codes` [rows, K] (values in [0, 2^bits)) along the last dim into int32 [rows, ceil(K*bits/32)]."""
    if not 1 <= bits <= 16:
        raise ValueError(f"bits must be in 1..16, got {bits}")
    rows, k = codes.shape
    c = codes.to(torch.int64)
    if c.numel() and (int(c.min()) < 0 or int(c.max()) >= (1 << bits)):
        raise ValueError(f"codes out of range for {bits} bits: [{int(c.min())}, {int(c.max())}]")
    nwords = packed_words(k, bits)
    word, offset = _positions(k, bits, c.device)
    # int64 accumulation: bits never overlap, so adding is the same as or-ing.
    out = torch.zeros(rows, nwords + 1, dtype=torch.int64, device=c.device)
    low = (c << offset) & 0xFFFFFFFF
    out.scatter_add_(1, word.expand(rows, k), low)
    spill = offset + bits > 32
    if bool(spill.any()):
        high = c[:, spill] >> (32 - offset[spill])
        out.scatter_add_(1, (word[spill] + 1).expand(rows, -1), high)
    out = out[:, :nwords]
    out = torch.where(out >= (1 << 31), out - (1 << 32), out)
    return out.to(torch.int32)


def unpack_codes(words: torch.Tensor, bits: int, num_codes: int) -> torch.Tensor:
    """Inverse of `pack_codes`: int32 [rows, W] → int64 codes [rows, num_codes]."""
    if words.dtype != torch.int32:
        raise ValueError(f"packed words must be int32, got {words.dtype}")
    rows = words.shape[0]
    if words.shape[1] != packed_words(num_codes, bits):
        raise ValueError(
            f"expected {packed_words(num_codes, bits)} words per row for {num_codes} codes of "
            f"{bits} bits, got {words.shape[1]}"
        )
    w = words.to(torch.int64) & 0xFFFFFFFF
    w = torch.cat([w, torch.zeros(rows, 1, dtype=torch.int64, device=w.device)], dim=1)
    word, offset = _positions(num_codes, bits, w.device)
    lo = torch.gather(w, 1, word.expand(rows, -1)) >> offset
    hi = torch.gather(w, 1, (word + 1).expand(rows, -1)) << (32 - offset)
    mask = (1 << bits) - 1
    return (lo | hi) & mask
