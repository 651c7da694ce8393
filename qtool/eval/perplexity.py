"""Perplexity of a causal LM on a text, with the protocol recorded next to the number.

Protocol: the text is tokenized once (or, with a separator, document by document with the tokenizer's special
tokens, e.g. BOS per story); windows of `seq_len` tokens start every `stride` tokens; every window but the first
scores only the tokens the previous window did not score; ppl = exp(mean token NLL).

On a CUDA device each window shape's forward is captured once as a CUDA graph and replayed (the quantized linears'
kernels are many small launches); `QTOOL_CUDA_GRAPHS=0` turns that off, and a model whose forward cannot be
captured runs eagerly (the result says which, and why).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from qtool.calibration.data import TextSource, check_token_ids, read_documents
from qtool.console import Reporter
from qtool.cuda.compile import env_int
from qtool.errors import InputError
from qtool.recipe import EvalSpec

# EvalSpec's zero-shot settings, which are not part of the perplexity protocol.
TASK_FIELDS = ("tasks", "limit", "num_fewshot", "task_batch_size", "data_dir")
# Permissions, not part of the protocol either (the protocol records seq_len itself).
PERMISSION_FIELDS = ("allow_long_context",)


def tokenize_eval_text(tokenizer, spec: EvalSpec) -> torch.Tensor:
    docs = read_documents(TextSource(spec.text, spec.text_field, spec.split, spec.config, spec.encoding))
    if spec.separator is None:
        return tokenizer("\n\n".join(docs), return_tensors="pt").input_ids[0]
    pieces = [p.strip() for d in docs for p in d.split(spec.separator)]
    ids = tokenizer([p for p in pieces if p], add_special_tokens=True).input_ids
    return torch.tensor([t for row in ids for t in row], dtype=torch.int64)


def windows(num_tokens: int, seq_len: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, number of scored tokens at the end of the window) for each window."""
    out = []
    prev_end = 0
    for begin in range(0, num_tokens - 1, stride):
        end = min(begin + seq_len, num_tokens)
        scored = end - prev_end if begin else end - begin - 1
        if end - begin < 2 or scored <= 0:
            break
        # Non-overlapping windows only keep full windows, as GPTQ-style protocols do.
        if stride >= seq_len and end - begin < seq_len:
            break
        out.append((begin, end, min(scored, end - begin - 1)))
        prev_end = end
        if end == num_tokens:
            break
    return out


MAX_GRAPHS = 2  # window shapes captured per evaluation (the full batch and the last, shorter one)


class WindowForward:
    """`logits = fwd(x)`: eager, or one CUDA graph per input shape (falling back to eager for good on failure)."""

    def __init__(self, model, device: torch.device | str) -> None:
        self.model = model
        dev = torch.device(device)
        self.use_graphs = dev.type == "cuda" and env_int("QTOOL_CUDA_GRAPHS", 1) != 0
        self.graphs: dict[tuple[int, ...], Callable[[torch.Tensor], torch.Tensor]] = {}
        self.error: str | None = None
        self.replays = 0

    def _eager(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x, use_cache=False).logits

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.use_graphs or self.error is not None:
            return self._eager(x)
        key = tuple(x.shape)
        step = self.graphs.get(key)
        if step is None:
            if len(self.graphs) >= MAX_GRAPHS:
                return self._eager(x)
            from qtool.cuda.graphs import GraphedStep

            try:
                step = GraphedStep(self._eager, [x])
            except Exception as exc:  # an uncapturable forward still evaluates, eagerly
                self.error = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
                torch.cuda.synchronize()
                return self._eager(x)
            self.graphs[key] = step
        self.replays += 1
        return step(x)

    def summary(self) -> dict:
        return {
            "cuda_graphs": bool(self.graphs) and self.error is None,
            "graph_replays": self.replays,
            "graph_error": self.error,
        }


def window_groups(ids: torch.Tensor, spec: EvalSpec) -> tuple[list[tuple[int, int, int]], list[list]]:
    """(the windows, the groups of windows run in one forward each, in order): batches of `spec.batch_size`
    windows, a batch of unequal lengths run window by window."""
    spans = windows(ids.numel(), spec.seq_len, spec.stride or spec.seq_len)
    if spec.max_windows is not None:
        spans = spans[: spec.max_windows]
    if not spans:
        raise InputError(
            f"eval text '{spec.text}': {ids.numel()} tokens, too few for one window of {spec.seq_len}"
        )
    groups = []
    for i in range(0, len(spans), spec.batch_size):
        batch = spans[i : i + spec.batch_size]
        groups.append([batch] if len({e - b for b, e, _ in batch}) == 1 else [[s] for s in batch])
    return spans, groups


def eval_tokens(model_config, tokenizer, spec: EvalSpec) -> torch.Tensor:
    ids = tokenize_eval_text(tokenizer, spec)
    vocab = getattr(model_config, "vocab_size", None)
    if isinstance(vocab, int):
        check_token_ids(ids, vocab, spec.text, tokenizer)
    return ids


@torch.no_grad()
def perplexity(
    model,
    tokenizer,
    spec: EvalSpec,
    device: torch.device | str,
    reporter: Reporter | None = None,
    ids: torch.Tensor | None = None,
    graphs: bool = True,
) -> dict:
    """`ids`: the text's tokens when the caller has them (`eval_tokens`). `graphs`: CUDA graphs allowed (not
    for a forward that returns something else at each call)."""
    t0 = time.perf_counter()
    if ids is None:
        ids = eval_tokens(getattr(model, "config", None), tokenizer, spec)
    stride = spec.stride or spec.seq_len
    spans, batches = window_groups(ids, spec)
    total_nll = 0.0
    total_tokens = 0
    items = reporter.track(batches, len(batches), "perplexity") if reporter else batches
    forward = WindowForward(model, device)
    forward.use_graphs &= graphs
    for groups in items:
        for group in groups:
            x = torch.stack([ids[b:e] for b, e, _ in group]).to(device)
            logits = forward(x).float()
            for row, (_, _, scored) in enumerate(group):
                lg = logits[row, -scored - 1 : -1]
                tgt = x[row, -scored:]
                total_nll += float(F.cross_entropy(lg, tgt, reduction="sum"))
                total_tokens += scored
    nll = total_nll / total_tokens
    protocol = dataclasses.asdict(spec)
    for key in ("batch_size", *TASK_FIELDS, *PERMISSION_FIELDS):
        protocol.pop(key)
    protocol["stride"] = stride
    protocol["tokenizer"] = getattr(tokenizer, "name_or_path", type(tokenizer).__name__)
    protocol["tokens_sha256"] = hashlib.sha256(ids.to(torch.int32).numpy().tobytes()).hexdigest()[:16]
    out = {
        "perplexity": math.exp(nll),
        "nll": nll,
        "scored_tokens": total_tokens,
        "windows": len(spans),
        "protocol": protocol,
        "seconds": round(time.perf_counter() - t0, 3),
    }
    if forward.use_graphs:
        out.update(forward.summary())
    return out
