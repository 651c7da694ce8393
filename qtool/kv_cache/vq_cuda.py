"""The vector-quantized KV cache on CUDA (kernels/kv_cache/vq.cu, formats/vq.md "KV cache"): a static cache of
8-bit codes, one per group of `d` channels of every cached key (after RoPE) and value vector, into codebooks per KV
head and channel group (CQ-2: d 4, CQ-4: d 2, 256 entries); the write that fills it (rotary embedding fused with
the nearest-entry encoding, exactly qtool/kv_cache/vq.py `encode`) and one decode step's attention over
the codes.

The torch forms here (`reference_write`, `decoded`, `reference_attention`) are what the kernels are tested
against."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from qtool.cuda import compile as cc
from qtool.cuda import dependent_launch

SOURCE = "kv_cache/vq.cu"
THREADS = 256  # the write's blocks, and attention's above 2 query heads per KV head (registers)
WIDE_THREADS = 512  # attention's blocks for 1-2 query heads per KV head
TILE = 16  # tokens per tile of the code layout
HEAD_DIMS = (64, 128)
VECTOR_SIZES = (2, 4)
GROUPS = (1, 2, 3, 4, 8)  # query heads per KV head the attention kernels are built for
# Decode attention forms (kernels/kv_cache/vq.cu): `lut` reads per-query score tables (256 x G float32 per query
# head, where they fit beside the value entries), `direct` multiplies the key entries with the query.
FORMS = ("lut", "direct")
LUT_GROUPS = {(64, 2): (1, 2, 4), (64, 4): (1, 2, 4), (128, 2): (1, 2), (128, 4): (1, 2, 4)}
MAX_SHARED = 227 * 1024
MIN_SPLIT_TOKENS = 256  # a split rebuilds its tables: at least this much of the cache to amortize them
MAX_SPLITS = 32
ALIGN = 32  # the capacity is a multiple: a lane loads 32 tokens' codes of a group in two 16-byte loads
LOG2E = 1.4426950408889634


@dataclass
class VQCache:
    """One layer's cache. Codes k, v [B, KVH, L / 16, G, 16] uint8 (tiles of 16 tokens, group-major inside a tile;
    L a multiple of 32; `token_major` gives [B, KVH, G, L]); codebooks k_book, v_book [KVH, E, G, d] float16, the
    kernels' entry-major order of the checkpoint's [KVH, G, E, d]."""

    k: torch.Tensor
    v: torch.Tensor
    k_book: torch.Tensor
    v_book: torch.Tensor

    @property
    def batch(self) -> int:
        return self.k.shape[0]

    @property
    def kv_heads(self) -> int:
        return self.k.shape[1]

    @property
    def groups(self) -> int:
        return self.k.shape[3]

    @property
    def length(self) -> int:
        return self.k.shape[2] * TILE

    @property
    def entries(self) -> int:
        return self.k_book.shape[1]

    @property
    def vector_size(self) -> int:
        return self.k_book.shape[3]

    @property
    def head_dim(self) -> int:
        return self.groups * self.vector_size

    def nbytes(self) -> int:
        """Codes and codebooks."""
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.k_book, self.v_book))


def bytes_per_token(kv_heads: int, head_dim: int, vector_size: int) -> int:
    """Cache bytes one token adds in one layer (keys and values): one byte per group."""
    return 2 * kv_heads * (head_dim // vector_size)


def kernel_books(codebooks: torch.Tensor) -> torch.Tensor:
    """[KVH, G, E, d] (the checkpoint's order) -> [KVH, E, G, d] float16 contiguous (the kernels')."""
    return codebooks.to(torch.float16).transpose(1, 2).contiguous()


def check_books(name: str, books: torch.Tensor) -> None:
    if books.dim() != 4 or books.dtype != torch.float16 or not books.is_cuda:
        raise ValueError(
            f"{name}: found {books.dtype} {list(books.shape)} on {books.device}, expected float16 "
            f"[KVH, G, E, d] on CUDA"
        )
    _, g, e, d = books.shape
    if d not in VECTOR_SIZES or g * d not in HEAD_DIMS or e > 256 or e < 8 or e & (e - 1):
        raise ValueError(
            f"{name}: found {g} groups of {d} channels and {e} entries, expected d in {VECTOR_SIZES}, "
            f"head_dim G*d in {HEAD_DIMS} and 8 to 256 entries, a power of two"
        )


def allocate(
    key_books: torch.Tensor, value_books: torch.Tensor, batch: int, length: int, device: torch.device
) -> VQCache:
    """A cache for `batch` sequences of at least `length` positions (rounded up to a multiple of 32) over the
    codebooks [KVH, G, E, d] float16 of one attention layer (keys after RoPE, values)."""
    check_books("key codebooks", key_books)
    check_books("value codebooks", value_books)
    if key_books.shape != value_books.shape:
        raise ValueError(
            f"value codebooks: found {list(value_books.shape)}, expected the keys' {list(key_books.shape)}"
        )
    kvh, g = key_books.shape[:2]
    cap = -(-max(1, length) // ALIGN) * ALIGN
    codes = [
        torch.zeros(batch, kvh, cap // TILE, g, TILE, dtype=torch.uint8, device=device) for _ in range(2)
    ]
    return VQCache(
        codes[0], codes[1], kernel_books(key_books).to(device), kernel_books(value_books).to(device)
    )


def _module(head_dim: int, vector_size: int, dev: int):
    return cc.load_module(SOURCE, (f"-DVQ_D={head_dim}", f"-DVQ_DV={vector_size}"), device=dev)


def write(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    pos: torch.Tensor,
    cache: VQCache,
    heads: int,
    dequantized: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """qkv float16 [B, T, heads + 2 KVH, D]; cos/sin float16 [L', D/2] indexed by the int64 positions `pos` [T].
    Rotates queries and keys, encodes keys and values into `cache` at the positions and returns the rotated
    queries [B, heads, T, D], plus the entries chosen for the keys and values [B, KVH, T, D] when `dequantized`
    (what prefill attention reads)."""
    kvh, d = cache.kv_heads, cache.head_dim
    if qkv.dim() != 4 or qkv.shape[2] != heads + 2 * kvh or qkv.shape[3] != d or qkv.shape[0] != cache.batch:
        raise ValueError(f"qkv: found {list(qkv.shape)}, expected [{cache.batch}, T, {heads + 2 * kvh}, {d}]")
    b, t = qkv.shape[:2]
    for name, x in (("qkv", qkv), ("cos", cos), ("sin", sin)):
        cc.check_f16(name, x)
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] != d // 2:
        raise ValueError(
            f"cos/sin: found {list(cos.shape)} and {list(sin.shape)}, expected [L, {d // 2}] each"
        )
    if pos.dtype != torch.int64 or pos.shape != (t,) or pos.device != qkv.device:
        raise ValueError(
            f"pos: found {pos.dtype} {list(pos.shape)} on {pos.device}, expected int64 [{t}] on {qkv.device}"
        )
    if heads % kvh:
        raise ValueError(f"heads: found {heads} query heads over {kvh} KV heads, expected a multiple")
    q = torch.empty(b, heads, t, d, dtype=torch.float16, device=qkv.device)
    deq_k = deq_v = None
    if dequantized:
        deq_k = torch.empty(b, kvh, t, d, dtype=torch.float16, device=qkv.device)
        deq_v = torch.empty_like(deq_k)
    dev = cc.device_index(qkv.device)
    items = b * t * (heads + 2 * kvh * cache.groups)
    blocks = max(1, min(-(-items // (THREADS // 32)), cc.sm_count(dev) * 8))
    dependent_launch.launch(
        _module(d, cache.vector_size, dev).fn("vq_write"),
        (blocks,),
        (THREADS,),
        (
            cc.ptr(qkv),
            cc.ptr(cos),
            cc.ptr(sin),
            cc.ptr(pos),
            cc.ptr(cache.k_book),
            cc.ptr(cache.v_book),
            cc.ptr(q),
            cc.ptr(cache.k),
            cc.ptr(cache.v),
            cc.ptr(deq_k),
            cc.ptr(deq_v),
            cc.i32(b),
            cc.i32(t),
            cc.i32(heads),
            cc.i32(kvh),
            cc.i32(d),
            cc.i32(cache.vector_size),
            cc.i32(cache.entries),
            cc.i32(cache.length),
        ),
        device=dev,
    )
    return q, deq_k, deq_v


def threads(group: int) -> int:
    """Threads of an attention block for `group` query heads per KV head (kernels/kv_cache/vq.cu)."""
    return WIDE_THREADS if group <= 2 else THREADS


def attention_form(group: int, head_dim: int, vector_size: int, pairs: int, sms: int) -> str:
    """The decode attention form the dispatch picks (FORMS): the score tables where they are built, unless the
    (sequence, KV head) pairs are fewer than the SMs: then the cache is split and each part's blocks build their
    tables for few tokens, where the direct form measured as fast or faster (kernels/NOTES.md, CQ section)."""
    if pairs < sms:
        return "direct"
    return "lut" if group in LUT_GROUPS.get((head_dim, vector_size), ()) else "direct"


def shared_bytes(form: str, group: int, head_dim: int, vector_size: int, entries: int) -> int:
    """Dynamic shared memory of one attention block: the key tables and value entries, or the warps' partial
    outputs at the merge (the same memory, later)."""
    g = head_dim // vector_size
    entries_bytes = entries * g * vector_size * 2
    keys = group * entries * g * 4 if form == "lut" else entries_bytes
    streams = 32 // min(g, 32)
    merge = (threads(group) // 32) * streams * group * (head_dim + 2) * 4
    return max(keys + entries_bytes, merge)


def attention_splits(pairs: int, length: int, slots: int) -> int:
    """Parts along the cache: enough blocks for every resident slot of the GPU when the (sequence, KV head) pairs
    alone are fewer, each part at least MIN_SPLIT_TOKENS of the cache's capacity, at most MAX_SPLITS."""
    if pairs >= slots:
        return 1
    return max(1, min(-(-slots // pairs), length // MIN_SPLIT_TOKENS, MAX_SPLITS))


def attention(
    q: torch.Tensor,
    cache: VQCache,
    pos: torch.Tensor,
    out: torch.Tensor | None = None,
    form: str | None = None,
    splits: int | None = None,
) -> torch.Tensor:
    """One decode step: q float16 [B, H, 1, D] attends to cache positions 0..pos (pos int64 [1]). Returns (or
    fills `out`) float16 [B, 1, H, D], the layout the output projection reads. `form` forces lut or direct,
    `splits` the parts along the cache (default: `attention_splits`)."""
    cc.check_f16("q", q)
    b, kvh, length, d = cache.batch, cache.kv_heads, cache.length, cache.head_dim
    if (
        q.dim() != 4
        or q.shape[0] != b
        or q.shape[2] != 1
        or q.shape[3] != d
        or q.shape[1] % kvh
        or q.shape[1] // kvh not in GROUPS
    ):
        raise ValueError(
            f"q: found {list(q.shape)}, expected [{b}, H, 1, {d}] with H a multiple of {kvh} KV heads, "
            f"{'/'.join(map(str, GROUPS))} per KV head"
        )
    if pos.dtype != torch.int64 or pos.numel() != 1 or pos.device != q.device:
        raise ValueError(
            f"pos: found {pos.dtype} {list(pos.shape)} on {pos.device}, expected int64 [1] on {q.device}"
        )
    h = q.shape[1]
    r = h // kvh
    dv = cache.vector_size
    dev = cc.device_index(q.device)
    if form is None:
        form = attention_form(r, d, dv, b * kvh, cc.sm_count(dev))
    if form not in FORMS or (form == "lut" and r not in LUT_GROUPS[(d, dv)]):
        raise ValueError(
            f"form: found {form!r} for {r} query heads per KV head, expected direct, or lut for "
            f"{LUT_GROUPS[(d, dv)]}"
        )
    smem = shared_bytes(form, r, d, dv, cache.entries)
    if smem > MAX_SHARED:
        raise ValueError(f"form {form}: needs {smem} bytes of shared memory, expected at most {MAX_SHARED}")
    out = cc.f16_out(out, (b, 1, h, d), q.device)
    module = _module(d, dv, dev)
    fn = module.fn(f"vq_attention_{form}_d{d}_v{dv}_r{r}")
    cc.allow_shared_memory(fn, smem)
    if splits is None:
        slots = cc.sm_count(dev) * cc.resident_blocks(fn, threads(r), smem + 4 * r * d, dev)
        splits = attention_splits(b * kvh, length, slots)
    if not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"splits: found {splits}, expected 1 to {MAX_SPLITS}")
    part = torch.empty(
        b * kvh * splits * r * (d + 2) if splits > 1 else 1, dtype=torch.float32, device=q.device
    )
    dependent_launch.launch(
        fn,
        (b * kvh, splits),
        (threads(r),),
        (
            cc.ptr(q),
            cc.ptr(cache.k),
            cc.ptr(cache.v),
            cc.ptr(cache.k_book),
            cc.ptr(cache.v_book),
            cc.ptr(pos),
            cc.ptr(out),
            cc.i32(h),
            cc.i32(kvh),
            cc.i32(length),
            cc.i32(cache.entries),
            cc.f32(LOG2E / math.sqrt(d)),
            cc.i32(splits),
            cc.ptr(part),
        ),
        shared_mem=smem,
        device=dev,
    )
    if splits > 1:
        dependent_launch.launch(
            module.fn("vq_attention_combine"),
            (b * kvh,),
            (256,),
            (cc.ptr(part), cc.ptr(out), cc.i32(h), cc.i32(kvh), cc.i32(r), cc.i32(d), cc.i32(splits)),
            device=dev,
        )
    return out


# -- torch forms (the reference) --------------------------------------------------------------------------------


def token_major(codes: torch.Tensor) -> torch.Tensor:
    """Codes [B, KVH, L / 16, G, 16] -> [B, KVH, G, L] (a copy)."""
    b, h, tiles, g, _ = codes.shape
    return codes.permute(0, 1, 3, 2, 4).reshape(b, h, g, tiles * TILE)


def checkpoint_books(cache: VQCache, which: str) -> torch.Tensor:
    """The codebooks [KVH, G, E, d] in the checkpoint's order."""
    return (cache.k_book if which == "k" else cache.v_book).transpose(1, 2)


def reference_write(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor, cache: VQCache, heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What `write` does, in torch (rotary embedding as qtool/kv_cache/cuda.py `rope_half`, codes by
    qtool/kv_cache/vq.py `encode`): returns (rotated queries, decoded keys, decoded values)."""
    from qtool.kv_cache.cuda import rope_half
    from qtool.kv_cache.vq import decode, encode

    kvh = cache.kv_heads
    x = qkv.transpose(1, 2)  # [B, heads + 2 KVH, T, D]
    c, s = cos[pos], sin[pos]
    q = rope_half(x[:, :heads], c, s)
    k = rope_half(x[:, heads : heads + kvh], c, s)
    v = x[:, heads + kvh :]
    out = []
    for src, codes_t, which in ((k, cache.k, "k"), (v, cache.v, "v")):
        books = checkpoint_books(cache, which)
        codes = encode(src, books)  # [B, KVH, T, G]
        codes_t[:, :, pos // TILE, :, pos % TILE] = codes.permute(2, 0, 1, 3).to(torch.uint8)
        out.append(decode(codes, books, torch.float16))
    return q.contiguous(), out[0], out[1]


def decoded(cache: VQCache, which: str, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The cached keys or values [B, KVH, L, D] as `dtype`."""
    from qtool.kv_cache.vq import decode

    codes = token_major(cache.k if which == "k" else cache.v).permute(0, 1, 3, 2).long()
    return decode(codes, checkpoint_books(cache, which).to(dtype), dtype)


def reference_attention(q: torch.Tensor, cache: VQCache, pos: int) -> torch.Tensor:
    """Float64 attention of q [B, H, 1, D] over the decoded cache positions 0..pos: [B, 1, H, D]."""
    h, kvh = q.shape[1], cache.kv_heads
    n = min(pos + 1, cache.length)
    k = decoded(cache, "k")[:, :, :n].repeat_interleave(h // kvh, dim=1)
    v = decoded(cache, "v")[:, :, :n].repeat_interleave(h // kvh, dim=1)
    att = torch.softmax(q.double() @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1)
    return (att @ v).transpose(1, 2)
