"""Where a rank computes: the GPU bound to it (one per rank, or shared where allowed), the
device a run asks for, a clock that waits for the device's queued work, and the compute threads
a rank may use beside the other ranks of its node."""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from hvd_lowcomm.config import ConfigError


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


def bind_gpu(local_rank: int, local_size: int) -> None:
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


def compute_threads(local_ranks: int, cores_allowed: int, cores_on_node: int) -> int:
    """Threads for one rank's tensor arithmetic: the cores it may run on, but no more than its
    share of the node when it shares them with the node's other ranks. torch's default, a
    thread per core in every process, puts local_ranks x cores threads on the node's cores when
    mpirun does not bind ranks (it does not once they outnumber cores): the threads then wait
    for one another's time slices, which slows even a step without communication several
    times over. A rank bound to its own cores (srun --cpus-per-task, mpirun --map-by
    slot:PE=n) sees just those, and uses them all. Like torchrun, which sets one thread."""
    return max(1, min(cores_allowed, cores_on_node // max(local_ranks, 1)))
