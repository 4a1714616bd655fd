"""The engines under the traffic meter: what moves the tensors the meter counts.

- `horovod`: Horovod's collectives on its process sets (its background thread fuses what is
  submitted together into one cycle).
- `torch`: torch.distributed, Gloo for CPU tensors and NCCL for CUDA ones, on process groups
  made from the same MPI splits as the methods' groups. Its rendezvous comes from MPI
  (hvd_lowcomm.comm.rendezvous: rank 0's address and each rank's interface agreed over MPI;
  rank 0 opens a TCPStore on a free port and broadcasts it), so neither torchrun nor
  MASTER_ADDR/MASTER_PORT is needed. Tensors of one call and dtype are flattened into one
  buffer, one collective each.

Both take the same calls, so the meter and the methods above it do not know which one runs:
`start_allreduce` / `finish` (sum or average over a group, scaled before and after),
`start_allgather` (first dimensions may differ per rank), `broadcast_`, and `group` (the
engine's handle for a set of ranks, made collectively on every rank). `side_group` gives a
set of ranks a channel of its own, whose blocking `side_*` collectives may run on a worker
thread beside the training thread's (DiLoCo's delayed exchange): an MPI communicator of its
own under Horovod, a process group of its own on torch. Small control messages, objects and
point-to-point messages go through mpi4py on either engine (MPI launched the job).
"""

from __future__ import annotations

import atexit
from typing import Any, Callable

import torch
import torch.distributed as dist

from hvd_lowcomm.comm import rendezvous
from hvd_lowcomm.config import ConfigError

ENGINES = ("auto", "horovod", "torch")
REDUCE_DTYPES = ("float32", "bfloat16")  # what bfloat16 tensors travel in


class HorovodEngine:
    name = "horovod"

    def __init__(self) -> None:
        import horovod.torch as hvd

        self.hvd = hvd

    def takes(self, device: torch.device, gpus_shared: bool) -> bool:
        """Whether the collectives read tensors on `device` themselves (else: staged on the host);
        `gpus_shared`: ranks of a node share a GPU, which NCCL refuses."""
        if device.type == "cpu":
            return True
        return device.type == "cuda" and bool(self.hvd.nccl_built()) and not gpus_shared

    def why_staged(self) -> str:
        return (
            "this Horovod was built without GPU operations (hvd.nccl_built() is false); to rebuild it with "
            "NCCL, load the CUDA toolkit (e.g. module load cuda) and run: .venv/bin/pip uninstall -y horovod && "
            "make install; or use the torch engine (hvd_lowcomm.init(engine='torch'), --comm.engine torch)"
        )

    def world(self) -> Any:
        return self.hvd.global_process_set

    def group(self, ranks: tuple[int, ...]) -> Any:
        return self.hvd.add_process_set(list(ranks))

    def start_allreduce(
        self,
        tensors: list[torch.Tensor],
        names: list[str],
        op: str,
        handle: Any,
        prescale: float = 1.0,
        postscale: float = 1.0,
        together: bool = False,
    ) -> Any:
        """together: one grouped allreduce (its tensors wait for each other); else one each,
        which Horovod's cycle fuses all the same."""
        hvd_op = {"sum": self.hvd.Sum, "average": self.hvd.Average, "max": self.hvd.Max}[op]
        if together:
            return self.hvd.grouped_allreduce_async(
                tensors,
                name=names[0],
                op=hvd_op,
                prescale_factor=prescale,
                postscale_factor=postscale,
                process_set=handle,
            )
        return [
            self.hvd.allreduce_async(
                t, name=n, op=hvd_op, prescale_factor=prescale, postscale_factor=postscale, process_set=handle
            )
            for t, n in zip(tensors, names)
        ]

    def start_allgather(self, tensor: torch.Tensor, name: str, handle: Any, members: int) -> Any:
        return self.hvd.allgather_async(tensor, name=name, process_set=handle)

    def finish(self, started: Any) -> Any:
        if isinstance(started, list):
            return [self.hvd.synchronize(h) for h in started]
        return self.hvd.synchronize(started)

    def broadcast_(self, tensor: torch.Tensor, root_rank: int, name: str, handle: Any) -> None:
        self.hvd.broadcast_(tensor, root_rank, name=name, process_set=handle)

    def side_group(self, ranks: tuple[int, ...], comm: Any) -> Any:
        """The members' own MPI communicator (Horovod's thread never touches it)."""
        return comm

    def side_thread_problem(self) -> str | None:
        """Why a worker thread cannot run side collectives here (None: it can)."""
        from mpi4py import MPI

        if MPI.Query_thread() != MPI.THREAD_MULTIPLE:
            return "MPI was initialised without MPI_THREAD_MULTIPLE (mpi4py's default; check mpi4py.rc)"
        return None

    def side_allreduce_sum_(self, tensor: torch.Tensor, handle: Any) -> None:
        from mpi4py import MPI

        handle.Allreduce(MPI.IN_PLACE, tensor.numpy(), op=MPI.SUM)

    def side_allgather(self, tensor: torch.Tensor, handle: Any, members: int) -> list[torch.Tensor]:
        out = torch.empty((members * len(tensor), *tensor.shape[1:]), dtype=tensor.dtype)
        handle.Allgather(tensor.numpy(), out.numpy())
        return list(out.chunk(members))

    def side_alltoall(self, tensor: torch.Tensor, handle: Any, members: int) -> list[torch.Tensor]:
        out = torch.empty_like(tensor)
        handle.Alltoall(tensor.numpy(), out.numpy())
        return list(out.chunk(members))


class TorchEngine:
    name = "torch"

    def __init__(self, comm: Any, node_of: tuple[int, ...] | None = None) -> None:
        """`node_of`: the node of every rank of `comm` (None: found over `comm`)."""
        self.dist = dist
        start_default_process_group(comm, node_of)

    def takes(self, device: torch.device, gpus_shared: bool) -> bool:
        if device.type == "cpu":
            return True
        return device.type == "cuda" and self.dist.is_nccl_available() and not gpus_shared

    def why_staged(self) -> str:
        return "this torch has no NCCL (torch.distributed.is_nccl_available() is false)"

    def world(self) -> Any:
        return None  # the default process group

    def group(self, ranks: tuple[int, ...]) -> Any:
        return self.dist.new_group(list(ranks))

    def start_allreduce(
        self,
        tensors: list[torch.Tensor],
        names: list[str],
        op: str,
        handle: Any,
        prescale: float = 1.0,
        postscale: float = 1.0,
        together: bool = False,
    ) -> Any:
        members = self.dist.get_world_size(handle)
        reduce_op = self.dist.ReduceOp.MAX if op == "max" else self.dist.ReduceOp.SUM
        after = postscale / members if op == "average" else postscale
        buckets = []  # one flat buffer per dtype and device: one collective each
        for key, indices in _by_dtype_and_device(tensors).items():
            flat = torch.cat([tensors[i].reshape(-1) for i in indices])
            if prescale != 1.0:
                flat = flat * prescale
            work = self.dist.all_reduce(flat, op=reduce_op, group=handle, async_op=True)
            buckets.append((indices, flat, work))

        def results() -> list[torch.Tensor]:
            out: list[torch.Tensor | None] = [None] * len(tensors)
            for indices, flat, work in buckets:
                work.wait()
                if after != 1.0:  # (an average or a scale: floating tensors only)
                    flat = flat * after
                offset = 0
                for i in indices:
                    out[i] = flat[offset : offset + tensors[i].numel()].view_as(tensors[i])
                    offset += tensors[i].numel()
            return out

        return results

    def start_allgather(self, tensor: torch.Tensor, name: str, handle: Any, members: int) -> Any:
        """All members' tensors along dim 0; first dimensions may differ (each is padded to the
        largest, whose size travels first)."""
        mine = torch.tensor([tensor.shape[0]], dtype=torch.int64, device=tensor.device)
        counts = [torch.empty_like(mine) for _ in range(members)]
        self.dist.all_gather(counts, mine, group=handle)
        rows = [int(c) for c in counts]
        padded = tensor.new_zeros((max(rows), *tensor.shape[1:]))
        padded[: tensor.shape[0]] = tensor
        parts = [torch.empty_like(padded) for _ in range(members)]
        work = self.dist.all_gather(parts, padded, group=handle, async_op=True)

        def result() -> torch.Tensor:
            work.wait()
            return torch.cat([part[:n] for part, n in zip(parts, rows)])

        return result

    def finish(self, started: Callable[[], Any]) -> Any:
        return started()

    def broadcast_(self, tensor: torch.Tensor, root_rank: int, name: str, handle: Any) -> None:
        self.dist.broadcast(tensor, src=root_rank, group=handle)

    def side_group(self, ranks: tuple[int, ...], comm: Any) -> Any:
        """A process group of its own: collectives of two threads on one group would interleave."""
        return self.dist.new_group(list(ranks))

    def side_thread_problem(self) -> str | None:
        return None  # process groups take calls from any thread

    def side_allreduce_sum_(self, tensor: torch.Tensor, handle: Any) -> None:
        self.dist.all_reduce(tensor, group=handle)

    def side_allgather(self, tensor: torch.Tensor, handle: Any, members: int) -> list[torch.Tensor]:
        parts = [torch.empty_like(tensor) for _ in range(members)]
        self.dist.all_gather(parts, tensor, group=handle)
        return parts

    def side_alltoall(self, tensor: torch.Tensor, handle: Any, members: int) -> list[torch.Tensor]:
        out = torch.empty_like(tensor)
        self.dist.all_to_all_single(out, tensor, group=handle)
        return list(out.chunk(members))


def _by_dtype_and_device(tensors: list[torch.Tensor]) -> dict[tuple[torch.dtype, torch.device], list[int]]:
    groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.dtype, t.device), []).append(i)
    return groups


def horovod_importable() -> bool:
    try:
        import horovod.torch  # noqa: F401
    except ImportError:
        return False
    return True


def choose(requested: str, reduce_dtype: str = "float32") -> tuple[str, str]:
    """(engine, why) for `requested` ("auto": Horovod where it is installed and, on a machine
    with a GPU, built with NCCL; else torch, also for bfloat16 on the wire, which Horovod refuses)."""
    if requested not in ENGINES:
        raise ConfigError(f"comm.engine must be one of {', '.join(ENGINES)}, got {requested!r}")
    if reduce_dtype not in REDUCE_DTYPES:
        raise ConfigError(f"reduce_dtype must be one of {', '.join(REDUCE_DTYPES)}, got {reduce_dtype!r}")
    if requested == "horovod" and reduce_dtype == "bfloat16":
        raise ConfigError(
            "reduce_dtype bfloat16 needs the torch engine (Horovod refuses bfloat16 tensors): "
            "init(engine='torch') or --comm.engine torch, or reduce_dtype float32"
        )
    if requested != "auto":
        return requested, "as requested"
    if reduce_dtype == "bfloat16":
        return "torch", "auto: bfloat16 on the wire, which Horovod refuses"
    if not horovod_importable():
        return "torch", "auto: Horovod is not installed"
    import horovod.torch as hvd

    if torch.cuda.is_available() and not hvd.nccl_built():
        return "torch", "auto: this Horovod has no GPU operations (built without NCCL)"
    return "horovod", "auto: Horovod is installed"


def start_default_process_group(comm: Any, node_of: tuple[int, ...] | None = None) -> None:
    """torch.distributed's default process group over `comm`'s ranks (Gloo for CPU tensors,
    NCCL for CUDA ones), its rendezvous from MPI; nothing where one exists. Collective. On the
    Horovod engine too, so that a DDP user's DistributedSampler, dist.get_rank(), dist.barrier()
    and destroy_process_group() work unchanged (what goes through it directly is not metered)."""
    if dist.is_initialized():
        return
    rank, size = comm.Get_rank(), comm.Get_size()
    node_of = node_of or rendezvous.nodes_of(comm)
    host = rendezvous.agree(comm, len(set(node_of)) == 1, node_of[rank] == node_of[0])
    address = None
    if rank == 0:  # a free port, chosen by the store itself: nothing can take it meanwhile
        store = dist.TCPStore(host, 0, size, is_master=True, wait_for_workers=False)
        address = (host, store.port)
    address = comm.bcast(address, root=0)
    if rank != 0:
        store = dist.TCPStore(address[0], address[1], size, is_master=False)
    backend = "cpu:gloo,cuda:nccl" if dist.is_nccl_available() else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=size)
    atexit.register(_destroy_process_groups)


def _destroy_process_groups() -> None:
    """At exit, while Python still runs: Gloo's worker threads, left to the interpreter's
    teardown, may drop the last reference to a tensor after Python is gone and abort the
    process."""
    if dist.is_initialized():
        dist.destroy_process_group()
