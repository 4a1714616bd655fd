"""Low-rank factors of a gradient that is never formed: structured power iteration (rank-dAD).

A layer's local weight gradient is G = Aᵀ D (d_in × d_out, the transpose of ∇W), where A holds
the layer's input activations (rows × d_in) and D its output deltas (rows × d_out). Power
iteration on G Gᵀ = Aᵀ (D Dᵀ) A needs only products with A, Aᵀ, D and Dᵀ, each
O(rows · (d_in + d_out)), so neither G nor Gᵀ G is ever built.
"""
from __future__ import annotations

import torch


# Extra columns iterated beside the `rank` wanted: the subspace's top directions converge at
# (sigma_{width+1} / sigma_i)^2 per iteration instead of (sigma_{rank+1} / sigma_i)^2.
OVERSAMPLE = 4


def structured_power_iteration(acts: torch.Tensor, deltas: torch.Tensor, rank: int, iterations: int,
                               tol: float, generator: torch.Generator | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Top singular triplets of G = actsᵀ deltas by block (subspace) power iteration.

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
    # Below this fraction of sigma_1 a singular value is rounding noise in this dtype.
    zero = max(tol, 100 * torch.finfo(acts.dtype).eps)
    width = min(rank + OVERSAMPLE, d_in, d_out, rows)
    if width == 0:
        return acts.new_zeros(0, d_in), deltas.new_zeros(0, d_out)
    q, _ = torch.linalg.qr(torch.randn(d_in, width, generator=generator, dtype=acts.dtype).to(acts.device))
    for _ in range(iterations):
        new, _ = torch.linalg.qr(acts.T @ (deltas @ (deltas.T @ (acts @ q))))  # orth(G Gᵀ Q)
        moved = (new - q @ (q.T @ new)).norm() / width ** 0.5
        q = new
        if moved < tol:
            break
    u, s, vh = torch.linalg.svd(deltas.T @ (acts @ q), full_matrices=False)  # Gᵀ Q = U Σ Vᵀ
    keep = min(rank, int((s > zero * s[0]).sum())) if s[0] > 0 else 0
    b = (q @ vh.T)[:, :keep].T  # k × d_in, orthonormal rows
    return s[:keep, None] * b, u[:, :keep].T
