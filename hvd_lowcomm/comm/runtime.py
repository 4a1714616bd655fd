"""Process start-up: MPI and the engine, rank groups, device, seeds, abort-on-error.

MPI starts the job (mpirun, srun) and gives ranks, nodes and groups. The engine that moves the
meter's tensors (hvd_lowcomm.comm.engines) starts on MPI_COMM_WORLD: Horovod with *dynamic*
process sets, or torch.distributed with its rendezvous over MPI. A method can split the world
into groups whenever its schedule needs them (`split_world`), and every group gets both an
mpi4py sub-communicator (for point-to-point messages) and the engine's handle for the same
ranks (a Horovod process set, or a torch.distributed group) for collectives.

A failure on any rank must end the whole job, never leave the others waiting in a collective:
`abort_on_error` turns an uncaught exception into MPI_Abort, which makes mpirun/srun kill
every rank and exit non-zero.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import random
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np
import torch
from tqdm import tqdm

from hvd_lowcomm.comm import engines, rendezvous
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
    """

    label: str
    index: int
    ranks: tuple[int, ...]
    process_set: Any = field(compare=False, repr=False)
    comm: Any = field(compare=False, repr=False)
    side: Any = field(default=None, compare=False, repr=False)

    @property
    def size(self) -> int:
        return len(self.ranks)

    def rank_of(self, global_rank: int) -> int:
        """Position of a global rank inside this group."""
        return self.ranks.index(global_rank)

    def __contains__(self, global_rank: int) -> bool:
        return global_rank in self.ranks


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
        _bind_gpu(local_rank, local_size)
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


def compute_threads(local_ranks: int, cores_allowed: int, cores_on_node: int) -> int:
    """Threads for one rank's tensor arithmetic: the cores it may run on, but no more than its
    share of the node when it shares them with the node's other ranks. torch's default, a
    thread per core in every process, puts local_ranks x cores threads on the node's cores when
    mpirun does not bind ranks (it does not once they outnumber cores): the threads then wait
    for one another's time slices, which slows even a step without communication several
    times over. A rank bound to its own cores (srun --cpus-per-task, mpirun --map-by
    slot:PE=n) sees just those, and uses them all. Like torchrun, which sets one thread."""
    return max(1, min(cores_allowed, cores_on_node // max(local_ranks, 1)))


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


def device(choice: str = "auto") -> torch.device:
    """Where this rank computes: `cuda` the GPU bound to it (init() binds it: gpu_for_rank),
    `cpu`, `auto` that GPU when CUDA is available, else the CPU; any other name is a device
    PyTorch knows (another accelerator's backend), used as it is."""
    if choice not in ("auto", "cuda", "cpu"):
        try:
            return torch.device(choice)
        except RuntimeError:
            raise ConfigError(
                f"train.device {choice!r} is not a device PyTorch knows: use auto, cuda, cpu or the name "
                f"of a device type with a backend in this PyTorch"
            ) from None
    if choice == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "train.device cuda, but this rank sees no CUDA GPU (torch.cuda.is_available() is "
            "False): use --train.device auto or cpu, or a CUDA build of torch on a GPU node"
        )
    if choice != "cpu" and torch.cuda.is_available():
        if _gpu_problem:
            raise ConfigError(_gpu_problem)
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# Why this rank has no GPU of its own (more ranks than GPUs on its node), or "".
_gpu_problem = ""
# Whether the ranks of a node share GPUs (allowed by HVD_LOWCOMM_SHARE_GPUS=1): NCCL then refuses them.
_gpus_shared = False


def gpu_for_rank(local_rank: int, local_size: int, visible: int, share: bool = False) -> int:
    """The GPU index (among the visible ones) a rank uses: the one GPU it sees when it is given
    one (Slurm's --gpus-per-task, CUDA_VISIBLE_DEVICES per task), else its local rank when the
    node has a GPU for every rank. More ranks than GPUs is a ConfigError saying how to fix it,
    unless `share` (several ranks per GPU: correct, and slow beyond a check)."""
    if visible == 1:
        return 0
    if local_size <= visible:
        return local_rank
    if share:
        return local_rank % visible
    raise ConfigError(
        f"{local_size} ranks on this node but {visible} GPUs visible to each: a rank needs a GPU of its "
        f"own. Start at most {visible} ranks per node (Slurm: --ntasks-per-node={visible} "
        f"--gpus-per-task=1; Open MPI: mpirun --npernode {visible}), or train on the CPU with "
        f"--train.device cpu (HVD_LOWCOMM_SHARE_GPUS=1 lets ranks share GPUs, for tests)"
    )


def _bind_gpu(local_rank: int, local_size: int) -> None:
    """Bind this rank's GPU (gpu_for_rank), then find out, by the GPUs' UUIDs, whether ranks of
    a node share one (each sees a single GPU, but the same). Collective. A problem is kept for
    device() to raise where the GPU is asked for, not on CPU runs."""
    from mpi4py import MPI

    global _gpu_problem, _gpus_shared
    share = os.environ.get("HVD_LOWCOMM_SHARE_GPUS") == "1"
    uuid = None
    if torch.cuda.is_available():
        try:
            torch.cuda.set_device(gpu_for_rank(local_rank, local_size, torch.cuda.device_count(), share))
            uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
        except ConfigError as problem:
            _gpu_problem = str(problem)
    bound = [(host, gpu) for host, gpu in MPI.COMM_WORLD.allgather((MPI.Get_processor_name(), uuid)) if gpu]
    _gpus_shared = len(set(bound)) < len(bound)
    if _gpus_shared and not share and not _gpu_problem:
        _gpu_problem = (
            "ranks of one node are bound to the same GPU (each sees one, the same): a rank needs a GPU of "
            "its own. Give each task its own (Slurm: --gpus-per-task=1) or start as many ranks per node "
            "as it has GPUs, or train on the CPU with --train.device cpu (HVD_LOWCOMM_SHARE_GPUS=1 lets "
            "ranks share GPUs, for tests)"
        )


def device_of(tensors: Any) -> torch.device:
    """Where the first of `tensors` (a module's parameters, say) lives; the CPU when there is none."""
    return next((t.device for t in tensors), torch.device("cpu"))


def clock(device: torch.device) -> float:
    """time.perf_counter() once the work queued on `device` is done: a GPU runs kernels
    asynchronously, so a phase's time must wait for them to be its own."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def ranks_share_a_gpu() -> bool:
    return _gpus_shared


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


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


# ---------------------------------------------------------------------------------------------
# failure handling


@contextlib.contextmanager
def abort_on_error() -> Iterator[None]:
    """Any exception inside ends the whole MPI job with a non-zero exit instead of a hang.

    The failing rank prints its traceback (prefixed with its rank) and calls MPI_Abort, which
    makes the launcher kill every other rank, wherever they are blocked.
    """
    try:
        yield
    except SystemExit as exc:
        if exc.code not in (None, 0):
            _abort(int(exc.code) if isinstance(exc.code, int) else 1)
        raise
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the other ranks
        where = f"[rank {_safe_rank()}]"
        if isinstance(exc, (ConfigError, FloatingPointError)):  # the message says it all
            report_failure(f"{where} error: {exc}\n")
        else:
            text = "".join(traceback.format_exception(exc))
            report_failure("".join(f"{where} {line}\n" for line in text.rstrip().splitlines()))
        _abort(2 if isinstance(exc, ConfigError) else 1)


def _print_to_stderr(text: str) -> None:
    print(text, file=sys.stderr, end="", flush=True)


# How a failing rank shows why it ends the job; mpi_tests' conftest prints past pytest's capture,
# which MPI_Abort would otherwise discard with the traceback in it.
report_failure: Callable[[str], None] = _print_to_stderr


def exit_process(code: int) -> None:
    """End a finished program: its exit handlers and MPI_Finalize while Python still runs,
    then the process, without the interpreter's teardown, where a Gloo worker thread still
    alive (its process group referenced by a mesh or a module) may drop a tensor's last
    reference and abort the process (pytorch/pytorch#190489)."""
    sys.stdout.flush()
    sys.stderr.flush()
    atexit._run_exitfuncs()  # the torch engine's destroy_process_group, loggers, Horovod's shutdown
    if "mpi4py.MPI" in sys.modules:
        from mpi4py import MPI

        if MPI.Is_initialized() and not MPI.Is_finalized():
            MPI.Finalize()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _abort(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    if "mpi4py.MPI" in sys.modules and _mpi_size() > 1:
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(code)
    os._exit(code)


def _mpi_size() -> int:
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_size() if MPI.Is_initialized() and not MPI.Is_finalized() else 1


def _safe_rank() -> int:
    try:
        from mpi4py import MPI

        return MPI.COMM_WORLD.Get_rank() if MPI.Is_initialized() else 0
    except Exception:  # noqa: BLE001 - best effort while already failing
        return 0
