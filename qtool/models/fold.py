"""Function-preserving weight edits that transforms share: untying the head from the embedding, folding a norm's
scale into the linears it feeds, and multiplying a linear's input or output side by a matrix.

Every product runs in float64 and is cast back to the parameter's dtype, so a chain of edits adds one rounding
per parameter. Row-vector convention: nn.Linear computes y = x Wᵀ + b with W [out, in].
"""

from __future__ import annotations

import torch
from torch import nn


def _set(param: torch.Tensor, value: torch.Tensor) -> None:
    param.data.copy_(value.to(param.dtype))


def _rows_times(param: torch.Tensor, q: torch.Tensor, chunk: int = 8192) -> None:
    """param ← param @ q in place, a slab of rows at a time: a float64 copy of a whole embedding of a large
    vocabulary would take several times its memory."""
    for s in range(0, param.shape[0], chunk):
        rows = param.data[s : s + chunk]
        rows.copy_((rows.double() @ q).to(param.dtype))


def untie_head(model: nn.Module, embed_path: str, head_path: str) -> bool:
    """Give the head its own copy of the embedding matrix when they share one, and clear the config's tie flag
    (and its text sub-config's) so a saved checkpoint reloads untied. Returns whether they were tied."""
    embed = model.get_submodule(embed_path)
    head = model.get_submodule(head_path)
    tied = head.weight is embed.weight or head.weight.data_ptr() == embed.weight.data_ptr()
    if tied:
        head.weight = nn.Parameter(embed.weight.detach().clone(), requires_grad=embed.weight.requires_grad)
    configs = [model.config]
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else None
    if text is not None and text is not model.config:
        configs.append(text)
    for cfg in configs:
        if getattr(cfg, "tie_word_embeddings", False):
            cfg.tie_word_embeddings = False
    # transformers keeps its own copy of the tie mapping, computed from the config at construction.
    if hasattr(model, "all_tied_weights_keys") and hasattr(model, "get_expanded_tied_weights_keys"):
        model.all_tied_weights_keys = model.get_expanded_tied_weights_keys(all_submodels=True)
    return tied


@torch.no_grad()
def fold_norm_scale(norm: nn.Module, linears: list[nn.Linear]) -> None:
    """W ← W diag(γ) for each linear the norm feeds, then γ ← 1 (and a LayerNorm's shift β into their biases:
    b ← b + W β, β ← 0)."""
    gamma = norm.weight.detach().double()
    beta = getattr(norm, "bias", None)
    for lin in linears:
        w = lin.weight.detach().double()
        if beta is not None:
            shift = w @ beta.detach().double()
            if lin.bias is None:
                lin.bias = nn.Parameter(shift.to(lin.weight.dtype))
            else:
                _set(lin.bias, lin.bias.detach().double() + shift)
        _set(lin.weight, w * gamma[None, :])
    norm.weight.data.fill_(1.0)
    if beta is not None:
        beta.data.zero_()


@torch.no_grad()
def rotate_input(linear: nn.Linear, q: torch.Tensor) -> None:
    """The linear reads x Q instead of x: W ← W Q (since (x Q)(W Q)ᵀ = x Wᵀ for orthogonal Q)."""
    _rows_times(linear.weight, q)


@torch.no_grad()
def rotate_output(linear: nn.Linear, q: torch.Tensor) -> None:
    """The linear writes y Q instead of y: W ← Qᵀ W, b ← b Q."""
    _set(linear.weight, q.T @ linear.weight.detach().double())
    if linear.bias is not None:
        _set(linear.bias, linear.bias.detach().double() @ q)


@torch.no_grad()
def rotate_embedding(embed: nn.Embedding, q: torch.Tensor) -> None:
    """Each embedding row e becomes e Q."""
    _rows_times(embed.weight, q)
