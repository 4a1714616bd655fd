"""DiLoCo's options, and the pure rules of its fragments, shards and sync schedule."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from hvd_lowcomm.config import ConfigError, option, subsection
from hvd_lowcomm.methods.grouped import GroupedOptions
from hvd_lowcomm.methods.diloco.exchange import COMPRESSIONS


@dataclass
class SparseOptions:
    """diloco.sparse: top-k of each chunk of the pseudo-gradient at 2 bits, with error feedback."""

    # Denser than SparseLoCo's: its densities lost quality over the tens of outer steps of runs here (the
    # papers ran far more), and Elias-Fano positions pay for the difference (docs: benchmarks, "DiLoCo's
    # exchange between groups").
    density: float = option(
        0.12,
        "the share of each chunk's numbers sent (SparseLoCo used 0.01-0.03 on large models with many outer steps)",
    )
    # Three times density: the mean of G groups' sparse parts holds up to G times their numbers, and what
    # the owner's second selection leaves out is what cost most beyond two groups; other splits of the same
    # bytes did no better (docs: benchmarks, "DiLoCo's exchange between groups").
    owner_density: float = option(
        0.0,
        "beyond 2 groups: the share of each chunk of the groups' mean that its "
        "owner sends back (the mean of G sparse parts is up to G times denser "
        "than one); 0: three times density",
    )
    # A pseudo-gradient's signal is not sparse in coordinates, so much of a group's progress waits unsent;
    # kept on its own model, the group trains on from it and only the other groups see it late. Sparse only:
    # low-rank leaves mostly noise unsent (docs: diloco, on keep_unsent).
    keep_unsent: bool = option(
        True,
        "each group keeps on its own model what its exchange has not sent yet "
        "(its error feedback) instead of restarting from the global model without it "
        "(not with eager)",
    )
    # All of it by default: 1/G, the weight fp32's average gives a group's own progress, did not
    # hold across the sets it was tried on (docs: diloco, on keep_unsent).
    unsent_share: float = option(
        1.0,
        "with keep_unsent: the share of a group's unsent progress it keeps on "
        "its model, the rest waiting in the accumulator; 0: 1/groups",
    )
    error_decay: float = option(1.0, "the error-feedback accumulator's decay, e <- decay*e + Δ")

    def validate(self) -> None:
        if not 0 < self.density <= 1:
            raise ConfigError(f"diloco.sparse.density must be in (0, 1], got {self.density}")
        if not 0 <= self.owner_density <= 1:
            raise ConfigError(
                f"diloco.sparse.owner_density must be in [0, 1] (0: three times density), got {self.owner_density}"
            )
        if not 0 <= self.unsent_share <= 1:
            raise ConfigError(f"diloco.sparse.unsent_share must be in [0, 1] (0: 1/groups), got {self.unsent_share}")
        if not 0 <= self.error_decay <= 1:
            raise ConfigError(f"diloco.sparse.error_decay must be in [0, 1], got {self.error_decay}")


@dataclass
class LowRankOptions:
    """diloco.lowrank: PowerSGD factors of each matrix of the pseudo-gradient, with error feedback."""

    # 0, a rank per matrix from a byte budget: one fixed rank spends the bytes unevenly between models, and
    # the pseudo-gradient's tail needs rank wherever the bytes allow (docs: benchmarks, "DiLoCo's exchange
    # between groups").
    rank: int = option(
        0,
        "columns of P and Q per matrix; 0: each matrix's own, what its share of the byte budget (factor_share) buys",
    )
    # 4: the same bytes buy nearly twice int8's rank, at equal bytes rank buys more than precision, and
    # the mean's rounding, fed back by its owner, is not lost (docs: benchmarks, "DiLoCo's exchange between groups").
    factor_bits: int = option(
        4, "bits a factor's number takes on the wire (4 or 8; dense numbers go in int8)", choices=(4, 8)
    )
    factor_share: float = option(
        0.05,
        "with rank 0: the share of fp32's bytes the exchange sends (dense "
        "numbers and scales included); every matrix is compressed by the same "
        "factor",
    )

    def validate(self) -> None:
        if self.rank < 0:
            raise ConfigError(
                f"diloco.lowrank.rank must be >= 0 (0: from diloco.lowrank.factor_share), got {self.rank}"
            )
        if not 0 < self.factor_share <= 1:
            raise ConfigError(f"diloco.lowrank.factor_share must be in (0, 1], got {self.factor_share}")


@dataclass
class DiLoCoOptions(GroupedOptions):
    """DiLoCo: groups train alone for sync_every steps; an outer step on the averaged
    pseudo-gradient joins them."""

    section: ClassVar[str] = "diloco"

    # A fraction, like AB-training's schedule, so the default fits a run of any length: a twentieth
    # of a 10,000-step run is the paper's H = 500.
    sync_every: float = option(0.05, "inner steps between outer steps, H (< 1: fraction of the run's steps)")
    # Four levels per block move every number at each exchange, so little waits in error feedback;
    # nearest fp32 DiLoCo in the worst case of every form tried (docs: decisions, "DiLoCo: int2").
    compression: str = option(
        "int2",
        "pseudo-gradients between groups: int2 (4 levels over each block's range, error feedback; pass "
        "none where fp32's quality is a must), sparse (top-k of each chunk at 2 bits, error feedback), lowrank "
        "(PowerSGD factors of each matrix in 4 bits, error feedback), int8 (per-block scaling, error feedback), "
        "fp16 or none (fp32); docs: methods/diloco",
        choices=COMPRESSIONS,
    )
    sparse: SparseOptions = subsection(SparseOptions, "options of compression sparse")
    lowrank: LowRankOptions = subsection(LowRankOptions, "options of compression lowrank")
    fragments: int = option(
        1, "streaming: sync the model in this many parts at staggered steps (peak traffic between groups / fragments)"
    )
    sync_delay: int = option(
        0,
        "inner steps between starting a fragment's exchange and applying it (torchft's "
        "fragment_sync_delay): the exchange runs behind them; 0 blocks; < H / fragments",
    )
    update_alpha: float = option(
        1.0,
        "with sync_delay: the share of the local progress made while the exchange "
        "ran that the fragment keeps on top of the new global parameters",
    )
    # Off by default: the other groups' part of each step comes a period late, which costs more the more
    # groups there are (docs: diloco, on diloco.eager).
    eager: bool = option(
        False,
        "hide each exchange behind the whole next period (eager updates): step at once with "
        "this group's own pseudo-gradient and the other groups' from one period earlier; "
        "plain averaging only (outer_momentum 0), not with sync_delay; pays at few groups "
        "(the other groups' part, a period late, grows with their number)",
    )
    shard: bool = option(
        False,
        "shard the model, its gradients and optimiser state over each group's ranks "
        "(FSDP2, torch engine): each rank's outer step and exchange work on its own shards, "
        "with the ranks holding the same shards in the other groups",
    )

    def validate(self) -> None:
        super().validate()
        if self.sync_every <= 0 or (self.sync_every > 1 and self.sync_every != int(self.sync_every)):
            raise ConfigError(
                f"diloco.sync_every must be a whole number of steps or a fraction in (0, 1), got {self.sync_every}"
            )
        if self.fragments < 1:
            raise ConfigError(f"diloco.fragments must be >= 1, got {self.fragments}")
        self.sparse.validate()
        self.lowrank.validate()
        if self.keeps_unsent and self.sparse.error_decay != 1:
            raise ConfigError(
                f"diloco.sparse.error_decay {self.sparse.error_decay} decays the exchange's accumulator, but "
                f"with diloco.sparse.keep_unsent (the default) each group's model holds what is unsent: set "
                f"--diloco.sparse.keep_unsent false to decay it"
            )
        if self.sync_delay < 0:
            raise ConfigError(f"diloco.sync_delay must be >= 0, got {self.sync_delay}")
        if not 0 <= self.update_alpha <= 1:
            raise ConfigError(f"diloco.update_alpha must be in [0, 1], got {self.update_alpha}")
        if self.eager and self.sync_delay:
            raise ConfigError("diloco.eager already runs each exchange behind a whole period: leave sync_delay at 0")
        if self.eager and self.fragments > 1:
            raise ConfigError(
                f"diloco.eager takes one fragment (got {self.fragments}): use sync_delay to overlap "
                f"a streaming run's exchanges"
            )
        if self.eager and self.outer_momentum:
            raise ConfigError(
                f"diloco.eager needs plain averaging (outer_momentum 0, got {self.outer_momentum}): each "
                f"group steps its own copy, and momentum would let the groups' outer states drift apart"
            )

    @property
    def keeps_unsent(self) -> bool:
        """Whether groups keep their unsent error feedback on their models (eager keeps its own)."""
        return self.compression == "sparse" and self.sparse.keep_unsent and not self.eager

    def check_schedule(self, every: int) -> None:
        """The delay must let each fragment's exchange land before the next one starts."""
        if self.sync_delay and self.sync_delay >= every / self.fragments:
            raise ConfigError(
                f"diloco.sync_delay {self.sync_delay} must be below H / fragments = {every} / "
                f"{self.fragments}: a fragment's exchange must land before the next one starts"
            )


# ---------------------------------------------------------------------------------------------
# fragments, shards and the sync schedule (shared with the cost model)


def fragment_bounds(sizes: list[int], fragments: int) -> list[int]:
    """Tensor indices [0, b_1, ..., len(sizes)]: `fragments` contiguous runs of tensors holding
    about equal numbers."""
    if fragments > len(sizes):
        raise ConfigError(
            f"diloco.fragments {fragments}, but the model has only {len(sizes)} trainable tensors: "
            f"use at most {len(sizes)} fragments"
        )
    cumulative = [0]
    for n in sizes:
        cumulative.append(cumulative[-1] + n)
    bounds = [0]
    for k in range(1, fragments):
        target = cumulative[-1] * k / fragments
        best = min(range(bounds[-1] + 1, len(sizes) - (fragments - k) + 1), key=lambda i: abs(cumulative[i] - target))
        bounds.append(best)
    return [*bounds, len(sizes)]


def shard_length(numbers: int, group_size: int) -> int:
    """Numbers in each rank's slice of a fragment (the last slices padded with zeros)."""
    return -(-numbers // group_size)


def sync_due(inner_step: int, fragment: int, every: int, fragments: int) -> bool:
    """Whether `fragment` is synced after inner step `inner_step` (1-based): at f·H/F + k·H."""
    offset = fragment * every // fragments
    return inner_step >= max(offset, 1) and (inner_step - offset) % every == 0
