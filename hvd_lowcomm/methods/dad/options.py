"""dAD's and rank-dAD's options, and the rank the plan and the cost model assume."""

from __future__ import annotations

from dataclasses import dataclass

from hvd_lowcomm.config import ConfigError, option
from hvd_lowcomm.methods.adaptive_rank import PLANNED_ADAPTIVE_RANK, validate_adaptive_rank


@dataclass
class DadOptions:
    """Exact dAD: share activations and deltas instead of gradients."""

    plan: str = option(
        "auto",
        "share rows where cheaper than allreduce (auto) or for every supported layer (all)",
        choices=("auto", "all"),
    )


@dataclass
class RankDadOptions(DadOptions):
    """rank-dAD: share the top singular triplets of each layer's local gradient as factor rows."""

    # Adaptive by default: no one rank suits every layer and model; what holds quality is feeding
    # back what the factors miss (docs: dad, "Error feedback"; docs: transformers, "Measured").
    rank: int = option(
        0,
        "components per layer; 0: adaptive, each layer keeps the fewest that leave out at "
        "most error_target of its local gradient's energy, at most max_rank",
    )
    # A tight target, paid for by the float16 rows' halved bytes (docs: dad, "Float16 rows").
    error_target: float = option(
        0.05, "adaptive rank: the largest share of a layer's local gradient energy its factors may leave out"
    )
    # A floor, as PowerSGD's: the energy rule alone kept one or two components of a transformer's
    # layers, and what they dropped cost loss no later step won back (docs: dad, "How many").
    min_rank: int = option(16, "adaptive rank: the fewest components per layer (where the layer has them)")
    max_rank: int = option(32, "adaptive rank: the most components per layer")
    # Off by default: on the text sets it was tried on it raised the bytes and left the loss as
    # it was (docs: decisions, "rank-dAD").
    exact_fallback: bool = option(
        False,
        "adaptive rank: a layer whose max_rank components keep leaving out more than error_target of its "
        "gradient's energy allreduces its exact gradient from then on",
    )
    # Adam's first steps divide each coordinate's size out, so a truncated gradient there sets
    # the run apart for good; 10 is 1 / (1 - beta1) (docs: dad, "Why the first steps are exact").
    start_iter: int = option(10, "steps of exact gradient allreduce before the factor rows start")
    error_feedback: bool = option(
        True,
        "add what a rank's factors left out of its gradient to its next one "
        "(factors then come from the gradient autograd forms)",
    )
    # The factor rows are fed back (the rounding joins each rank's error), so 16 bits per number
    # lose nothing error feedback does not add back, and halve the bytes.
    factor_dtype: str = option(
        "float16",
        "number format of the factor rows on the wire: float16 (half the bytes; "
        "each row scaled by its own power of two) or float32",
        choices=("float16", "float32"),
    )
    iterations: int = option(
        10, "most power iterations where the triplets are iterated for (few rows give them exactly, without iterating)"
    )
    tol: float = option(
        1e-3, "stop iterating when the subspace moves less than this; drop components with sigma <= tol * sigma_1"
    )

    def validate(self) -> None:
        validate_adaptive_rank("rank-dad", self.rank, self.error_target, self.min_rank, self.max_rank)
        if self.start_iter < 0:
            raise ConfigError(f"rank-dad.start_iter must be >= 0, got {self.start_iter}")
        if self.iterations < 1:
            raise ConfigError(f"rank-dad.iterations must be >= 1, got {self.iterations}")
        if self.tol <= 0:
            raise ConfigError(f"rank-dad.tol must be > 0, got {self.tol}")


DAD_MODES = ("exact", "rank", "edad")


def planned_rank(options: "RankDadOptions") -> int:
    """The k per rank the plan and the cost model assume: the fixed rank, or
    PLANNED_ADAPTIVE_RANK (at least min_rank, at most max_rank) when adaptive."""
    return options.rank or min(options.max_rank, max(options.min_rank, PLANNED_ADAPTIVE_RANK))
