"""Groups of ranks: the `Group` a method's collectives run in, and how a world splits into
contiguous, equal groups (one per node by default where the job spans nodes)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hvd_lowcomm.config import ConfigError


class GroupLayoutError(ConfigError):
    """The ranks cannot be split into the requested groups."""


@dataclass(frozen=True)
class Group:
    """A set of contiguous ranks that communicate among themselves.

    `process_set` is what the engine's collectives take for these ranks (a Horovod process set,
    or a torch.distributed group on the torch engine); `comm` is the matching mpi4py
    sub-communicator on members and MPI.COMM_NULL on every other rank; `side`, where the split
    asked for one, the engine's channel of these ranks' own for a worker thread's collectives.
    `peers`, for a group of processes in other MPI jobs (elastic DiLoCo's column): the engine
    that runs its collectives instead of the job's; `ranks` then number those peers.
    """

    label: str
    index: int
    ranks: tuple[int, ...]
    process_set: Any = field(compare=False, repr=False)
    comm: Any = field(compare=False, repr=False)
    side: Any = field(default=None, compare=False, repr=False)
    peers: Any = field(default=None, compare=False, repr=False)

    @property
    def size(self) -> int:
        return len(self.ranks)

    def rank_of(self, global_rank: int) -> int:
        """Position of a global rank inside this group."""
        return self.ranks.index(global_rank)

    def __contains__(self, global_rank: int) -> bool:
        return global_rank in self.ranks


def group_layout(
    world_size: int, num_groups: int | None = None, group_size: int | None = None
) -> list[tuple[int, ...]]:
    """Contiguous, equal groups of ranks: [(0, 1), (2, 3)] for 4 ranks in 2 groups.

    Contiguous ranks share a node under the usual block placement (--map-by core/slot), so
    traffic inside a group stays inside a node when groups are node-sized.
    """
    if (num_groups is None) == (group_size is None):
        raise ValueError("give exactly one of num_groups or group_size")
    if num_groups is not None:
        if num_groups <= 0 or world_size % num_groups:
            raise GroupLayoutError(
                f"cannot split {world_size} ranks into {num_groups} equal groups: use a group "
                f"count that divides {world_size} ({_divisors(world_size)}) or launch a multiple "
                f"of {num_groups} ranks"
            )
        group_size = world_size // num_groups
    assert group_size is not None
    if group_size <= 0 or world_size % group_size:
        raise GroupLayoutError(
            f"cannot split {world_size} ranks into groups of {group_size}: use a group size that "
            f"divides {world_size} ({_divisors(world_size)}) or launch a multiple of {group_size} ranks"
        )
    return [tuple(range(start, start + group_size)) for start in range(0, world_size, group_size)]


def groups_for(requested: int, world_size: int, ranks_per_node: int) -> int:
    """`requested` groups, or with 0 one group per node when the job spans several nodes (a
    group's traffic then stays inside its node), else 2, or on an odd rank count its smallest
    divisor (3 ranks: 3 groups of one), so that any rank count has a default. The rule of
    AB-training and DiLoCo, for their runs and for the cost model's predictions alike."""
    if requested:
        return requested
    if world_size > ranks_per_node:
        return world_size // ranks_per_node
    return next((g for g in range(2, world_size + 1) if world_size % g == 0), 2)


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)
