"""Choosing a low-rank compressor's rank from an error target instead of fixing it.

A fixed rank is wrong for most layers of a model: an embedding, an MLP's four-times-wide projection and an
output head do not need the same rank, and what each needs changes during training. Both
low-rank gradient compressors here (PowerSGD, rank-dAD) instead keep, per matrix, the fewest
components whose approximation leaves out at most `error_target` of the matrix's energy
(squared Frobenius norm), the rule of Cuttlefish and L-GreCo (a bounded compression error per
layer) in its simplest form:

    k = min { k : 1 - (σ_1² + ... + σ_k²) / ‖G‖² <= error_target }

PowerSGD sees only the components inside its current subspace; it also estimates the energy
outside it with a few random probes (`probe_residual`), grows when more than its allowance is
missed and shrinks, with a margin, when fewer components would stay within it (`next_rank`).
"""

from __future__ import annotations

import torch

from hvd_lowcomm.config import ConfigError

# Random probe columns that estimate the energy a subspace misses. The estimate of a residual
# spread over many directions (a gradient's tail) has a relative spread of about sqrt(2 / (PROBES
# · its stable rank)): a few probes suffice, and they cost PROBES numbers per matrix row.
PROBES = 4
# What the plan and the cost model assume an adaptive rank settles at (they cannot know it
# before training): about the median rank PowerSGD and rank-dAD kept on the benchmarks'
# transformers (docs: powersgd and dad), within each matrix's bounds.
PLANNED_ADAPTIVE_RANK = 8
# A rank is shrunk only to where the error is at most this share of the target, so that the
# next measurement's noise does not grow it straight back.
SHRINK_MARGIN = 0.5


def smallest_rank_within(energies: torch.Tensor, total: float, error_target: float) -> int:
    """The fewest leading components (their `energies` σ_i², in descending order) whose sum
    leaves at most `error_target` of `total` out; len(energies) if even all of them do not."""
    if total <= 0 or len(energies) == 0:
        return min(1, len(energies))
    missed = 1 - torch.cumsum(energies, 0) / total
    within = torch.nonzero(missed <= error_target)
    return int(within[0]) + 1 if len(within) else len(energies)


def probes(columns: int, generator: torch.Generator, like: torch.Tensor) -> torch.Tensor:
    """`columns` × PROBES Gaussian probes S, scaled so that E ‖M S‖² = ‖M‖² for any M."""
    s = torch.randn(columns, PROBES, generator=generator, dtype=like.dtype) / PROBES**0.5
    return s.to(like.device)


def probe_residual(basis: torch.Tensor, probed: torch.Tensor) -> float:
    """Estimate of ‖(I - B Bᵀ) M‖² from `probed` = M S (S from `probes`) for an orthonormal
    basis B (Halko, Martinsson & Tropp 2011, §4.3: random probes estimate a range finder's
    error)."""
    residual = probed - basis @ (basis.T @ probed)
    return float(residual.pow(2).sum())


def next_rank(rank: int, energies: torch.Tensor, missed: float, allowed: float, lowest: int, highest: int) -> int:
    """The rank to use next for a matrix compressed at `rank`, whose components inside the
    subspace have `energies` (descending) and whose estimated energy outside it is `missed`,
    when `allowed` energy may be missed: double when more is missed; shrink to the fewest
    components that miss at most SHRINK_MARGIN of the allowance when that is fewer; else keep.
    Always within [lowest, highest]."""
    if missed > allowed:
        wanted = 2 * rank
    else:
        total = float(energies.sum()) + missed
        wanted = (
            min(rank, smallest_rank_within(energies, total, SHRINK_MARGIN * allowed / total)) if total > 0 else rank
        )
    return max(lowest, min(wanted, highest))


def validate_adaptive_rank(section: str, rank: int, error_target: float, min_rank: int, max_rank: int) -> None:
    """The rules every adaptive-rank compressor's options share (`section`: its name in errors)."""
    if rank < 0:
        raise ConfigError(f"{section}.rank must be >= 0 (0: adaptive), got {rank}")
    if not 0 < error_target < 1:
        raise ConfigError(f"{section}.error_target must be between 0 and 1, got {error_target}")
    if not 1 <= min_rank <= max_rank:
        raise ConfigError(f"{section} needs 1 <= min_rank <= max_rank, got {min_rank} and {max_rank}")
