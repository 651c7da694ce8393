"""Hadamard construction: every order the constructions reach is checked exactly (H Hᵀ = n I), the orders they
miss are pinned, and the rotations built from them are orthogonal."""

from __future__ import annotations

import pytest
import torch

from qtool.quant.hadamard import hadamard, hadamard_plan, random_orthogonal, rotation

# Multiples of 4 up to 512 with no construction here (Paley over prime powers and Williamson's would reach them).
MISSING_TO_512 = [
    52,
    92,
    100,
    116,
    156,
    172,
    184,
    188,
    232,
    236,
    244,
    260,
    268,
    292,
    324,
    340,
    344,
    356,
    372,
    376,
    404,
    412,
    428,
    436,
    452,
    472,
    476,
    508,
]
# Hidden sizes of SmolLM2-135M/360M, Qwen2-0.5B and others built on Paley orders 12, 20, 28, 36 and 60.
MODEL_SIZES = [576, 640, 896, 960, 1152]


def _check_exact(n: int) -> None:
    h = hadamard(n)
    assert h.shape == (n, n) and h.dtype == torch.int64
    assert bool(((h == 1) | (h == -1)).all()), n
    # ±1 entries: every product and sum is an integer below 2^53, so float64 matmul is exact.
    hf = h.to(torch.float64)
    assert torch.equal(hf @ hf.T, n * torch.eye(n, dtype=torch.float64)), n


def test_every_constructible_order_to_512_is_hadamard():
    missing = []
    for n in [1, 2] + list(range(4, 513, 4)):
        if hadamard_plan(n) is None:
            missing.append(n)
            continue
        _check_exact(n)
    assert missing == MISSING_TO_512


@pytest.mark.parametrize("n", MODEL_SIZES)
def test_model_hidden_sizes_are_hadamard(n):
    _check_exact(n)


@pytest.mark.parametrize(
    "n,what",
    [
        (1536, "hadamard 12x128 (paley1 q=11)"),
        (2560, "hadamard 20x128 (paley1 q=19)"),
        (3584, "hadamard 28x128 (paley2 q=13)"),
        (5120, "hadamard 20x256 (paley1 q=19)"),
        (8192, "hadamard 8192 (sylvester)"),
        (64, "hadamard 64 (sylvester)"),
        (96, "hadamard 12x8 (paley1 q=11)"),
        (576, "hadamard 36x16 (paley2 q=17)"),
        (12, "hadamard 12 (paley1 q=11)"),
        (36, "hadamard 36 (paley2 q=17)"),
    ],
)
def test_plan_of_model_sizes(n, what):
    assert hadamard_plan(n).describe() == what


@pytest.mark.parametrize("n", [0, 3, 6, 10, 18, 52, 92])
def test_orders_without_construction(n):
    assert hadamard_plan(n) is None
    with pytest.raises(ValueError, match=f"order {n}"):
        hadamard(n)
    with pytest.raises(ValueError, match=f"order {n}"):
        rotation(n)


@pytest.mark.parametrize("signs", [False, True])
def test_rotation_is_orthogonal(signs):
    q, what = rotation(576, signs=signs, seed=3)
    assert torch.allclose(q @ q.T, torch.eye(576, dtype=torch.float64), atol=1e-12)
    assert ("random signs (seed 3)" in what) == signs
    if signs:
        plain, _ = rotation(576)
        d = (q / plain)[:, 0]
        assert bool(((d == 1) | (d == -1)).all()) and (d == -1).any() and (d == 1).any()


def test_random_fallback_is_seeded_and_orthogonal():
    q, what = rotation(92, fallback="random", seed=7)
    assert what.startswith("random orthogonal 92 (seed 7")
    assert torch.allclose(q @ q.T, torch.eye(92, dtype=torch.float64), atol=1e-12)
    assert torch.equal(q, random_orthogonal(92, 7))
    assert not torch.allclose(q, random_orthogonal(92, 8))
