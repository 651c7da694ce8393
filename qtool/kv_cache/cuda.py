"""The quantized KV cache on CUDA (kernels/kv_cache/quantized.cu, formats/qoq.md "KV cache"): a static cache of 4- or 8-bit
codes with a float16 (scale, zero) per token and KV head, the write that fills it (rotary embedding fused with the
quantization, bit-identical to qtool/kv_cache/quantized.py `quantize_kv`) and one decode step's attention that reads
it. An FP8 (e4m3, one scale per tensor) cache runs through the same kernels as the baseline.

The torch forms here (`reference_write`, `dequantize`, `reference_attention`) are what the kernels are tested
against."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from qtool.cuda import compile as cc
from qtool.cuda import dependent_launch

SOURCE = "kv_cache/quantized.cu"
THREADS = 256
MODES = ("int4", "int8", "fp8")
BITS = {"int4": 4, "int8": 8, "fp8": 8}
MAX_GROUP = 8  # query heads per KV head the attention kernel holds at once
# Decode attention forms (kernels/kv_cache/quantized.cu): `fma` on the CUDA cores (every mode, G = 1..8), `tc` on the
# tensor cores (KV4 at head dims TC_HEAD_DIMS, every G: 1.6-1.8x the `fma` form at G = 1 from batch 16, and `fma`'s
# 2G FMAs per code outrun the FMA pipe from G = 4; kernels/kv_cache/NOTES.md, KV4 section)
ATTENTION_KERNELS = ("fma", "tc")
FORM_NAMES = {"fma": "CUDA cores", "tc": "tensor cores"}  # how reports name the forms
TC_HEAD_DIMS = (64, 128)
TC_WARPS = (4, 8)  # warps a block holds: 8 where the (sequence, KV head) pairs alone do not fill the GPU
TC_MIN_SPLIT_TOKENS = 64  # one 16-token step for each of a block's warps
TC_MAX_SPLITS = 32
# The cache is split only where the pairs do not fill the multiprocessors, into at most this many parts: the
# measured best on an H200 (Llama-2-7B heads at batch 1, 32 pairs: 4 parts, 7.2 us against 9.9 unsplit; 128 pairs:
# unsplit; kernels/kv_cache/NOTES.md)
TC_SPLIT_CAP = 4
# stages of 16 tokens in each warp's ring of bulk copies (the tensor-core form): the steps a warp has in flight
TC_STAGES = 2
# 16-token steps a stage of that ring holds, filled by four bulk copies (key rows, value rows, their two parameter
# runs): 1 (entries without `_c`: four copies a step, every NW-th step a warp) or 2, 4 (entries `_c2`, `_c4`: half or
# a quarter of the copies, a warp's steps contiguous, CS times the ring's shared memory). None: `tc_copy_steps`.
TC_COPY_STEPS: int | None = None
TC_COPY_STEP_CHOICES = (1, 2, 4)
# stages of each ring whose copies the `_c` entries issue before the query is staged (1 .. TC_STAGES; the rest right
# after it); None: all of them, as the one-step form does
TC_EARLY_STAGES: int | None = 1
LOG2E = 1.4426950408889634


@dataclass
class KVCache:
    """One layer's cache. codes [B, KVH, L, D * bits / 8] uint8; params [B, KVH, L, 2] float16 (scale, zero) for
    the integer modes, None for fp8, whose per-tensor scales are `k_scale`/`v_scale`."""

    mode: str
    k: torch.Tensor
    v: torch.Tensor
    k_params: torch.Tensor | None
    v_params: torch.Tensor | None
    head_dim: int
    k_scale: float = 1.0
    v_scale: float = 1.0

    @property
    def batch(self) -> int:
        return self.k.shape[0]

    @property
    def kv_heads(self) -> int:
        return self.k.shape[1]

    @property
    def length(self) -> int:
        return self.k.shape[2]

    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size()
            for t in (self.k, self.v, self.k_params, self.v_params)
            if t is not None
        )


def check_shape(mode: str, head_dim: int) -> None:
    if mode not in MODES:
        raise ValueError(f"KV cache mode: found {mode!r}, expected one of {', '.join(MODES)}")
    epw = 32 // BITS[mode]
    if head_dim % epw or head_dim // epw > 32 or head_dim % 2:
        raise ValueError(
            f"KV cache {mode}: found head_dim {head_dim}, expected a multiple of {epw} up to {32 * epw}"
        )


def bytes_per_token(mode: str, kv_heads: int, head_dim: int) -> int:
    """Cache bytes one token adds in one layer (keys and values)."""
    params = 0 if mode == "fp8" else 4
    return 2 * kv_heads * (head_dim * BITS[mode] // 8 + params)


def allocate(
    mode: str,
    batch: int,
    kv_heads: int,
    length: int,
    head_dim: int,
    device: torch.device,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> KVCache:
    check_shape(mode, head_dim)
    width = head_dim * BITS[mode] // 8
    codes = [torch.zeros(batch, kv_heads, length, width, dtype=torch.uint8, device=device) for _ in range(2)]
    params = (
        [None, None]
        if mode == "fp8"
        else [torch.zeros(batch, kv_heads, length, 2, dtype=torch.float16, device=device) for _ in range(2)]
    )
    return KVCache(mode, codes[0], codes[1], params[0], params[1], head_dim, k_scale, v_scale)


def _check_arch(mode: str, device: torch.device) -> None:
    if mode == "fp8" and torch.cuda.get_device_capability(device) < (8, 9):
        raise ValueError("KV cache fp8: needs e4m3 conversions (compute capability 8.9 or newer)")


def write(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    pos: torch.Tensor,
    cache: KVCache,
    heads: int,
    dequantized: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """qkv float16 [B, T, heads + 2 KVH, D]; cos/sin float16 [L', D/2] indexed by the int64 positions `pos` [T].
    Rotates queries and keys, quantizes keys and values into `cache` at the positions and returns the rotated
    queries [B, heads, T, D], plus the dequantized keys and values [B, KVH, T, D] when `dequantized` (what prefill
    attention reads)."""
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
    if heads % kvh or d > 256:
        raise ValueError(
            f"heads: found {heads} query heads over {kvh} KV heads of {d}, expected a multiple and "
            f"head_dim <= 256"
        )
    _check_arch(cache.mode, qkv.device)
    q = torch.empty(b, heads, t, d, dtype=torch.float16, device=qkv.device)
    deq_k = deq_v = None
    if dequantized:
        deq_k = torch.empty(b, kvh, t, d, dtype=torch.float16, device=qkv.device)
        deq_v = torch.empty_like(deq_k)
    dev = cc.device_index(qkv.device)
    vectors = b * t * (heads + 2 * kvh)
    warps = THREADS // 32
    blocks = max(1, min(-(-vectors // warps), cc.sm_count(dev) * 8))
    dependent_launch.launch(
        _module(dev).fn(f"kv_write_{cache.mode}"),
        (blocks,),
        (THREADS,),
        (
            cc.ptr(qkv),
            cc.ptr(cos),
            cc.ptr(sin),
            cc.ptr(pos),
            cc.ptr(q),
            cc.ptr(cache.k),
            cc.ptr(cache.v),
            cc.ptr(cache.k_params),
            cc.ptr(cache.v_params),
            cc.ptr(deq_k),
            cc.ptr(deq_v),
            cc.i32(b),
            cc.i32(t),
            cc.i32(heads),
            cc.i32(kvh),
            cc.i32(d),
            cc.i32(cache.length),
            cc.f32(cache.k_scale),
            cc.f32(cache.v_scale),
        ),
        shared_mem=warps * d,
        device=dev,
    )
    return q, deq_k, deq_v


def words_per_lane(mode: str, group: int, head_dim: int) -> int:
    """2 (a lane loads 8 bytes of a row) where the registers for 2 query heads allow it, else 1."""
    return 2 if group <= 2 and (head_dim // (32 // BITS[mode])) % 2 == 0 else 1


def attention_kernel(mode: str, group: int, head_dim: int) -> str:
    """The decode attention form the dispatch picks (ATTENTION_KERNELS)."""
    if mode == "int4" and head_dim in TC_HEAD_DIMS:
        return "tc"
    return "fma"


def _module(dev: int):
    return cc.load_module(SOURCE, (f"-DTC_STAGES={TC_STAGES}",), device=dev)


def tc_shared_bytes(head_dim: int, warps: int, copy_steps: int = 1) -> int:
    """Dynamic shared memory of the tensor-core form (kernels/kv_cache/quantized.cu): the query rows, their sums
    and the barriers, then each warp's ring (its stages: 16 key and 16 value rows a step, 16 + 4 words of
    parameters a step and run, plus 4), which the final merge of the warps reuses."""
    ring_offset = -(-(16 * head_dim + 64 + 8 * TC_STAGES * warps) // 128) * 128
    stage = 32 * copy_steps * (head_dim // 2) + 2 * 4 * (16 * copy_steps + 4)
    merge = 4 * warps * 8 * (head_dim + 2)
    return ring_offset + max(warps * TC_STAGES * stage, merge)


def tc_warps(pairs: int, sms: int) -> int:
    """Warps of a tensor-core block: more where the pairs leave multiprocessors idle."""
    return TC_WARPS[1] if pairs < sms else TC_WARPS[0]


@functools.cache
def _sm_count(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def attention_splits(pairs: int, length: int, sms: int) -> int:
    """Parts along the cache for the tensor-core form: one where the (sequence, KV head) pairs fill the
    multiprocessors, else enough for one block per multiprocessor up to TC_SPLIT_CAP, each part at least
    TC_MIN_SPLIT_TOKENS of the cache's capacity."""
    if pairs >= sms:
        return 1
    return max(1, min(sms // pairs, TC_SPLIT_CAP, length // TC_MIN_SPLIT_TOKENS))


def tc_copy_steps(head_dim: int, warps: int) -> int:
    """Steps a ring stage holds by default (TC_COPY_STEPS unless None). One `scripts/kv4_attention_variants.py` run
    (H200, head dim 128, 1024 tokens, the first stage copied early; kernels/kv_cache/NOTES.md): 4 ahead where a block
    has 8 warps (Llama-3-8B heads at batch 1 / 16: 8.6 / 12.6 us against 10.8 / 15.8 with one step; Llama-2-7B at
    batch 1 7.4 against 7.1), 2 ahead with 4 warps (batch 16-160 of Llama-2-7B heads, 64-160 of Llama-3-8B: 4-8%).
    Head dim 64 keeps one step (not timed)."""
    if TC_COPY_STEPS is not None:
        return TC_COPY_STEPS
    if head_dim != 128:
        return 1
    return 4 if warps == TC_WARPS[1] else 2


def tc_entry(head_dim: int, warps: int, copy_steps: int = 1) -> str:
    """The tensor-core form's kernel for these options."""
    return f"kv_attention_tc_int4_d{head_dim}_w{warps}" + (f"_c{copy_steps}" if copy_steps > 1 else "")


def attention_form(
    mode: str,
    group: int,
    head_dim: int,
    kernel: str | None = None,
    wpl: int | None = None,
    splits: int | None = None,
    warps: int | None = None,
    copy_steps: int | None = None,
    early_stages: int | None = None,
) -> str:
    """The form `attention` runs for these arguments (`attention_kernel` unless `kernel` or `wpl` says), after
    checking that the options asked for belong to it."""
    if kernel is None:
        kernel = "fma" if wpl is not None else attention_kernel(mode, group, head_dim)
    if kernel not in ATTENTION_KERNELS:
        raise ValueError(f"kernel: found {kernel!r}, expected one of {ATTENTION_KERNELS}")
    if kernel == "fma" and any(x is not None for x in (warps, splits, copy_steps, early_stages)):
        raise ValueError(
            "kernel fma: found warps, splits, copy_steps or early_stages, which only the tensor-core form (tc) "
            "takes"
        )
    if kernel == "tc" and (mode != "int4" or head_dim not in TC_HEAD_DIMS or wpl is not None):
        raise ValueError(
            f"kernel tc: found a {mode} cache of head dim {head_dim}{', wpl' if wpl else ''}; "
            f"expected int4 and a head dim in {TC_HEAD_DIMS}"
        )
    if warps is not None and warps not in TC_WARPS:
        raise ValueError(f"warps: found {warps}, expected one of {TC_WARPS}")
    if splits is not None and not 1 <= splits <= TC_MAX_SPLITS:
        raise ValueError(f"splits: found {splits}, expected 1 to {TC_MAX_SPLITS}")
    if copy_steps is not None and copy_steps not in TC_COPY_STEP_CHOICES:
        raise ValueError(f"copy_steps: found {copy_steps}, expected one of {TC_COPY_STEP_CHOICES}")
    return kernel


def attention(
    q: torch.Tensor,
    cache: KVCache,
    pos: torch.Tensor,
    out: torch.Tensor | None = None,
    wpl: int | None = None,
    kernel: str | None = None,
    splits: int | None = None,
    warps: int | None = None,
    copy_steps: int | None = None,
    early_stages: int | None = None,
) -> torch.Tensor:
    """One decode step: q float16 [B, H, 1, D] attends to cache positions 0..pos (pos int64 [1]). Returns (or
    fills `out`) float16 [B, 1, H, D], the layout the output projection reads. `wpl` forces the CUDA-core
    kernel's words per lane (1, or 2 where `words_per_lane` allows it); `kernel` the form (fma, tc); `splits`
    the tensor-core form's parts along the cache (default: `attention_splits`), `warps` its warps a block
    (default: `tc_warps`), `copy_steps` the steps a stage of its rings holds (TC_COPY_STEP_CHOICES; default
    `tc_copy_steps`), `early_stages` with more than one step a stage: the stages copied before the query is staged
    (default TC_EARLY_STAGES)."""
    cc.check_f16("q", q)
    b, kvh, length, d = cache.batch, cache.kv_heads, cache.length, cache.head_dim
    if (
        q.dim() != 4
        or q.shape[0] != b
        or q.shape[2] != 1
        or q.shape[3] != d
        or q.shape[1] % kvh
        or q.shape[1] // kvh > MAX_GROUP
    ):
        raise ValueError(
            f"q: found {list(q.shape)}, expected [{b}, H, 1, {d}] with H a multiple of {kvh} KV heads, "
            f"at most {MAX_GROUP} per KV head"
        )
    if pos.dtype != torch.int64 or pos.numel() != 1 or pos.device != q.device:
        raise ValueError(
            f"pos: found {pos.dtype} {list(pos.shape)} on {pos.device}, expected int64 [1] on {q.device}"
        )
    _check_arch(cache.mode, q.device)
    h = q.shape[1]
    g = h // kvh
    kernel = attention_form(cache.mode, g, d, kernel, wpl, splits, warps, copy_steps, early_stages)
    out = cc.f16_out(out, (b, 1, h, d), q.device)
    dev = cc.device_index(q.device)
    if kernel == "tc":
        cc.check_f16("q", q, aligned=True)  # the query rows are staged by 16-byte loads
        module = _module(dev)
        sms = _sm_count(dev)
        warps = tc_warps(b * kvh, sms) if warps is None else warps
        copy_steps = tc_copy_steps(d, warps) if copy_steps is None else copy_steps
        if copy_steps not in TC_COPY_STEP_CHOICES:  # the module constant, set by hand
            raise ValueError(f"TC_COPY_STEPS: found {copy_steps}, expected one of {TC_COPY_STEP_CHOICES}")
        if copy_steps == 1 and early_stages is not None:
            raise ValueError(
                f"early_stages: found {early_stages} with one step a stage, which copies all {TC_STAGES} stages "
                "early; expected it only with copy_steps 2 or 4"
            )
        early = early_stages if early_stages is not None else TC_EARLY_STAGES
        early = TC_STAGES if early is None else early
        if not 1 <= early <= TC_STAGES:
            raise ValueError(f"early_stages: found {early}, expected 1 to {TC_STAGES}")
        fn = module.fn(tc_entry(d, warps, copy_steps))
        smem = tc_shared_bytes(d, warps, copy_steps)
        cc.allow_shared_memory(fn, smem)
        # the stages are filled by 16-byte bulk copies of whole rows and parameter runs
        for name in ("k", "v", "k_params", "v_params"):
            t = getattr(cache, name)
            if t.data_ptr() % 16 or not t.is_contiguous():
                raise ValueError(
                    f"cache.{name}: found a tensor not contiguous from a 16-byte boundary; expected one"
                )
        if splits is None:
            splits = attention_splits(b * kvh, length, sms)
        part = torch.empty(
            b * kvh * splits * 8 * (d + 2) if splits > 1 else 1, dtype=torch.float32, device=q.device
        )
        dependent_launch.launch(
            fn,
            (b * kvh, splits),
            (32 * warps,),
            (
                cc.ptr(q),
                cc.ptr(cache.k),
                cc.ptr(cache.v),
                cc.ptr(cache.k_params),
                cc.ptr(cache.v_params),
                cc.ptr(pos),
                cc.ptr(out),
                cc.i32(h),
                cc.i32(kvh),
                cc.i32(length),
                cc.i32(g),
                cc.f32(LOG2E / math.sqrt(d)),
                cc.i32(splits),
                cc.ptr(part),
                *((cc.i32(early),) if copy_steps > 1 else ()),
            ),
            shared_mem=smem,
            device=dev,
        )
        if splits > 1:
            dependent_launch.launch(
                module.fn(f"kv_attention_tc_combine_d{d}"),
                (b * kvh,),
                (256,),
                (cc.ptr(part), cc.ptr(out), cc.i32(h), cc.i32(kvh), cc.i32(g), cc.i32(splits)),
                device=dev,
            )
        return out
    smem = 4 * max(g * d + g, (THREADS // 32) * g * (d + 2))
    best = words_per_lane(cache.mode, g, d)
    if wpl is None:
        wpl = best
    elif wpl not in (1, best):
        raise ValueError(f"wpl: found {wpl}, expected 1 or {best} for {g} query heads per KV head of {d}")
    fn = _module(dev).fn(f"kv_attention_{cache.mode}_g{g}" + ("_w2" if wpl == 2 else ""))
    cc.allow_shared_memory(fn, smem)
    dependent_launch.launch(
        fn,
        (b * kvh,),
        (THREADS,),
        (
            cc.ptr(q),
            cc.ptr(cache.k),
            cc.ptr(cache.v),
            cc.ptr(cache.k_params),
            cc.ptr(cache.v_params),
            cc.ptr(pos),
            cc.ptr(out),
            cc.i32(h),
            cc.i32(kvh),
            cc.i32(length),
            cc.i32(d),
            cc.f32(LOG2E / math.sqrt(d)),
            cc.f32(cache.k_scale),
            cc.f32(cache.v_scale),
        ),
        shared_mem=smem,
        device=dev,
    )
    return out


# -- torch forms (the reference) --------------------------------------------------------------------------------


def rope_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE in float16 arithmetic (each product and sum rounded, as torch's half ops and the kernel
    do); x [..., T, D], cos/sin [T, D/2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _codes(
    x: torch.Tensor, mode: str, scale: float
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """x float16 [..., D] -> (codes uint8 [..., D], params float16 [..., 2] or None, dequantized float16)."""
    if mode == "fp8":
        xf = x.float()
        f8 = (xf / torch.full_like(xf, scale)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        return f8.view(torch.uint8), None, (f8.float() * torch.full_like(xf, scale)).half()
    from qtool.kv_cache.quantized import dequantize_kv, quantize_kv

    c = quantize_kv(x, BITS[mode])
    return c.codes, torch.cat([c.scale, c.zero], dim=-1), dequantize_kv(c, torch.float16)


def pack_codes(codes: torch.Tensor, mode: str) -> torch.Tensor:
    """uint8 codes [..., D] -> the cache's bytes [..., D * bits / 8] (element 2i in the low nibble for int4)."""
    if BITS[mode] == 8:
        return codes
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_codes(raw: torch.Tensor, mode: str) -> torch.Tensor:
    if BITS[mode] == 8:
        return raw
    return torch.stack([raw & 0xF, raw >> 4], dim=-1).flatten(-2)


def reference_write(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor, cache: KVCache, heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What `write` does, in torch: returns (rotated queries, dequantized keys, dequantized values)."""
    kvh = cache.kv_heads
    x = qkv.transpose(1, 2)  # [B, heads + 2 KVH, T, D]
    c, s = cos[pos], sin[pos]
    q = rope_half(x[:, :heads], c, s)
    k = rope_half(x[:, heads : heads + kvh], c, s)
    v = x[:, heads + kvh :]
    deq = []
    for src, codes_t, params_t, scale in (
        (k, cache.k, cache.k_params, cache.k_scale),
        (v, cache.v, cache.v_params, cache.v_scale),
    ):
        codes, params, back = _codes(src, cache.mode, scale)
        codes_t[:, :, pos] = pack_codes(codes, cache.mode)
        if params_t is not None:
            params_t[:, :, pos] = params
        deq.append(back)
    return q.contiguous(), deq[0], deq[1]


def dequantize(cache: KVCache, which: str, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The cached keys or values [B, KVH, L, D] as `dtype`."""
    raw, params, scale = (
        (cache.k, cache.k_params, cache.k_scale) if which == "k" else (cache.v, cache.v_params, cache.v_scale)
    )
    codes = unpack_codes(raw, cache.mode)
    if cache.mode == "fp8":
        return codes.view(torch.float8_e4m3fn).to(dtype) * scale
    return (codes.to(dtype) - params[..., 1:].to(dtype)) * params[..., :1].to(dtype)


def reference_attention(q: torch.Tensor, cache: KVCache, pos: int) -> torch.Tensor:
    """Float64 attention of q [B, H, 1, D] over the dequantized cache positions 0..pos: [B, 1, H, D]."""
    h, kvh = q.shape[1], cache.kv_heads
    n = min(pos + 1, cache.length)
    k = dequantize(cache, "k")[:, :, :n].repeat_interleave(h // kvh, dim=1)
    v = dequantize(cache, "v")[:, :, :n].repeat_interleave(h // kvh, dim=1)
    att = torch.softmax(q.double() @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1)
    return (att @ v).transpose(1, 2)
