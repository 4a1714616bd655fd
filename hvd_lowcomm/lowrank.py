"""Low-rank factors of a gradient that is never formed: structured power iteration (rank-dAD).

A layer's local weight gradient is G = Aᵀ D (d_in × d_out, the transpose of ∇W), where A holds
the layer's input activations (rows × d_in) and D its output deltas (rows × d_out). Power
iteration on G Gᵀ = Aᵀ (D Dᵀ) A needs only products with A, Aᵀ, D and Dᵀ, each
O(rows · (d_in + d_out)), so neither G nor Gᵀ G is ever built.
"""
from __future__ import annotations

import torch


def structured_power_iteration(acts: torch.Tensor, deltas: torch.Tensor, rank: int, iterations: int,
                               tol: float, generator: torch.Generator | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Top singular triplets of G = actsᵀ deltas, one component at a time (Baker et al., rank-dAD).

    For component i: start from a random unit b, repeat up to `iterations` times
        b <- normalise(G Gᵀ b - sum_{j<i} sigma_j^2 b_j (b_jᵀ b))        (deflation)
    stopping early once b moves by less than `tol`; then sigma_i = |Gᵀ b|, c_i = Gᵀ b / sigma_i.
    Components stop when sigma_i <= max(tol, 100 eps) * sigma_1 (zero: the gradient's rank is
    exhausted). b is also re-orthogonalised against earlier b_j, which deflation does in exact
    arithmetic and rounding undoes.

    Returns (B̃ᵀ, C̃ᵀ): k × d_in rows sigma_i b_i and k × d_out rows c_i, k <= rank, such that
    G ≈ B̃ C̃ᵀ, i.e. ∇W ≈ C̃ B̃ᵀ = (C̃ᵀ)ᵀ (B̃ᵀ): the same form as exact dAD with k rows.
    """
    d_in, d_out = acts.shape[1], deltas.shape[1]
    # Below this fraction of sigma_1 a singular value is rounding noise in this dtype; iterating
    # on noise yields directions that are not orthogonal to the ones already found.
    zero = max(tol, 100 * torch.finfo(acts.dtype).eps)
    basis = acts.new_zeros(0, d_in)      # found b_j as rows
    sigmas = acts.new_zeros(0)
    found_c = deltas.new_zeros(0, d_out)
    for _ in range(rank):
        b = _orthogonalise(torch.randn(d_in, generator=generator, dtype=acts.dtype).to(acts.device), basis)
        b = b / b.norm()
        for _ in range(iterations):
            new = acts.T @ (deltas @ (deltas.T @ (acts @ b)))  # G Gᵀ b
            new = new - basis.T @ (sigmas**2 * (basis @ b))    # deflation
            new = _orthogonalise(new, basis)
            norm = new.norm()
            if norm == 0:  # G Gᵀ vanishes on the complement: the rank is exhausted
                return sigmas[:, None] * basis, found_c
            new = new / norm
            moved = (new - b).norm()
            b = new
            if moved < tol:
                break
        g_t_b = deltas.T @ (acts @ b)  # Gᵀ b
        sigma = g_t_b.norm()
        if sigma == 0 or (len(sigmas) and sigma <= zero * sigmas[0]):
            break
        basis = torch.cat([basis, b[None]])
        sigmas = torch.cat([sigmas, sigma[None]])
        found_c = torch.cat([found_c, (g_t_b / sigma)[None]])
    return sigmas[:, None] * basis, found_c


def _orthogonalise(v: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """Remove the components along orthonormal rows `basis`; two Gram-Schmidt passes, because
    one leaves rounding error that later normalisation magnifies."""
    for _ in range(2):
        v = v - basis.T @ (basis @ v)
    return v
