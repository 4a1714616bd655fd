"""Low-rank factors of a layer's local gradient (rank-dAD), computed the cheapest way its shapes allow.

A layer's local weight gradient is G = Aᵀ D (d_in × d_out, the transpose of ∇W), where A holds
the layer's input activations (rows × d_in) and D its output deltas (rows × d_out). rank-dAD
shares G's top singular triplets. Three ways give them (`cheapest_way` picks by flop count):

- "exact": few rows (a Linear layer at a moderate batch). Thin QRs Aᵀ = Q_a R_a, Dᵀ = Q_d R_d
  give G = Q_a (R_a R_dᵀ) Q_dᵀ, whose core is only rows × rows: its SVD yields the exact
  triplets in O((d_in + d_out) rows²), with no iteration.
- "gradient": G is smaller than the rows (a convolution, whose rows are every sample's output
  positions: N·H·W of them against C_in·k² × C_out numbers in G). Autograd has formed G
  already (the weight's gradient); block power iteration on it costs O(d_in d_out w) per
  iteration, however many rows there are.
- "structured": many rows and a large G. Power iteration on G Gᵀ = Aᵀ (D Dᵀ) A needs only
  products with A, Aᵀ, D and Dᵀ, each O(rows · (d_in + d_out)), so G is never formed (the
  paper's structured power iteration).
"""

from __future__ import annotations

from typing import Callable

import torch

from hvd_lowcomm.methods.adaptive_rank import probes

# Extra columns iterated beside the `rank` wanted: the subspace's top directions converge at
# (sigma_{width+1} / sigma_i)^2 per iteration instead of (sigma_{rank+1} / sigma_i)^2.
OVERSAMPLE = 4
WAYS = ("exact", "gradient", "structured")

Factors = tuple[torch.Tensor, torch.Tensor]


def cheapest_way(rows: int, d_in: int, d_out: int, rank: int, iterations: int) -> str:
    """Which of WAYS computes the top `rank` triplets of G = Aᵀ D with the fewest flops."""
    width = min(rank + OVERSAMPLE, d_in, d_out)
    core_in, core_out = min(rows, d_in), min(rows, d_out)
    flops = {
        "exact": 2 * rows * (d_in * core_in + d_out * core_out) + 10 * core_in * core_out * min(core_in, core_out),
        "gradient": iterations * 4 * d_in * d_out * width,
        "structured": iterations * 4 * rows * (d_in + d_out) * width,
    }
    return min(WAYS, key=flops.__getitem__)


def factors_from_rows(
    acts: torch.Tensor,
    deltas: torch.Tensor,
    rank: int,
    iterations: int,
    tol: float,
    generator: torch.Generator | None = None,
) -> Factors:
    """Top triplets of G = actsᵀ deltas from the rows: exactly, or by structured power
    iteration when that is cheaper (see the module docstring). Returns what
    structured_power_iteration does."""
    if cheapest_way(*acts.shape, deltas.shape[1], rank, iterations) == "exact":
        return exact_factors(acts, deltas, rank, tol)
    return structured_power_iteration(acts, deltas, rank, iterations, tol, generator)


def exact_factors(acts: torch.Tensor, deltas: torch.Tensor, rank: int, tol: float) -> Factors:
    """Top triplets of G = actsᵀ deltas, exactly, from thin QRs of the rows."""
    q_in, r_in = torch.linalg.qr(acts.T)  # d_in × m, m × rows
    q_out, r_out = torch.linalg.qr(deltas.T)  # d_out × m', m' × rows
    u, s, vh = torch.linalg.svd(r_in @ r_out.T, full_matrices=False)  # G = (Q_in U) Σ (Q_out V)ᵀ
    return _leading(s, (q_in @ u).T, vh @ q_out.T, rank, tol)


def structured_power_iteration(
    acts: torch.Tensor,
    deltas: torch.Tensor,
    rank: int,
    iterations: int,
    tol: float,
    generator: torch.Generator | None = None,
) -> Factors:
    """Top singular triplets of G = actsᵀ deltas by block power iteration over the rows.

    All components at once: Q (d_in × w, w = rank + OVERSAMPLE, at most G's possible rank)
    starts orthonormal and random; repeat up to `iterations` times
        Q <- orth(G Gᵀ Q) = orth(Aᵀ (D (Dᵀ (A Q))))
    stopping early once the subspace moves by less than `tol` (|(I - Q Qᵀ) Q_new|). Then
    Rayleigh-Ritz: the SVD of the small Gᵀ Q = Dᵀ (A Q) = U Σ Vᵀ gives G ≈ (Q V) Σ Uᵀ. Every
    product is a matrix-matrix product over the rows (BLAS 3), where one component at a time
    with deflation (the paper's formulation) is `rank` × `iterations` matrix-vector passes.
    Components with sigma_i <= max(tol, 100 eps) * sigma_1 are dropped (the gradient's rank is
    exhausted), so k <= rank components come back.

    Returns (B̃ᵀ, C̃ᵀ): k × d_in rows sigma_i b_i and k × d_out rows c_i, such that
    G ≈ B̃ C̃ᵀ, i.e. ∇W ≈ C̃ B̃ᵀ = (C̃ᵀ)ᵀ (B̃ᵀ): the same form as exact dAD with k rows.
    """
    rows, d_in = acts.shape
    d_out = deltas.shape[1]
    return _block_power_iteration(
        lambda q: acts.T @ (deltas @ (deltas.T @ (acts @ q))),
        lambda q: deltas.T @ (acts @ q),
        (d_in, d_out),
        min(d_in, d_out, rows),
        rank,
        iterations,
        tol,
        generator,
        acts,
    )


def gradient_power_iteration(
    gradient: torch.Tensor, rank: int, iterations: int, tol: float, generator: torch.Generator | None = None
) -> Factors:
    """The same triplets as structured_power_iteration, iterating on G (d_in × d_out) itself."""
    return _block_power_iteration(
        lambda q: gradient @ (gradient.T @ q),
        lambda q: gradient.T @ q,
        tuple(gradient.shape),
        min(gradient.shape),
        rank,
        iterations,
        tol,
        generator,
        gradient,
    )


def missed_energy(
    acts: torch.Tensor, deltas: torch.Tensor, factors: Factors, generator: torch.Generator | None = None
) -> float:
    """Estimate of ‖G - B̃ C̃ᵀ‖², the energy of G = actsᵀ deltas that `factors` (B̃ᵀ, C̃ᵀ) miss,
    with random probes and without forming G: E ‖(G - B̃ C̃ᵀ) S‖² = ‖G - B̃ C̃ᵀ‖²
    (hvd_lowcomm.methods.adaptive_rank); exactly 0 when the factors hold all of G."""
    b_rows, c_rows = factors
    s = probes(deltas.shape[1], generator, deltas)
    return float((acts.T @ (deltas @ s) - b_rows.T @ (c_rows @ s)).pow(2).sum())


def _block_power_iteration(
    gram_times: Callable[[torch.Tensor], torch.Tensor],
    transpose_times: Callable[[torch.Tensor], torch.Tensor],
    shape: tuple[int, int],
    most: int,
    rank: int,
    iterations: int,
    tol: float,
    generator: torch.Generator | None,
    like: torch.Tensor,
) -> Factors:
    """Subspace iteration with G Gᵀ (`gram_times`) and Rayleigh-Ritz with Gᵀ (`transpose_times`)
    for G of `shape` (d_in × d_out) whose rank is at most `most`."""
    d_in, d_out = shape
    width = min(rank + OVERSAMPLE, most)
    if width == 0:
        return like.new_zeros(0, d_in), like.new_zeros(0, d_out)
    q, _ = torch.linalg.qr(torch.randn(d_in, width, generator=generator, dtype=like.dtype).to(like.device))
    for _ in range(iterations):
        new, _ = torch.linalg.qr(gram_times(q))  # orth(G Gᵀ Q)
        moved = (new - q @ (q.T @ new)).norm() / width**0.5
        q = new
        if moved < tol:
            break
    u, s, vh = torch.linalg.svd(transpose_times(q), full_matrices=False)  # Gᵀ Q = U Σ Vᵀ
    return _leading(s, vh @ q.T, u.T, rank, tol)


def _leading(s: torch.Tensor, inputs: torch.Tensor, outputs: torch.Tensor, rank: int, tol: float) -> Factors:
    """The first k <= rank triplets (rows of unit `inputs` and `outputs`, singular values `s`)
    whose sigma_i exceeds max(tol, 100 eps) * sigma_1, as (sigma_i b_i rows, c_i rows)."""
    zero = max(tol, 100 * torch.finfo(s.dtype).eps)  # below this share of sigma_1: rounding noise
    keep = min(rank, int((s > zero * s[0]).sum())) if len(s) and s[0] > 0 else 0
    return s[:keep, None] * inputs[:keep], outputs[:keep]
