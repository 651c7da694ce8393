"""`qtool bench e2e`: prefill and decode throughput of a decoder with random weights, FP16 vs grouped_int, with a
static KV cache.

The decoder here is deliberately small and self-contained (RMSNorm, RoPE, grouped-query attention through
`scaled_dot_product_attention`, SwiGLU MLP) so that a step is capturable (the MoE shapes excepted, below):
positions and cache writes are device tensors, nothing synchronizes with the host. Linear layers are either
`nn.Linear` (FP16) or `GroupedIntLinear` (packed), so the comparison isolates the weight format. On a GPU with CuPy, both models run
the step's small operations as fused kernels: the rotary embedding with the KV-cache write
(qtool/cuda/rope_cache.py, bit-identical to the torch form here), each residual add with the RMSNorm after it
(qtool/cuda/rms_norm.py) and the SwiGLU activation (qtool/cuda/swiglu.py). Attention over an FP16 cache is torch's
`scaled_dot_product_attention` in every format: a timed decode step is captured at one position, so it attends to
the cache's first position + 1 positions (`span`) without a mask, as a torch user's decode would; the quantized
caches (`--throughput`) run their own write and attention kernels.

Families beyond Llama's block (`Dims`):

- `head_dim` is explicit: Qwen3 and Gemma set it apart from hidden / heads (Qwen3-30B-A3B: 2048 / 32 heads, but
  head_dim 128), so the q/k/v and output projections are heads x head_dim wide.
- Qwen3's per-head RMSNorm of queries and keys (`qk_norm`) runs before RoPE as torch's `F.rms_norm` over the
  head dimension of the qkv projection's query and key heads: no kernel fuses it into the rotary + cache-write
  kernel (or the quantized cache's write), so it costs its own launches. It has no host synchronization, so the
  step stays capturable. `--no-qk-norm` runs the same shape without it: the difference between the two runs is
  the measured cost of the unfused step.
- Mixture of experts (`experts`, `top_k`): the MLP becomes a router (a float16 `nn.Linear`, softmax in float32,
  top-k, the k weights renormalized to sum to one, as Mixtral does and Qwen3-MoE with `norm_topk_prob`) and
  experts, each a gate/up and a down linear of the run's format. Each expert runs on the tokens routed to it
  (`index_select`), and its output is added back weighted by the routing weight (`index_add_`). How many tokens
  an expert gets is known only once the router has run, and the per-expert linears need it as a host-side shape,
  so every MoE block synchronizes with the host once. A CUDA graph cannot hold that; a fixed-shape step (every
  token through every expert, or one expert picked by a device-side index into stacked weights) would time a
  different computation or need kernels that read the expert's weights through a device index, which the packed
  formats' kernels do not. So MoE models run eagerly, kernel by kernel from Python, for every format, the FP16
  baseline included; the report says so. At small batches the launch overhead is then part of every format's
  step alike, which narrows the ratios against FP16. The random router spreads tokens about evenly over the
  experts; a trained one does not.
- Gemma 2's block (`geglu`, `post_norms`): the MLP's activation is GeGLU (tanh-approximated GELU of the gate
  times the up projection), and the attention's and the MLP's outputs are each RMS-normalized before they join
  the residual stream. No kernel computes GeGLU, nor the W4A8 codes of its output, so it runs as torch ops and a
  W4A8 down projection quantizes its float16 input itself; the branch norms run as `F.rms_norm`, since the fused
  add + RMSNorm kernel normalizes the sum and these norms come before the add (the add and the next block's
  input norm still run fused). All are capturable. `--llama-block` runs the same shape with Llama's block
  (SwiGLU through the fused path, no branch norms, and without Gemma's embedding scaling and final logit
  soft-capping, a few elementwise kernels): the difference between the two runs is what the unfused Gemma pieces
  cost. Gemma's norms scale by (1 + w); a norm's weight here stands for 1 + w, the same RMSNorm at no cost.
  Attention logit soft-capping (tanh on the scores) is left out: `scaled_dot_product_attention` and the quantized
  caches' attention kernels have no soft-cap, and an eager attention for every format would time a different
  attention than the one the quantized formats are measured in; the report says so. Sliding-window layers are not modelled
  either: while a sequence is no longer than the window (Gemma 2: 4096) they attend to exactly what a full layer
  does, and the report says when a run's sequences are longer.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from qtool.bench import plot, tables
from qtool.bench.stats import BenchError


@dataclass(frozen=True)
class Dims:
    hidden: int
    intermediate: int  # the MLP's width; with experts, each expert's
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    head_dim: int = 0  # 0: hidden // heads
    qk_norm: bool = False  # per-head RMSNorm of queries and keys before RoPE (Qwen3)
    rope_theta: float = 10000.0
    experts: int = 0  # 0: a dense MLP
    top_k: int = 0  # experts per token
    geglu: bool = False  # gelu_tanh(gate) * up instead of SwiGLU (Gemma)
    post_norms: bool = False  # each branch's output RMS-normalized before the residual add (Gemma 2)
    embed_scale: bool = False  # embeddings times sqrt(hidden) (Gemma)
    final_softcap: float = 0.0  # logits = cap * tanh(logits / cap); 0: none
    tie_embeddings: bool = False  # the output projection is the embedding matrix
    # the model's, for the report only: the bench does not run them (module docstring)
    attn_softcap: float = 0.0
    sliding_window: int = 0

    def __post_init__(self) -> None:
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.hidden // self.heads)


# The MoE shapes keep the real model's layer and expert sizes but only 4 of its layers (Mixtral-8x7B has 32,
# Qwen3-30B-A3B 48), so that every format's model fits beside the others' caches and builds in seconds.
MODEL_DIMS: dict[str, Dims] = {
    "llama-2-7b": Dims(4096, 11008, 32, 32, 32, 32000),
    "llama-2-13b": Dims(5120, 13824, 40, 40, 40, 32000),
    "llama-3-8b": Dims(4096, 14336, 32, 32, 8, 128256),
    "mistral-7b": Dims(4096, 14336, 32, 32, 8, 32000),
    "qwen3-8b": Dims(4096, 12288, 36, 32, 8, 151936, head_dim=128, qk_norm=True, rope_theta=1e6),
    "mixtral-8x7b-4l": Dims(4096, 14336, 4, 32, 8, 32000, rope_theta=1e6, experts=8, top_k=2),
    "qwen3-30b-a3b-4l": Dims(
        2048, 768, 4, 32, 4, 151936, head_dim=128, qk_norm=True, rope_theta=1e6, experts=128, top_k=8
    ),
    "gemma-2-9b": Dims(
        3584,
        14336,
        42,
        16,
        8,
        256000,
        head_dim=256,
        geglu=True,
        post_norms=True,
        embed_scale=True,
        final_softcap=30.0,
        tie_embeddings=True,
        attn_softcap=50.0,
        sliding_window=4096,
    ),
    "tiny": Dims(256, 688, 2, 4, 2, 1000),  # for quick checks
}


def dims_for(name: str, qk_norm: bool = True, llama_block: bool = False) -> Dims:
    """The named model's dimensions; `qk_norm` False drops its query/key norms (if it has them), `llama_block`
    its Gemma pieces (GeGLU, branch norms, embedding scaling, final soft-capping), keeping its sizes."""
    key = name.strip().lower()
    if key not in MODEL_DIMS:
        raise BenchError(f"--model-config: found {name!r}, expected one of {', '.join(MODEL_DIMS)}")
    d = MODEL_DIMS[key]
    if not qk_norm:
        d = replace(d, qk_norm=False)
    if llama_block:
        d = replace(d, geglu=False, post_norms=False, embed_scale=False, final_softcap=0.0)
    return d


class RMSNorm(nn.Module):
    eps = 1e-5

    def __init__(self, dim: int, device: torch.device, dtype: torch.dtype = torch.float16) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D]; cos/sin [B or 1, 1, T, D/2] (rotate-half pairing, as in Llama)."""
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


# Fused kernels on CUDA (set False for the torch forms, e.g. to measure what each saves): rotary embedding + cache
# write, residual add + RMSNorm, SwiGLU.
FUSED_ROPE = True
FUSED_NORM = True
FUSED_SWIGLU = True
# A gate/up projection with `forward_swiglu` (mixed-2-4-16: rows interleaved in fours, gate 2j, 2j + 1 then up 2j,
# 2j + 1; random weights, so only the order is declared) returns the SwiGLU activations itself: at one token the
# GEMV computes them in its epilogue, so the step has no SwiGLU kernel and writes no gate/up output.
FUSED_GATE_UP_SWIGLU = True
# W4A8 projections (layers with `takes_codes`) get their INT8 activation codes from the normalization or SwiGLU
# kernel that produces their input, instead of a quantize kernel reading the float16 rows back
FUSED_QUANT = True


def _fusable(flag: bool, device: torch.device, width: int, multiple: int) -> bool:
    if not flag or device.type != "cuda" or width % multiple:
        return False
    from qtool.cuda import compile as cc

    return cc.cupy_available()


class Expert(nn.Module):
    """One expert's gate/up (gate rows first) and down projections; the block runs them (`Block._ffn`)."""

    def __init__(self, gate_up: nn.Module, down: nn.Module) -> None:
        super().__init__()
        self.gate_up = gate_up
        self.down = down


class Block(nn.Module):
    def __init__(
        self, d: Dims, make_linear, device: torch.device, dtype: torch.dtype = torch.float16
    ) -> None:
        super().__init__()
        hd = d.head_dim
        self.d = d
        self.fused_rope = _fusable(FUSED_ROPE, device, hd, 2)
        self.fused_norm = _fusable(FUSED_NORM, device, d.hidden, 8)
        self.fused_swiglu = _fusable(FUSED_SWIGLU, device, d.intermediate, 8)
        # q/k/v and gate/up are fused into one linear each (as serving runtimes do): fewer launches per layer,
        # for the FP16 and the quantized model alike.
        self.qkv = make_linear(d.hidden, (d.heads + 2 * d.kv_heads) * hd)
        self.o = make_linear(d.heads * hd, d.hidden)
        if d.qk_norm:
            self.q_norm = RMSNorm(hd, device, dtype)
            self.k_norm = RMSNorm(hd, device, dtype)
        if d.experts:
            # the router stays in float in every format, as the MoE families keep it when quantized
            self.router = nn.Linear(d.hidden, d.experts, bias=False, device=device, dtype=dtype)
            nn.init.normal_(self.router.weight, std=0.02)
            self.experts = nn.ModuleList(
                Expert(make_linear(d.hidden, 2 * d.intermediate), make_linear(d.intermediate, d.hidden))
                for _ in range(d.experts)
            )
        else:
            self.gate_up = make_linear(d.hidden, 2 * d.intermediate)
            self.down = make_linear(d.intermediate, d.hidden)
        self.n1 = RMSNorm(d.hidden, device, dtype)
        self.n2 = RMSNorm(d.hidden, device, dtype)
        if d.post_norms:
            self.post_attn_norm = RMSNorm(d.hidden, device, dtype)
            self.post_mlp_norm = RMSNorm(d.hidden, device, dtype)

    def _add_norm(
        self, h: torch.Tensor, y: torch.Tensor | None, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + y, norm(h + y)); y None: (h, norm(h))."""
        if self.fused_norm:
            from qtool.cuda.rms_norm import add_rms_norm

            return add_rms_norm(h, y, norm.weight, norm.eps)
        if y is not None:
            h = h + y
        return h, norm(h)

    def _codes_for(self, lin: nn.Module, rows: int) -> bool:
        """Whether `lin` takes its input as INT8 codes from the kernel that produces it (a W4A8 layer at
        `codes_min_tokens` rows or more)."""
        return FUSED_QUANT and getattr(lin, "takes_codes", False) and rows >= lin.codes_min_tokens

    def _norm_linear(
        self, h: torch.Tensor, y: torch.Tensor | None, norm: RMSNorm, lin: nn.Module
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + y, lin(norm(h + y))), the codes of the normalized rows made by the normalization kernel where
        `lin` takes them."""
        if self.fused_norm and self._codes_for(lin, h.numel() // h.shape[-1]):
            from qtool.layouts.qoq.producers import add_rms_norm_codes

            h, _, a = add_rms_norm_codes(h, y, norm.weight, norm.eps, lin.prepared)
            return h, lin.forward_codes(a, h.shape[:-1])
        h, x = self._add_norm(h, y, norm)
        return h, lin(x)

    def qk_norm(self, qkv: torch.Tensor) -> torch.Tensor:
        """qkv [B, T, H + 2 KVH, D] with each query head normalized over D by `q_norm` and each key head by
        `k_norm` (the values as they were); qkv itself without q/k norms. A new contiguous tensor, as the rotary
        kernels read it."""
        if not self.d.qk_norm:
            return qkv
        h, kvh, hd = self.d.heads, self.d.kv_heads, self.d.head_dim
        q = F.rms_norm(qkv[:, :, :h], (hd,), self.q_norm.weight, self.q_norm.eps)
        k = F.rms_norm(qkv[:, :, h : h + kvh], (hd,), self.k_norm.weight, self.k_norm.eps)
        return torch.cat([q, k, qkv[:, :, h + kvh :]], dim=2)

    def forward(
        self,
        h: torch.Tensor,
        y: torch.Tensor | None,
        tables: tuple[torch.Tensor, torch.Tensor],
        cache,
        pos: torch.Tensor,
        decode: bool,
        mask: torch.Tensor | None = None,
        span: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream h with the previous block's output y still to be added (None for the first block),
        so that the add runs inside this block's first normalization. `cache`: (keys, values) float16, or a
        quantized qtool.kv_cache.cuda.KVCache or qtool.kv_cache.vq_cuda.VQCache; not `decode`: prefill from
        position 0. A decode step over a float16 cache attends to the cache's first `span` positions without a mask
        (`span`: a one-token step's position + 1), else to the whole static cache under `mask`; the quantized
        caches' kernels take the position from `pos` and need neither. Returns (h, this block's output)."""
        b, t, _ = h.shape
        d, hd = self.d, self.d.head_dim
        h, qkv = self._norm_linear(h, y, self.n1, self.qkv)
        qkv = self.qk_norm(qkv.view(b, t, d.heads + 2 * d.kv_heads, hd))
        if not isinstance(cache, tuple):
            a = self._quantized_cache_attention(qkv, tables, cache, pos, decode=decode)
            return self._mlp(h, a, b, t)
        kc, vc = cache
        if self.fused_rope:
            from qtool.cuda.rope_cache import rope_cache

            q = rope_cache(qkv, tables[0], tables[1], pos, kc, vc, d.heads, d.kv_heads)
            # prefill starts at position 0, so the cache's first t positions are this step's keys and values
            k, v = kc[:, :, :t], vc[:, :, :t]
        else:
            qkv = qkv.transpose(1, 2)
            cos, sin = tables[0][pos][None, None], tables[1][pos][None, None]
            qk = rope(qkv[:, : d.heads + d.kv_heads], cos, sin)  # one RoPE pass over queries and keys
            q, k = qk[:, : d.heads], qk[:, d.heads :]
            v = qkv[:, d.heads + d.kv_heads :]
            # Static cache [B, KVH, L, D]: write this step's keys at the device-side positions.
            kc.index_copy_(2, pos, k)
            vc.index_copy_(2, pos, v)
        if not decode:  # prefill from position 0: causal over the prompt only
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=d.kv_heads != d.heads)
        elif span is not None and t == 1:
            # The one query is the last of the positions it attends to, so no mask is needed, and SDPA may take its
            # flash kernel, which a mask rules out; the masked form also reads the whole static cache.
            a = F.scaled_dot_product_attention(
                q, kc[:, :, :span], vc[:, :, :span], enable_gqa=d.kv_heads != d.heads
            )
        else:
            a = F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask, enable_gqa=d.kv_heads != d.heads)
        return self._mlp(h, a, b, t)

    def _quantized_cache_attention(
        self,
        qkv: torch.Tensor,
        tables: tuple[torch.Tensor, torch.Tensor],
        cache,
        pos: torch.Tensor,
        decode: bool,
    ) -> torch.Tensor:
        """RoPE + quantized cache write in one kernel; prefill attends to the dequantized keys and values of the
        prompt (what decode steps will read), decode to the cache through the quantized-cache kernel. A
        qtool.kv_cache.vq_cuda.VQCache (codes into codebooks) runs through its own write and attention, which
        take the same arguments."""
        from qtool.kv_cache import cuda as kvc
        from qtool.kv_cache import vq_cuda as vqa

        d = self.d
        if isinstance(cache, vqa.VQCache):
            kvc = vqa
        q, dk, dv = kvc.write(qkv, tables[0], tables[1], pos, cache, d.heads, dequantized=not decode)
        if decode:
            return kvc.attention(q, cache, pos).transpose(1, 2)
        return F.scaled_dot_product_attention(q, dk, dv, is_causal=True, enable_gqa=d.kv_heads != d.heads)

    def _mlp(self, h: torch.Tensor, a: torch.Tensor, b: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The output projection of attention `a` [B, H, T, D], then the MLP (or the experts)."""
        d, hd = self.d, self.d.head_dim
        o = self.o(a.transpose(1, 2).reshape(b, t, d.heads * hd))
        if d.post_norms:
            o = self.post_attn_norm(o)
        if d.experts:
            h, x = self._add_norm(h, o, self.n2)
            return h, self._post_mlp(self.moe(x))
        if not d.geglu and FUSED_GATE_UP_SWIGLU and hasattr(self.gate_up, "forward_swiglu"):
            h, x = self._add_norm(h, o, self.n2)
            return h, self._post_mlp(self.down(self.gate_up.forward_swiglu(x)))
        h, gu = self._norm_linear(h, o, self.n2, self.gate_up)
        return h, self._post_mlp(self._act_down(gu, self.down, b * t))

    def _post_mlp(self, y: torch.Tensor) -> torch.Tensor:
        """The block's output as the residual stream takes it: normalized first where the model has branch
        norms (the next block's fused add + norm adds it)."""
        return self.post_mlp_norm(y) if self.d.post_norms else y

    def _act_down(self, gu: torch.Tensor, down: nn.Module, rows: int) -> torch.Tensor:
        """down(act(gate) * up) of the gate/up projection's output `gu` (gate columns first), GeGLU or SwiGLU."""
        if not self.d.geglu:
            return self._swiglu_down(gu, down, rows)
        gate, up = gu.chunk(2, dim=-1)
        return down(F.gelu(gate, approximate="tanh") * up)

    def _swiglu_down(self, gu: torch.Tensor, down: nn.Module, rows: int) -> torch.Tensor:
        """down(silu(gate) * up) of the gate/up projection's output `gu` (gate columns first)."""
        if self.fused_swiglu and self._codes_for(down, rows):
            from qtool.layouts.qoq.producers import swiglu_codes

            _, codes = swiglu_codes(gu, down.prepared)
            return down.forward_codes(codes, gu.shape[:-1])
        if self.fused_swiglu:
            from qtool.cuda.swiglu import swiglu

            act = swiglu(gu)
        else:
            gate, up = gu.chunk(2, dim=-1)
            act = F.silu(gate) * up
        return down(act)

    def _ffn(self, x: torch.Tensor, ex: Expert) -> torch.Tensor:
        """One expert's gated MLP over the rows x [N, hidden]."""
        if not self.d.geglu and FUSED_GATE_UP_SWIGLU and hasattr(ex.gate_up, "forward_swiglu"):
            return ex.down(ex.gate_up.forward_swiglu(x))
        return self._act_down(ex.gate_up(x), ex.down, x.shape[0])

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The top-k experts of each row of x [N, hidden] and their weights [N, k] (x's dtype): the softmax of
        the router's logits in float32 over all experts, its k largest renormalized to sum to one."""
        probs = torch.softmax(self.router(x).float(), dim=-1)
        w, idx = torch.topk(probs, self.d.top_k, dim=-1)
        return idx, (w / w.sum(dim=-1, keepdim=True)).to(x.dtype)

    def moe(self, x: torch.Tensor) -> torch.Tensor:
        """The experts' weighted sum over the normalized rows x [B, T, hidden]: each expert runs once, on the
        rows routed to it."""
        d = self.d
        x2 = x.reshape(-1, d.hidden)
        idx, w = self.route(x2)
        flat = idx.flatten()
        # one sort groups the (row, slot) pairs by expert, so that a single transfer of the counts to the host
        # (the block's only synchronization) gives every expert its slice
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=d.experts).tolist()
        rows, weights = order // d.top_k, w.flatten()[order]
        out = torch.zeros_like(x2)
        start = 0
        for ex, n in zip(self.experts, counts, strict=True):
            if n:
                r = rows[start : start + n]
                y = self._ffn(x2.index_select(0, r), ex)
                out.index_add_(0, r, y * weights[start : start + n, None])
            start += n
        return out.view_as(x)


class Decoder(nn.Module):
    def __init__(
        self, d: Dims, make_linear, device: torch.device, dtype: torch.dtype = torch.float16
    ) -> None:
        super().__init__()
        self.d = d
        self.embed = nn.Embedding(d.vocab, d.hidden, device=device, dtype=dtype)
        nn.init.normal_(self.embed.weight, std=0.02)
        self.blocks = nn.ModuleList(Block(d, make_linear, device, dtype) for _ in range(d.layers))
        self.norm = RMSNorm(d.hidden, device, dtype)
        if d.tie_embeddings:
            # one matrix in memory, as the model holds it: the weights' bytes and the batch that fits beside
            # them are the model's (256000 x 3584 in float16 is 1.7 GiB for Gemma 2 9B)
            self.lm_head = nn.Linear(d.hidden, d.vocab, bias=False, device="meta", dtype=dtype)
            self.lm_head.weight = self.embed.weight
        else:
            self.lm_head = nn.Linear(d.hidden, d.vocab, bias=False, device=device, dtype=dtype)
            nn.init.normal_(self.lm_head.weight, std=0.02)

    @property
    def graphable(self) -> bool:
        """Whether a step can be captured as a CUDA graph: not with experts, whose routing synchronizes."""
        return not self.d.experts

    def rope_tables(self, max_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        hd = self.d.head_dim
        inv = 1.0 / (self.d.rope_theta ** (torch.arange(0, hd, 2, device=device, dtype=torch.float32) / hd))
        ang = torch.arange(max_len, device=device, dtype=torch.float32)[:, None] * inv[None]
        dtype = self.embed.weight.dtype
        return ang.cos().to(dtype), ang.sin().to(dtype)

    def logits(
        self,
        ids: torch.Tensor,
        pos: torch.Tensor,
        caches: list,
        tables: tuple[torch.Tensor, torch.Tensor],
        decode: bool,
        *,
        span: int | None = None,
    ) -> torch.Tensor:
        """ids [B, T]; pos [T] absolute positions (device), within the cache and the tables; caches: per block
        (keys, values) float16 or a quantized KVCache. `span` (decode only): the number of cache positions a
        one-token step attends to, its position + 1, known on the host because a captured step runs at one
        position; with it, attention over a float16 cache reads those positions through SDPA without a mask
        (quantized caches take their kernels either way). Without it, or for several tokens, attention runs over
        the whole static cache under a mask. Returns the logits of each sequence's last token [B, V]."""
        mask = None
        if span is not None and not decode:
            raise ValueError(
                "span: found a value for a prefill; it is the positions a decode step attends to"
            )
        if decode:
            c0 = caches[0]
            max_len = c0[0].shape[2] if isinstance(c0, tuple) else c0.length
            if span is not None and not 1 <= span <= max_len:
                raise ValueError(f"span: found {span}, expected 1 to {max_len} (the cache's length)")
            # only a float16 cache read without a span needs the mask (the quantized caches' kernels read the
            # position from `pos`)
            if isinstance(c0, tuple) and (span is None or ids.shape[1] != 1):
                mask = (torch.arange(max_len, device=ids.device)[None, :] <= pos[:, None])[None, None]
        h, y = self.embed(ids), None
        if self.d.embed_scale:
            h = h * self.d.hidden**0.5
        for blk, cache in zip(self.blocks, caches, strict=True):
            h, y = blk(h, y, tables, cache, pos, decode, mask, span)
        out = self.lm_head(self.norm(h[:, -1] + y[:, -1]))
        if self.d.final_softcap:
            out = torch.tanh(out / self.d.final_softcap) * self.d.final_softcap
        return out

    def forward(
        self,
        ids: torch.Tensor,
        pos: torch.Tensor,
        caches: list,
        tables: tuple[torch.Tensor, torch.Tensor],
        decode: bool,
        *,
        span: int | None = None,
    ) -> torch.Tensor:
        """The next token per sequence [B] (`logits`' arguments)."""
        return self.logits(ids, pos, caches, tables, decode, span=span).argmax(-1)


def fp16_linear(device: torch.device):
    def make(k: int, n: int) -> nn.Module:
        lin = nn.Linear(k, n, bias=False, device=device, dtype=torch.float16)
        nn.init.normal_(lin.weight, std=0.02)
        return lin

    return make


def quant_linear(device: torch.device, bits: int, group_size: int | None, gen: torch.Generator):
    from qtool.bench.cuda_cases import random_packed
    from qtool.layouts.grouped_int.layout import GroupedIntWeight
    from qtool.layouts.grouped_int.module import GroupedIntLinear
    from qtool.quant.grid import GridSpec

    spec = GridSpec(bits=bits, symmetric=True, group_size=group_size)

    def make(k: int, n: int) -> nn.Module:
        qw, sc, z = random_packed(n, k, bits, group_size, True, device, gen)
        return GroupedIntLinear(GroupedIntWeight(spec, k, n, qw, sc, z))

    return make


class TorchaoInt4Linear(nn.Module):
    """torchao's int4 kernel (qtool/bench/tinygemm.py) as the decoder's linear: it takes bfloat16 only, so the
    float16 rows are cast on the way in and out (two small kernels per linear, timed with it)."""

    def __init__(self, k: int, n: int, group_size: int, device: torch.device, gen: torch.Generator) -> None:
        super().__init__()
        from qtool.bench import tinygemm as tg

        codes, scales, zeros = tg.random_layer(k, n, group_size, device, gen)
        self.packed = tg.pack(codes, scales, zeros, group_size)
        tg.check(
            self.packed,
            codes,
            scales,
            zeros,
            torch.randn(4, k, device=device, generator=gen).to(torch.bfloat16),
        )
        # as buffers, so that weight_bytes counts them
        self.register_buffer("weight", self.packed.weight, persistent=False)
        self.register_buffer("scales_and_zeros", self.packed.scales_and_zeros, persistent=False)
        self.out_features = n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from qtool.bench import tinygemm as tg

        y = tg.matmul(x.reshape(-1, x.shape[-1]).to(torch.bfloat16), self.packed)
        return y.to(torch.float16).reshape(*x.shape[:-1], self.out_features)


def torchao_linear(device: torch.device, group_size: int, gen: torch.Generator):
    return lambda k, n: TorchaoInt4Linear(k, n, group_size, device, gen)


TORCHAO = "torchao-int4"
SDPA_ATTENTION = "torch SDPA (FP16 cache)"
MIXED = "mixed-2-4-16"


def mixed_label(outlier_fraction: float) -> str:
    return f"{MIXED} {100 * outlier_fraction:g}%"


def mixed_linear(device: torch.device, outlier_fraction: float, gen: torch.Generator):
    """Random mixed-2-4-16 linears (block4, g1 = g2 = 16, 25% 4-bit stripes; qtool/layouts/mixed/cuda.py runs them)."""
    from qtool.bench.cuda_cases import random_mixed_weight
    from qtool.layouts.mixed.module import MixedLinear

    return lambda k, n: MixedLinear(random_mixed_weight(k, n, outlier_fraction, device, gen))


def linear_shapes(d: Dims) -> list[tuple[str, int, int]]:
    """(name, in_features, out_features) of every kind of linear the decoder builds with the run's format (an
    expert's gate/up and down have the dense MLP's shapes)."""
    return [
        ("qkv", d.hidden, (d.heads + 2 * d.kv_heads) * d.head_dim),
        ("o", d.heads * d.head_dim, d.hidden),
        ("gate_up", d.hidden, 2 * d.intermediate),
        ("down", d.intermediate, d.hidden),
    ]


def vq_problem(preset: str, d: Dims, max_rows: int) -> str | None:
    """Why the preset's VQ layers cannot run every linear of the decoder through the VQ kernels (None: they can):
    vectors and codebook tiles must divide the linears' features, the decode GEMV must take the layer, and the
    fused GEMM too where a step has more rows than the GEMV takes (`max_rows`: the prompt or the largest batch).
    A layer the kernels refuse would run the torch reference, and the row would time that instead."""
    from qtool.layouts.vq import cuda as vq
    from qtool.layouts.vq import cuda_gemm as vq_gemm
    from qtool.stages.vq import PRESETS

    c = PRESETS[preset]
    dv, e, z, tr, tc = (c[f] for f in ("vector_size", "entries", "residuals", "tile_rows", "tile_cols"))
    for name, k, n in linear_shapes(d):
        where = f"the {name} projection ({k} -> {n})"
        if k % dv:
            return f"{where}: in_features {k}, expected a multiple of vector_size {dv}"
        if tc is not None and k > tc and k % tc:
            return f"{where}: in_features {k}, expected a multiple of tile_cols {tc}"
        if tr is not None and n > tr and n % tr:
            return f"{where}: out_features {n}, expected a multiple of tile_rows {tr}"
        reason = vq.unsupported_reason(dv, e.bit_length() - 1, tc, k)
        if reason is None and max_rows > vq.GEMV_MAX_M:
            reason = vq_gemm.unsupported_reason(dv, e, z, k, tr, tc)
        if reason is not None:
            return f"{where}: the VQ kernels cannot run {reason}"
    return None


def vq_linear(device: torch.device, preset: str, gen: torch.Generator):
    """Random re-indexed VQ linears of the preset (random_vq_weight), run as a loaded checkpoint's VQLinear runs:
    the GEMV up to 16 rows, the fused GEMM above (qtool/layouts/vq/module.py)."""
    from qtool.bench.cuda_cases import random_vq_weight
    from qtool.layouts.vq.module import VQLinear

    return lambda k, n: VQLinear(random_vq_weight(k, n, preset, device, gen))


def vq_note(preset: str) -> str:
    from qtool.stages.vq import PRESETS

    c = PRESETS[preset]
    scope = "tensor" if c["tile_rows"] is None else f"{c['tile_rows']}x{c['tile_cols']} tile"
    bits = c["residuals"] * (c["entries"].bit_length() - 1) / c["vector_size"]
    return (
        f"{preset}: VQ<{c['vector_size']},{c['entries'].bit_length() - 1},{c['residuals']}> per {scope} "
        f"({bits:g} index bits per weight), random re-indexed codes; the GEMV up to 16 rows, the fused GEMM above"
    )


class EagerStep:
    """`fn(*inputs)` run kernel by kernel from Python at each replay, for a step that synchronizes with the host
    (MoE routing) and so cannot be captured; the same interface as GraphedStep."""

    def __init__(self, fn, example_inputs, warmup: int = 2) -> None:
        self.fn = fn
        self.static_inputs = [t.clone() for t in example_inputs]
        for _ in range(warmup):
            fn(*self.static_inputs)
        torch.cuda.synchronize()

    def replay(self) -> Any:
        return self.fn(*self.static_inputs)


def make_step(model: Decoder, fn, example_inputs):
    """The step as a CUDA graph, or run eagerly where the model cannot be captured (`Decoder.graphable`)."""
    if model.graphable:
        from qtool.cuda.graphs import GraphedStep

        return GraphedStep(fn, example_inputs)
    return EagerStep(fn, example_inputs)


def execution(r: dict[str, Any]) -> str:
    """How a report's steps ran, for its title (reports from before MoE shapes were all captured)."""
    if r.get("cuda_graphs", True):
        return "CUDA graphs"
    return "eager (no CUDA graphs: MoE routing syncs with the host), every format alike"


def _time_graph(step, iters: int) -> float:
    """Median microseconds of one replay."""
    for _ in range(3):
        step.replay()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        starts[i].record()
        step.replay()
        ends[i].record()
    torch.cuda.synchronize()
    t = sorted(s.elapsed_time(e) * 1000 for s, e in zip(starts, ends, strict=True))
    return t[len(t) // 2]


def measure_model(
    model: Decoder, prompt: int, batches: list[int], context: int, iters: int
) -> dict[str, Any]:
    dev = model.embed.weight.device
    d = model.d
    out: dict[str, Any] = {}
    tables = model.rope_tables(max(prompt, context) + 1, dev)

    def caches(b: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        shape = (b, d.kv_heads, length, d.head_dim)
        return [
            (
                torch.zeros(shape, device=dev, dtype=torch.float16),
                torch.zeros(shape, device=dev, dtype=torch.float16),
            )
            for _ in range(d.layers)
        ]

    with torch.inference_mode():
        # Prefill: one prompt of `prompt` tokens.
        cache = caches(1, prompt)
        ids = torch.randint(0, d.vocab, (1, prompt), device=dev)
        pos = torch.arange(prompt, device=dev)
        fn = lambda ids, pos, cache=cache: model(ids, pos, cache, tables, decode=False)  # noqa: E731
        t0 = time.perf_counter()
        step = make_step(model, fn, [ids, pos])
        capture_s = time.perf_counter() - t0
        us = _time_graph(step, max(5, iters // 10))
        out["prefill"] = {
            "tokens": prompt,
            "us": us,
            "tokens_per_s": prompt / (us * 1e-6),
            "capture_s": capture_s,
        }
        del step, cache
        torch.cuda.empty_cache()
        out["decode"] = {}
        # each step sits at the middle of the static cache and attends to the positions up to its own
        span = context // 2 + 1
        for b in batches:
            cache = caches(b, context)
            ids = torch.randint(0, d.vocab, (b, 1), device=dev)
            pos = torch.tensor([context // 2], device=dev)
            fn = lambda ids, pos, cache=cache: model(ids, pos, cache, tables, decode=True, span=span)  # noqa: E731
            step = make_step(model, fn, [ids, pos])
            us = _time_graph(step, iters)
            kv_bytes = 2 * d.layers * b * d.kv_heads * span * d.head_dim * 2
            out["decode"][str(b)] = {
                "batch": b,
                "us_per_step": us,
                "tokens_per_s": b / (us * 1e-6),
                "kv_cache_bytes_read": kv_bytes,
            }
            del step, cache
            torch.cuda.empty_cache()
    return out


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights on the model's device: parameters, buffers and the kernels' prepared views of packed
    layers (a mixed-2-4-16 layer's tiled streams), each storage counted once (a layer whose checkpoint tensors moved
    to host memory counts only its view)."""
    dev = next(model.parameters()).device
    seen: set[int] = set()
    total = 0
    tensors = list(model.parameters()) + list(model.buffers())
    for m in model.modules():
        prep = getattr(m, "prepared", None)
        if prep is not None and hasattr(prep, "tensors"):
            tensors += prep.tensors()
    for t in tensors:
        if t.device == dev and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def torchao_skip_reason(bits: int, group_size: int | None, d: Dims, dev: torch.device) -> str | None:
    """Why the torchao int4 model cannot run beside this e2e run (None: it can)."""
    from qtool.bench import tinygemm as tg

    if bits != 4:
        return f"torchao int4 is a 4-bit format, found --bits {bits}"
    reason = tg.available(dev)
    for _, k, n in linear_shapes(d):
        reason = reason or tg.unsupported_reason(k, n, group_size)
    return reason


def vq_reason(presets: tuple[str, ...], d: Dims, max_rows: int, dev: torch.device) -> None:
    """Raises BenchError where a VQ run would time the torch reference instead of the VQ kernels: a preset that
    does not fit the linears, no CuPy, or (with a step over 16 rows) no Hopper GPU for the fused GEMM."""
    from qtool.cuda import compile as cc
    from qtool.layouts.vq import cuda as vq
    from qtool.layouts.vq import cuda_gemm as vq_gemm

    for preset in presets:
        problem = vq_problem(preset, d, max_rows)
        if problem is not None:
            raise BenchError(f"--vq: {preset} does not fit the model's linears: {problem}")
    reason = None if cc.cupy_available() else "CuPy is not available to build the VQ kernels"
    if reason is None and max_rows > vq.GEMV_MAX_M:
        reason = vq_gemm.device_reason(dev.index)
    if reason is not None:
        raise BenchError(f"--vq: {', '.join(presets)} cannot run on the VQ kernels here: {reason}")


def run_e2e(
    model_name: str,
    bits: int,
    group_size: int | None,
    prompt: int,
    batches: list[int],
    context: int,
    iters: int,
    log=lambda s: None,
    torchao: bool = True,
    mixed: tuple[float, ...] = (),
    qk_norm: bool = True,
    llama_block: bool = False,
    vq: tuple[str, ...] = (),
) -> dict[str, Any]:
    from qtool.bench.stats import E2E_SCHEMA

    d = dims_for(model_name, qk_norm, llama_block)
    dev = torch.device("cuda", torch.cuda.current_device())
    report: dict[str, Any] = {
        "schema": E2E_SCHEMA,
        "model": model_name,
        "dims": asdict(d),
        "cuda_graphs": not d.experts,
        "bits": bits,
        "group_size": group_size,
        "prompt_tokens": prompt,
        "decode_context": context,
        # every run keeps a float16 cache (the quantized caches are --throughput's)
        "attention": SDPA_ATTENTION,
        "decode_span": context // 2 + 1,
        "batches": batches,
        "device": torch.cuda.get_device_name(dev),
        "runs": {},
    }
    gen = torch.Generator(device=dev).manual_seed(0)
    labels = ["fp16", f"w{bits}a16"]
    if torchao:
        reason = torchao_skip_reason(bits, group_size, d, dev)
        if reason is None:
            labels.append(TORCHAO)
        else:
            report["torchao_skipped"] = reason
            log(f"{TORCHAO}: not run ({reason})")
    fractions = {mixed_label(f): f for f in mixed}
    labels += list(fractions)
    if vq:
        vq_reason(vq, d, max(prompt, *batches), dev)
        report["vq_presets"] = list(vq)
    labels += list(vq)
    for label in labels:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        make = (
            fp16_linear(dev)
            if label == "fp16"
            else torchao_linear(dev, group_size, gen)
            if label == TORCHAO
            else mixed_linear(dev, fractions[label], gen)
            if label in fractions
            else vq_linear(dev, label, gen)
            if label in vq
            else quant_linear(dev, bits, group_size, gen)
        )
        model = Decoder(d, make, dev).eval()
        res = measure_model(model, prompt, batches, context, iters)
        res["weight_bytes"] = weight_bytes(model)
        res["peak_memory_bytes"] = torch.cuda.max_memory_allocated(dev)
        report["runs"][label] = res
        log(
            f"{label}: prefill {res['prefill']['tokens_per_s']:.0f} tok/s; decode "
            + ", ".join(f"b{b} {v['tokens_per_s']:.0f} tok/s" for b, v in res["decode"].items())
            + f"; peak {res['peak_memory_bytes'] / 2**30:.1f} GiB"
        )
        del model
    f = report["runs"]["fp16"]
    report["speedups"] = {
        label: {
            "prefill": q["prefill"]["tokens_per_s"] / f["prefill"]["tokens_per_s"],
            **{
                f"decode_b{b}": q["decode"][str(b)]["tokens_per_s"] / f["decode"][str(b)]["tokens_per_s"]
                for b in batches
            },
        }
        for label, q in report["runs"].items()
        if label != "fp16"
    }
    report["speedup"] = report["speedups"][f"w{bits}a16"]
    return report


def _speedups(r: dict[str, Any]) -> dict[str, dict[str, float]]:
    # reports written before the torchao run existed have `speedup` (the quantized run's) only
    return r.get("speedups") or {f"w{r['bits']}a16": r["speedup"]}


def model_label(r: dict[str, Any]) -> str:
    """The report's model name, saying so when the run left out the model's q/k norms (--no-qk-norm) or ran
    its shape with Llama's block (--llama-block)."""
    known = MODEL_DIMS.get(str(r["model"]).strip().lower())
    d = r.get("dims", {})
    label = str(r["model"])
    if known is not None and known.qk_norm and not d.get("qk_norm", True):
        label += " without q/k norms"
    if known is not None and known.geglu and not d.get("geglu", True):
        label += " with Llama's block (SwiGLU, no branch norms)"
    return label


def _longest_sequence(r: dict[str, Any]) -> int:
    """The most positions a run's attention covers: the prompt, the decode steps' static cache, or prompt and
    generated tokens (--throughput)."""
    if "new_tokens" in r:
        return int(r["prompt_tokens"]) + int(r["new_tokens"])
    return max(int(r["prompt_tokens"]), int(r.get("decode_context", 0)))


def shape_notes(r: dict[str, Any]) -> list[str]:
    """What the report's decoder has beyond Llama's block, and what of the model it leaves out."""
    d = r.get("dims", {})
    notes = []
    if d.get("qk_norm"):
        notes.append("q/k norms: torch F.rms_norm per head before the rotary kernel (not fused)")
    if d.get("geglu"):
        notes.append(
            "GeGLU: torch F.gelu(gate, tanh) * up (no fused kernel; a W4A8 down projection quantizes its input "
            "itself)"
        )
    if d.get("post_norms"):
        notes.append(
            "post-attention and post-MLP norms: torch F.rms_norm on each branch's output before the residual "
            "add (not fused)"
        )
    ends = ["embeddings x sqrt(hidden)"] if d.get("embed_scale") else []
    if d.get("final_softcap"):
        ends.append(f"final logits soft-capped at {d['final_softcap']:g}")
    if ends:
        notes.append(", ".join(ends) + " (torch ops)")
    if d.get("attn_softcap"):
        notes.append(
            f"-- attention logit soft-capping ({d['attn_softcap']:g}) left out: the attention kernels "
            "(SDPA, the quantized caches' kernels) have none"
        )
    if d.get("sliding_window"):
        w, n = d["sliding_window"], _longest_sequence(r)
        notes.append(
            f"-- sliding-window layers ({w}) run as full attention: the same over these {n} positions"
            if n <= w
            else f"-- sliding-window layers ({w}) run as full attention over {n} positions: more than the "
            "model reads"
        )
    if d.get("experts"):
        notes.append(
            f"{d['experts']} experts, {d['top_k']} per token, {d['layers']} layers: each expert's linears run on "
            "the tokens routed to it (random float16 router, about even load); one host sync per MoE block"
        )
    return notes


def report_parts(r: dict[str, Any]) -> list[Any]:
    b = r["batches"]
    cols = ["run", "prefill tok/s", *[f"dec b{x} tok/s" for x in b], "weights GiB", "peak GiB"]
    rows = []
    for label, run in r["runs"].items():
        rows.append(
            [
                label,
                f"{run['prefill']['tokens_per_s']:.0f}",
                *[f"{run['decode'][str(x)]['tokens_per_s']:.1f}" for x in b],
                f"{run['weight_bytes'] / 2**30:.2f}",
                f"{run['peak_memory_bytes'] / 2**30:.2f}",
            ]
        )
    for label, sp in _speedups(r).items():
        rows.append(
            [f"{label} / fp16", f"{sp['prefill']:.2f}", *[f"{sp[f'decode_b{x}']:.2f}" for x in b], "", ""]
        )
    notes = []
    if TORCHAO in r["runs"]:
        notes.append(
            f"{TORCHAO}: torch._weight_int4pack_mm g{r['group_size']}, bfloat16 activations cast from and "
            "to float16 around each linear (the decoder's other kernels are float16)"
        )
    if r.get("torchao_skipped"):
        notes.append(f"{TORCHAO} not run: {r['torchao_skipped']}")
    notes += shape_notes(r)
    notes += [vq_note(p) for p in r.get("vq_presets", []) if p in r["runs"]]
    if any(label.startswith(MIXED) for label in r["runs"]):
        notes.append(
            f"{MIXED}: block4, g1 = g2 = 16, 25% 4-bit stripes, with the given fraction of fp16 outliers"
        )
    # reports from before the attention was recorded decoded through qtool's own FP16 kernel, since removed
    attention = r.get("attention", "not recorded")
    if "decode_span" in r:
        notes.insert(
            0,
            f"decode steps at position {r['decode_span'] - 1} of the static cache: attention over the "
            f"{r['decode_span']} positions up to it, no mask",
        )
    return [
        tables.table(
            f"e2e {model_label(r)} on {r['device']}: prompt {r['prompt_tokens']} tokens, decode context "
            f"{r['decode_context']} (static cache), {execution(r)}, random weights; attention in every row: "
            f"{attention}",
            cols,
            rows,
        ),
        *notes,
    ]


def format_e2e(r: dict[str, Any]) -> str:
    return tables.render(report_parts(r))


def figure(r: dict[str, Any]) -> plot.Figure:
    """Tokens/s of each run over FP16's (cuBLAS linears), for the prefill and each decode batch."""
    x = [f"prefill {r['prompt_tokens']}", *[f"decode b{b}" for b in r["batches"]]]
    keys = ["prefill", *[f"decode_b{b}" for b in r["batches"]]]
    series = {label: [sp.get(k) for k in keys] for label, sp in _speedups(r).items()}
    return plot.Figure(
        f"qtool bench e2e {model_label(r)} on {r['device']}",
        "tokens/s / FP16 tokens/s",
        f"FP16 (cuBLAS, {r['attention']})" if "attention" in r else "FP16 (cuBLAS)",
        [
            plot.Panel(
                f"W{r['bits']} g{r['group_size'] or 'ch'}, random weights",
                x,
                series,
                kind="bar",
                peers=(TORCHAO,),
            )
        ],
    )
