"""Hadamard matrices (±1 entries, H Hᵀ = n I) of the orders that known constructions reach, and the orthogonal
rotations built from them.

An order n is built as H_m ⊗ H_(2^k) with n = m·2^k: the Sylvester matrix for the power of two and, for m > 1,
a Paley matrix over a prime q (Paley I: q ≡ 3 mod 4, order q+1; Paley II: q ≡ 1 mod 4, order 2(q+1)). That
covers every hidden size of the Llama, Mistral and Qwen2 families (576 = 36·16, Paley II with q = 17). Orders it
misses (92, 116, ... need Williamson-type or prime-power constructions) get no matrix; the caller decides whether
a random orthogonal matrix may stand in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class HadamardPlan:
    """How order n = m · 2^k is built: m = 1 (Sylvester alone) or a Paley matrix of order m over prime q."""

    n: int
    m: int
    paley: int  # 0 (none), 1 or 2
    q: int

    def describe(self) -> str:
        if self.m == 1:
            return f"hadamard {self.n} (sylvester)"
        base = f"paley{self.paley} q={self.q}"
        if self.m == self.n:
            return f"hadamard {self.n} ({base})"
        return f"hadamard {self.m}x{self.n // self.m} ({base})"


def _is_prime(q: int) -> bool:
    if q < 2:
        return False
    return all(q % d for d in range(2, math.isqrt(q) + 1))


def _paley_base(m: int) -> tuple[int, int] | None:
    """(construction, q) of a Paley matrix of order m, preferring Paley I; None when neither applies."""
    if m % 4 == 0 and _is_prime(m - 1) and (m - 1) % 4 == 3:
        return 1, m - 1
    if m % 4 == 0 and _is_prime(m // 2 - 1) and (m // 2 - 1) % 4 == 1:
        return 2, m // 2 - 1
    return None


def hadamard_plan(n: int) -> HadamardPlan | None:
    """The construction of order n with the largest power-of-two factor, or None when none is known here."""
    if n < 1:
        return None
    m = n
    twos = []
    while True:
        twos.append(m)
        if m % 2:
            break
        m //= 2
    for m in reversed(twos):  # smallest odd-free part first
        if m == 1:
            return HadamardPlan(n, 1, 0, 0)
        base = _paley_base(m)
        if base is not None:
            return HadamardPlan(n, m, *base)
    return None


def _jacobsthal(q: int) -> torch.Tensor:
    """Q[i, j] = χ(j − i) over GF(q), χ the quadratic character (0 at 0)."""
    chi = torch.full((q,), -1, dtype=torch.int64)
    chi[0] = 0
    chi[torch.tensor(sorted({(x * x) % q for x in range(1, q)}), dtype=torch.int64)] = 1
    idx = torch.arange(q)
    return chi[(idx[None, :] - idx[:, None]) % q]


def _paley(kind: int, q: int) -> torch.Tensor:
    jac = _jacobsthal(q)
    ones = torch.ones(q, dtype=torch.int64)
    if kind == 1:
        # Skew conference matrix S (q ≡ 3 mod 4 makes the Jacobsthal matrix antisymmetric); H = I + S.
        s = torch.zeros(q + 1, q + 1, dtype=torch.int64)
        s[0, 1:] = ones
        s[1:, 0] = -ones
        s[1:, 1:] = jac
        return s + torch.eye(q + 1, dtype=torch.int64)
    # Symmetric conference matrix C (q ≡ 1 mod 4); each entry becomes a 2x2 block: 0 → [[1,-1],[-1,-1]],
    # ±1 → ±[[1,1],[1,-1]].
    c = torch.zeros(q + 1, q + 1, dtype=torch.int64)
    c[0, 1:] = ones
    c[1:, 0] = ones
    c[1:, 1:] = jac
    one = torch.tensor([[1, 1], [1, -1]], dtype=torch.int64)
    zero = torch.tensor([[1, -1], [-1, -1]], dtype=torch.int64)
    return _kron(c, one) + _kron((c == 0).to(torch.int64), zero)


def _kron(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # torch.kron on integer tensors is an order of magnitude slower than this broadcast.
    return (a[:, None, :, None] * b[None, :, None, :]).reshape(
        a.shape[0] * b.shape[0], a.shape[1] * b.shape[1]
    )


def _sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.int64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def hadamard(n: int) -> torch.Tensor:
    """The ±1 Hadamard matrix of order n (int64); ValueError when no construction here reaches n."""
    plan = hadamard_plan(n)
    if plan is None:
        raise ValueError(f"no Hadamard matrix of order {n} is known to this module")
    two = _sylvester(n // plan.m)
    if plan.m == 1:
        return two
    return _kron(_paley(plan.paley, plan.q), two)


def random_orthogonal(n: int, seed: int) -> torch.Tensor:
    """A Haar-distributed orthogonal matrix (float64): QR of a seeded Gaussian, signs fixed by R's diagonal."""
    g = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r))[None, :]


def random_signs(n: int, seed: int) -> torch.Tensor:
    """A seeded vector of ±1 (float64)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, (n,), generator=g).to(torch.float64) * 2 - 1


def rotation(
    n: int, *, fallback: str = "error", seed: int = 0, signs: bool = False
) -> tuple[torch.Tensor, str]:
    """An orthogonal [n, n] float64 matrix for block-input rotation and a description of what it is: H/√n, with
    its rows multiplied by seeded ±1 when `signs` (QuaRot's randomized Hadamard), or with `fallback="random"` a
    seeded random orthogonal matrix where no Hadamard of order n is known."""
    plan = hadamard_plan(n)
    if plan is None:
        if fallback != "random":
            raise ValueError(f"no Hadamard matrix of order {n} is known to this module")
        return random_orthogonal(n, seed), f"random orthogonal {n} (seed {seed}, no Hadamard of order {n})"
    q = hadamard(n).to(torch.float64) / math.sqrt(n)
    what = plan.describe()
    if signs:
        q = random_signs(n, seed)[:, None] * q
        what += f", random signs (seed {seed})"
    return q, what
