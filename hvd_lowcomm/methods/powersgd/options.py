"""PowerSGD's options, and the ranks a matrix starts at, may grow to, and is planned with."""

from __future__ import annotations

from dataclasses import dataclass
import math


from hvd_lowcomm.config import ConfigError, option
from hvd_lowcomm.methods.adaptive_rank import PLANNED_ADAPTIVE_RANK, validate_adaptive_rank


@dataclass
class PowerSGDOptions:
    """PowerSGD (Vogels et al. 2019): rank-r P Qᵀ approximations of gradients, error feedback."""

    # Adaptive by default (PyTorch's hook defaults to rank 1): no one rank suits every layer and model,
    # so each matrix's rank follows error_target (docs: powersgd, "Adaptive rank"; docs: transformers, "Measured").
    rank: int = option(
        0,
        "columns of P and Q per compressed matrix; 0: adaptive, each matrix's rank follows "
        "error_target between min_rank and max_rank",
    )
    # A tight target: no one rank suits every layer, and a loose one cost transformers quality
    # (docs: transformers, "At the adaptive defaults").
    error_target: float = option(
        0.15,
        "adaptive rank: the largest share of a compressed matrix's energy (its "
        "error-fed mean over ranks) that P Qᵀ may leave out",
    )
    # A floor, not 1: the energy rule alone let a transformer's matrices fall to ranks 1-3, and
    # what that dropped cost validation loss that no later rank won back (docs: decisions,
    # "PowerSGD: a rank floor"); a matrix too small to pay at this rank goes uncompressed.
    min_rank: int = option(
        16,
        "adaptive rank: the smallest rank, and where every matrix starts if start_iter is 0 "
        "(else at what the last plain mean needs); a matrix is compressed only if this rank "
        "pays (see min_compression_rate)",
    )
    max_rank: int = option(
        64, "adaptive rank: the largest rank (also capped where compression stops paying, see min_compression_rate)"
    )
    adapt_every: int = option(
        10,
        "steps between measurements of each matrix's missed energy (random probe "
        "columns ride with P on those steps; also measured at a fixed rank, for the "
        "metrics)",
    )
    # PyTorch: 1000 (its docs suggest a tenth of training); a fixed count fits runs of any length,
    # where a tenth of a short run lost to ten steps (docs: decisions, "PowerSGD: float32 factors").
    start_iter: int = option(10, "steps of plain allreduce before compression starts")
    min_compression_rate: float = option(2.0, "compress a matrix only if (n+m)*rank*rate < n*m")
    # float32, as PyTorch's hook: float16's rounding, which Adam rescales coordinate by coordinate,
    # cost a ViT on the held-out suite (docs: decisions, "PowerSGD: float32 factors").
    factor_dtype: str = option(
        "float32",
        "number format on the wire of P, Q, the uncompressed gradients and the "
        "start_iter steps' plain means: float32, or float16 (half the bytes; "
        "scaled by a power of two per matrix to stay in range, redone in float32 "
        "if a sum overflows)",
        choices=("float16", "float32"),
    )
    error_feedback: bool = option(True, "add back what compression dropped at earlier steps")
    warm_start: bool = option(True, "reuse the previous step's Q")
    shard_group_size: int = option(
        0,
        "shard the model over groups of this many contiguous ranks (FSDP2, torch "
        "engine: gradients reduce-scattered inside a group) and compress each "
        "rank's gradient shard across the groups; 0: no sharding",
    )

    @property
    def adaptive(self) -> bool:
        return self.rank == 0

    def validate(self) -> None:
        validate_adaptive_rank("powersgd", self.rank, self.error_target, self.min_rank, self.max_rank)
        if self.adapt_every < 1:
            raise ConfigError(f"powersgd.adapt_every must be >= 1, got {self.adapt_every}")
        if self.start_iter < 0:
            raise ConfigError(f"powersgd.start_iter must be >= 0, got {self.start_iter}")
        if self.min_compression_rate <= 0:
            raise ConfigError(f"powersgd.min_compression_rate must be > 0, got {self.min_compression_rate}")
        if self.shard_group_size < 0:
            raise ConfigError(f"powersgd.shard_group_size must be >= 0 (0: no sharding), got {self.shard_group_size}")


def compresses(n: int, m: int, options: PowerSGDOptions) -> tuple[bool, int]:
    """Whether an n × m gradient is compressed, and at which rank it starts: r' = min(n, m,
    rank), or min_rank when the rank is adaptive."""
    rank = min(n, m, options.min_rank if options.adaptive else options.rank)
    return (n + m) * rank * options.min_compression_rate < n * m, rank


def planned_rank(n: int, m: int, options: PowerSGDOptions) -> int:
    """The rank the cost model predicts an n × m matrix with: the fixed rank, or
    PLANNED_ADAPTIVE_RANK within the matrix's bounds."""
    if not options.adaptive:
        return compresses(n, m, options)[1]
    return max(min(options.min_rank, n, m), min(PLANNED_ADAPTIVE_RANK, highest_rank(n, m, options)))


def highest_rank(n: int, m: int, options: PowerSGDOptions) -> int:
    """The largest rank an n × m matrix may grow to: max_rank, and below where (n+m)·r·rate
    reaches n·m (the compression would stop paying); the fixed rank when it is not adaptive."""
    if not options.adaptive:
        return compresses(n, m, options)[1]
    paying = math.ceil(n * m / ((n + m) * options.min_compression_rate)) - 1
    return max(options.min_rank, min(options.max_rank, paying, n, m))
