"""Process start-up: MPI and the engine, the world and its ranks and nodes, splitting it into
groups, seeds.

MPI starts the job (mpirun, srun) and gives ranks, nodes and groups. The engine that moves the
meter's tensors (hvd_lowcomm.comm.engines) starts on MPI_COMM_WORLD: Horovod with *dynamic*
process sets, or torch.distributed with its rendezvous over MPI. A method can split the world
into groups whenever its schedule needs them (`split_world`), and every group gets both an
mpi4py sub-communicator (for point-to-point messages) and the engine's handle for the same
ranks (a Horovod process set, or a torch.distributed group) for collectives.

Beside it, one concern a module: the groups' layout (hvd_lowcomm.comm.groups), where a rank
computes (hvd_lowcomm.comm.devices) and how a failure ends the job (hvd_lowcomm.comm.failures);
their names are this module's too, where the rest of the package has always found them.
"""

from __future__ import annotations

import os
import random
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from hvd_lowcomm.comm import devices, engines, rendezvous
from hvd_lowcomm.comm.devices import (  # noqa: F401 - this module's names too
    clock,
    compute_threads,
    device,
    device_of,
    gpu_for_rank,
    ranks_share_a_gpu,
)
from hvd_lowcomm.comm.failures import abort_on_error, exit_process  # noqa: F401 - this module's names too
from hvd_lowcomm.comm.groups import (  # noqa: F401 - this module's names too
    Group,
    GroupLayoutError,
    group_layout,
    groups_for,
)
from hvd_lowcomm.config import ConfigError


_world: Group | None = None
# The node of every global rank (index in order of first appearance of its host name): what
# the meter needs to tell traffic between nodes from traffic inside one.
_node_of: tuple[int, ...] = ()
# Whether Horovod was started by the user's own hvd.init() without dynamic process sets.
_fixed_process_sets = False
# Horovod refuses to register the same ranks twice, so process sets are shared by rank tuple.
_process_sets: dict[tuple[int, ...], Any] = {}
# The engine the meter's collectives go through, and why it was chosen.
_engine: Any = None
_engine_why = ""
_bf16_wire = torch.float32  # what bfloat16 tensors travel in


# Variables an MPI launcher (mpirun/mpiexec of Open MPI, MPICH, Intel MPI) or Slurm's srun sets
# in every process it starts; torchrun sets RANK/WORLD_SIZE/LOCAL_RANK and TORCHELASTIC_RUN_ID.
MPI_LAUNCHER_VARIABLES = (
    "OMPI_COMM_WORLD_SIZE",
    "PMI_SIZE",
    "PMIX_RANK",
    "PMI_RANK",
    "SLURM_PROCID",
    "MPI_LOCALNRANKS",
    "HYDRA_CONTROL_FD",
)


def launcher_problem(environ: dict[str, str] | None = None) -> str | None:
    """Why this process cannot join an MPI job (started by torchrun: each process would be a
    one-rank job of its own and train alone), or None."""
    env = os.environ if environ is None else environ
    started_by_torchrun = "TORCHELASTIC_RUN_ID" in env or {"RANK", "WORLD_SIZE", "LOCAL_RANK"} <= set(env)
    if not started_by_torchrun or any(v in env for v in MPI_LAUNCHER_VARIABLES) or env.get("WORLD_SIZE", "1") == "1":
        return None
    n = env["WORLD_SIZE"]
    return (
        f"this process was started by torchrun (RANK={env.get('RANK', '?')}, WORLD_SIZE={n}), which does not "
        f"start an MPI job: each process would train alone as rank 0 of 1. hvd_lowcomm runs on MPI; launch "
        f"the same command with `mpirun -np {n} python ...` (Open MPI as root: add --allow-run-as-root), or "
        f"`srun -n {n} python ...` under Slurm"
    )


def init(seed: int | None = None, engine: str = "auto", reduce_dtype: str | None = None) -> Group:
    """Start MPI and the engine (idempotent), bind the device, seed everything; return the world
    group. engine: "horovod", "torch" or "auto" (HVD_LOWCOMM_ENGINE where set, else Horovod where
    it is installed, and built with NCCL on a GPU machine, else torch). reduce_dtype: what
    bfloat16 tensors travel and are summed in, "float32" or "bfloat16" (the torch engine only);
    None: float32 at the first init, the first init's choice after it (as "auto" for engine)."""
    global _world, _engine, _engine_why, _node_of, _bf16_wire
    if _world is None:
        problem = launcher_problem()
        if problem:
            raise ConfigError(problem)
        requested = os.environ.get("HVD_LOWCOMM_ENGINE", "auto") if engine == "auto" else engine
        name, _engine_why = engines.choose(requested, reduce_dtype or "float32")
        _bf16_wire = torch.bfloat16 if reduce_dtype == "bfloat16" else torch.float32
        from mpi4py import MPI

        if name == "horovod":
            import horovod.torch as hvd

            start_horovod(hvd, MPI)
        _node_of = rendezvous.nodes_of(MPI.COMM_WORLD)
        global _local_rank, _local_size
        local = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
        _local_rank = local_rank = local.Get_rank()
        _local_size = local_size = local.Get_size()
        local.Free()
        devices.bind_gpu(local_rank, local_size)
        if name == "horovod":
            engines.start_default_process_group(MPI.COMM_WORLD, _node_of)  # for DDP's idioms (DistributedSampler)
            _engine = engines.HorovodEngine()
        else:
            _engine = engines.TorchEngine(MPI.COMM_WORLD, _node_of)
        world_ranks = tuple(range(MPI.COMM_WORLD.Get_size()))
        _world = Group("world", 0, world_ranks, _engine.world(), MPI.COMM_WORLD)
        _process_sets[world_ranks] = _engine.world()
        if "OMP_NUM_THREADS" not in os.environ:  # the user's (or the job script's) choice stands
            torch.set_num_threads(compute_threads(local_size, len(os.sched_getaffinity(0)), os.cpu_count() or 1))
    elif reduce_dtype is not None and (reduce_dtype == "bfloat16") != (_bf16_wire == torch.bfloat16):
        raise ConfigError(
            f"hvd_lowcomm already sends bfloat16 tensors as {str(_bf16_wire)[6:]}; reduce_dtype is "
            f"chosen once per job, at the first init"
        )
    elif engine != "auto" and engine != _engine.name:
        raise ConfigError(
            f"hvd_lowcomm already runs on the {_engine.name} engine ({_engine_why}); an engine is "
            f"chosen once per job, at the first init"
        )
    if seed is not None:
        seed_everything(seed)
    return _world


def engine() -> Any:
    """The engine the meter's collectives go through (hvd_lowcomm.comm.engines)."""
    if _engine is None:
        raise RuntimeError("hvd_lowcomm.init() has not run")
    return _engine


def bf16_wire_dtype() -> torch.dtype:
    """What bfloat16 tensors travel in (init's reduce_dtype)."""
    return _bf16_wire


def engine_line() -> str:
    """Which engine runs and why, for the run's first line and its summary."""
    return f"{_engine.name} ({_engine_why})" if _engine is not None else "none"


def start_horovod(hvd: Any, MPI: Any) -> None:
    """hvd.init on MPI_COMM_WORLD with dynamic process sets, which the groups need. A script
    ported from Horovod may have called hvd.init() first: that Horovod is kept (it cannot be
    restarted where it started MPI itself), and a method that needs groups says to drop the
    line (`split`)."""
    global _fixed_process_sets
    if hvd.is_initialized():
        _fixed_process_sets = os.environ.get("HOROVOD_DYNAMIC_PROCESS_SETS") != "1"
        return
    hvd.init(comm=MPI.COMM_WORLD, process_sets="dynamic")


def group_of_process_set(process_set: Any) -> Group | None:
    """The Group of a Horovod process set a user passes (None for the global one); collective
    over the set's members, as Horovod's own process sets are."""
    import horovod.torch as hvd

    if engine().name != "horovod":
        if process_set is hvd.global_process_set:  # all ranks, whatever the engine
            return None
        raise ConfigError(
            "process_set= is Horovod's; on the torch engine pass hvd_lowcomm's group= instead "
            "(hvd_lowcomm.comm.runtime.split_world)"
        )

    ranks = tuple(process_set.ranks or ())
    if process_set is hvd.global_process_set or ranks == world().ranks:
        return None
    from mpi4py import MPI

    members = world().comm.group.Incl(list(ranks))
    comm = world().comm.Create_group(members) if rank() in ranks else MPI.COMM_NULL
    _process_sets.setdefault(ranks, process_set)
    return Group(f"process_set{process_set.process_set_id}", process_set.process_set_id, ranks, process_set, comm)


def process_sets() -> list[tuple[int, ...]]:
    """The ranks of every Horovod process set this job has, the world's first: Horovod's
    background thread coordinates each of them every cycle, whether or not it has work."""
    return list(_process_sets)


def initialized() -> bool:
    return _world is not None


def world() -> Group:
    if _world is None:
        raise RuntimeError("hvd_lowcomm.comm.runtime.init() has not been called")
    return _world


def rank() -> int:
    return world().comm.Get_rank()


def size() -> int:
    return world().size


_local_rank = 0  # this rank's place among the ranks of its node, and their number (set by init)
_local_size = 1


def local_rank() -> int:
    """This rank's index among the ranks on its node (Horovod's hvd.local_rank()): the GPU a
    rank takes where each node has one per rank."""
    world()
    return _local_rank


def local_size() -> int:
    """The number of ranks on this rank's node (Horovod's hvd.local_size())."""
    world()
    return _local_size


def cross_rank() -> int:
    """The index of this rank's node (Horovod's hvd.cross_rank())."""
    world()
    return _node_of[rank()]


def cross_size() -> int:
    """The number of nodes in the job (Horovod's hvd.cross_size())."""
    world()
    return len(set(_node_of))


def node_of(global_rank: int) -> int:
    """The node (0, 1, ... in order of host names' first appearance) that holds a global rank."""
    return _node_of[global_rank] if _node_of else 0


def node_count() -> int:
    return len(set(_node_of)) or 1


def node_layout() -> list[tuple[int, ...]]:
    """The global ranks of each node, node by node (for a group per node: `split(node_layout(), ...)`)."""
    nodes = _node_of or (0,) * size()
    return [tuple(r for r, n in enumerate(nodes) if n == node) for node in sorted(set(nodes))]


def ranks_per_node() -> int:
    """Ranks on this rank's node (Horovod's local size, from the same host names)."""
    return _node_of.count(node_of(rank())) if _node_of else 1


def leaves_node(ranks: tuple[int, ...], me: int, dest: int | None = None) -> bool:
    """Whether what `me` sends in a ring over `ranks` (or to `dest`, point to point) goes to
    another node: a ring rank sends only to its successor, so a ring over several nodes leaves
    each node once per node it spans, whatever the number of ranks inside."""
    if dest is None:
        dest = ranks[(ranks.index(me) + 1) % len(ranks)]
    return node_of(dest) != node_of(me)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def default_group_count(requested: int, world_size: int) -> int:
    """`groups_for` with this job's ranks per node."""
    return groups_for(requested, world_size, ranks_per_node())


def split_world(
    num_groups: int | None = None, group_size: int | None = None, label: str = "group"
) -> tuple[Group, list[Group]]:
    """Split the world into equal contiguous groups; collective, call on every rank.

    Returns (this rank's group, all groups). Every rank registers every group's Horovod
    process set (Horovod requires that), but only members may use a group's collectives.
    """
    return split(group_layout(world().size, num_groups, group_size), label)


def split_by_position(num_groups: int, label: str = "column", side: bool = False) -> tuple[Group, list[Group]]:
    """The ranks at the same position in each of `num_groups` contiguous groups, as groups of
    their own: rank i of every group with rank i of the others (with one group per node, each
    such group spans the nodes once). Collective, call on every rank."""
    rows = group_layout(world().size, num_groups=num_groups)
    return split([tuple(row[i] for row in rows) for i in range(len(rows[0]))], label, side)


def split(layout: list[tuple[int, ...]], label: str, side: bool = False) -> tuple[Group, list[Group]]:
    """Groups of the given ranks (each rank in exactly one), with `side` a channel of each
    group's own for a worker thread (Group.side); collective, call on every rank."""
    from mpi4py import MPI

    if _fixed_process_sets and any(ranks not in _process_sets for ranks in layout):
        raise ConfigError(
            "hvd.init() ran before hvd_lowcomm.init(), without the dynamic process sets that "
            "hvd_lowcomm's groups need: remove the hvd.init() line (hvd_lowcomm.init() starts "
            "Horovod, and hvd.rank(), hvd.size(), hvd.local_rank() work after it as before)"
        )
    w = world()
    my_index = next(i for i, ranks in enumerate(layout) if rank() in ranks)
    sub_comm = w.comm.Split(color=my_index, key=rank())
    groups = []
    for index, ranks in enumerate(layout):
        if ranks not in _process_sets:
            _process_sets[ranks] = engine().group(ranks)
        comm = sub_comm if index == my_index else MPI.COMM_NULL
        channel = engine().side_group(ranks, comm) if side else None
        groups.append(Group(f"{label}{index}", index, ranks, _process_sets[ranks], comm, channel))
    return groups[my_index], groups


def announce(text: str) -> None:
    """Print `text` on global rank 0 only, above any progress bar (tqdm.write keeps the bar
    intact); the one way the library speaks to the user while training."""
    if rank() == 0:
        tqdm.write(text)
