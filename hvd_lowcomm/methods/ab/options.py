"""AB-training's options, its phase schedule, and the group counts it can train in."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from hvd_lowcomm.comm import runtime
from hvd_lowcomm.config import ConfigError, option, subsection
from hvd_lowcomm.methods.ab.factorized import RANK_RULES
from hvd_lowcomm.methods.grouped import GroupedOptions
from hvd_lowcomm.schedule import run_steps

SYNC_MODES = ("with-stale", "only-learned", "only-b", "full")
COMM_SETUPS = ("groups", "individual")
INITS = ("default", "ortho-sigma")


@dataclass
class CutOptions:
    """ab.cut: which singular values a re-factorisation keeps, and the guards that undo a cut."""

    rank_rule: str = option(
        "noise",
        "which singular values a re-factorisation keeps: noise (those above the "
        "random bulk's edge, Gavish-Donoho threshold on the median) or tau "
        "(sigma_i > tau * sigma_1, the reference's rule)",
        choices=RANK_RULES,
    )
    tau: float = option(0.15, "rank_rule tau: keep singular values > tau * sigma_1")
    max_output_error: float = option(
        0.25,
        "floor beside the rank rule: a cut drops at most this share "
        "(relative Frobenius norm) of a layer's output on the step's batch "
        "(of its weight for convolutions without unfolded inputs)",
    )
    max_accuracy_drop: float = option(
        0.03, "undo a cut (keep more rank) that lowers the step's pooled batch accuracy by more than this"
    )
    # A cut's rank is a ceiling (W = A B keeps it through syncs, full-rank phases add few directions),
    # so a floor keeps room for what the layer learns later, one share for every layer: the total rank
    # costs, not how it is spread (docs: transformers, "At the adaptive defaults").
    min_rank_share: float = option(0.25, "a cut keeps at least this share of a layer's smaller side")
    # Beside the accuracy guard: a language model's cut shows in its loss, while its next-token
    # accuracy barely moves (docs: ab, "Rank").
    max_loss_rise: float = option(
        0.01, "undo a cut (keep more rank) that raises the step's pooled batch loss by more than this share"
    )

    def validate(self) -> None:
        if not 0.0 < self.tau < 1.0:
            raise ConfigError(f"ab.cut.tau must be in (0, 1), got {self.tau}")
        if not 0.0 <= self.max_output_error < 1.0:
            raise ConfigError(f"ab.cut.max_output_error must be in [0, 1), got {self.max_output_error}")
        if not 0.0 <= self.min_rank_share <= 1.0:
            raise ConfigError(f"ab.cut.min_rank_share must be in [0, 1], got {self.min_rank_share}")
        if self.max_loss_rise < 0:
            raise ConfigError(f"ab.cut.max_loss_rise must be >= 0, got {self.max_loss_rise}")
        if not 0.0 <= self.max_accuracy_drop <= 1.0:
            raise ConfigError(f"ab.cut.max_accuracy_drop must be in [0, 1], got {self.max_accuracy_drop}")


@dataclass
class ABOptions(GroupedOptions):
    """AB-training: low-rank factors A, B trained by independent groups of ranks."""

    section: ClassVar[str] = "ab"

    # Schedule lengths: steps, or below 1 a fraction of the run's steps, so the defaults fit a
    # run of any length (sync_every: the reference syncs about every twentieth of its run).
    warmup: float = option(
        0.1, "full-rank data-parallel steps before the first factorisation (< 1: fraction of the run's steps)"
    )
    sync_every: float = option(0.05, "group-phase steps between global syncs (< 1: fraction of the run)")
    full_rank_steps: float = option(0.01, "full-rank data-parallel steps after each sync (< 1: fraction of the run)")
    cut: CutOptions = subsection(CutOptions, "how a re-factorisation chooses each layer's rank, and its guards")
    sync_mode: str = option("with-stale", "how factors are combined at a sync", choices=SYNC_MODES)
    comm: str = option(
        "groups",
        "groups: a group averages its trained factor every step; individual: every "
        "rank trains its own copy until the sync",
        choices=COMM_SETUPS,
    )
    init: str = option(
        "default",
        "ortho-sigma: set every weight's singular values to 1 before training (the reference's init)",
        choices=INITS,
    )
    full_rank: list[str] = option(["first", "last"], "layers never factorised (names, or first/last)")
    first_full_rank: bool = option(True, "keep every singular value at the first factorisation")
    # What a cut removes cannot be learned any more, and a layer goes on learning directions long
    # after warm-up, so the first cut waits until they have mostly settled (docs: ab, "Schedule").
    first_cut: float = option(
        0.5,
        "re-factorisations before this step keep every singular value; the "
        "first one from it on cuts (< 1: fraction of the run's steps; 0: every "
        "re-factorisation cuts)",
    )
    # Off by default: cycles here are tens of steps, and a third of each spent at a reduced rate is
    # lost learning (docs: ab, "Schedule").
    rebound_steps: float = option(
        0.0,
        "steps to ramp the LR back after a switch (0: no rebound; < 1: "
        "fraction of the run; the reference uses about a third of a cycle)",
    )
    rebound_lr: float = option(1e-5, "LR right after a switch")
    reset_optimizer: bool = option(False, "drop the factors' optimiser moments at re-factorisation")
    # The outer step (GroupedOptions' outer_*) at every sync: the change the groups made to every
    # weight (W = A B) and dense parameter since the group phase began is a pseudo-gradient,
    # and SGD with momentum steps the weights from where the phase began. lr 1 and momentum
    # 0: the sync's plain average (the paper's AB-training).

    def validate(self) -> None:
        super().validate()
        if self.warmup < 0 or self.full_rank_steps < 0 or self.rebound_steps < 0:
            raise ConfigError("ab.warmup, ab.full_rank_steps and ab.rebound_steps must be >= 0")
        if self.sync_every <= 0:
            raise ConfigError(f"ab.sync_every must be > 0, got {self.sync_every}")
        if self.first_cut < 0:
            raise ConfigError(f"ab.first_cut must be >= 0, got {self.first_cut}")
        for name in ("warmup", "sync_every", "full_rank_steps", "rebound_steps", "first_cut"):
            value = getattr(self, name)
            if value > 1 and value != int(value):
                raise ConfigError(f"ab.{name} must be a whole number of steps or a fraction below 1, got {value}")
        self.cut.validate()
        if self.rebound_lr <= 0:
            raise ConfigError(f"ab.rebound_lr must be > 0, got {self.rebound_lr}")


class Schedule:
    """Which phase global step t is in, and what happens when entering it."""

    def __init__(self, o: ABOptions, total_steps: int | None = None) -> None:
        self.warmup, self.sync_every, self.full_rank_steps, self.rebound_steps, self.first_cut = (
            run_steps(o.warmup, total_steps, "ab.warmup"),
            max(1, run_steps(o.sync_every, total_steps, "ab.sync_every")),
            run_steps(o.full_rank_steps, total_steps, "ab.full_rank_steps"),
            run_steps(o.rebound_steps, total_steps, "ab.rebound_steps"),
            run_steps(o.first_cut, total_steps, "ab.first_cut"),
        )

    def phase(self, t: int) -> str:
        if t < self.warmup:
            return "warmup"
        return "group" if self.position(t) < self.sync_every else "full"

    def position(self, t: int) -> int:
        return (t - self.warmup) % (self.sync_every + self.full_rank_steps)

    def cuts(self, t: int) -> bool:
        """Whether a re-factorisation at the start of step t cuts (else it keeps every singular value)."""
        return t >= self.first_cut

    def transitions(self, t: int) -> list[str]:
        """Actions at the start of step t: factorize-first, sync, refactorize."""
        now = self.phase(t)
        before = self.phase(t - 1) if t > 0 else "warmup"
        if now == "group" and before == "warmup":
            return ["factorize-first"]
        if now == "full" and before == "group":
            return ["sync"]
        if now == "group" and before == "full":
            return ["refactorize"]
        if now == "group" and t > self.warmup and self.position(t) == 0:  # full_rank_steps == 0
            return ["sync", "refactorize"]
        return []


def check_groups(options: ABOptions, groups: int, world_size: int) -> None:
    if groups < 2 and options.sync_mode != "only-b":
        raise ConfigError(
            f"AB-training needs at least 2 groups (A-groups and B-groups), got {groups}: pass "
            f"--ab.groups 2 (or more) with a rank count it divides, or --ab.sync_mode only-b, "
            f"which trains B alone and allows one group"
        )
    runtime.group_layout(world_size, num_groups=groups)
