"""The traffic meter: the one door every collective and message of the framework goes through.

Each call is performed (the engine's collective, hvd_lowcomm.comm.engines, or mpi4py's
control, object and point-to-point messages) and recorded with
  step, tensor name, op, group (process set) label, payload bytes, wire bytes, phase,
where *payload* is what this rank contributes (after compression) and *wire* is what this rank
puts on the network by the standard ring algorithms for a group of p ranks:

    allreduce   2 (p-1)/p * M        M = this rank's tensor bytes
    allgather   (p-1)/p * T          T = bytes of the gathered result ((p-1) M for equal parts)
    reduce_scatter (p-1)/p * M       M = this rank's whole input (FSDP's gradients)
    alltoall    (p-1)/p * M          M = this rank's whole send buffer (a 1/p part stays home)
    broadcast   M                    (pipelined chain: each rank forwards the tensor once)
    send        M,  recv 0           point-to-point
    (p = 1: nothing crosses the network)

Of that, the part that leaves the rank's node is counted apart (`between_nodes_bytes`): in a
ring a rank sends only to its successor, so its bytes cross nodes when the successor lives on
another node (one rank per node in each ring over several nodes), a point-to-point message
when its destination does, and an alltoall's parts for members on other nodes. That is what a
cluster's network carries; the rest stays in a node.

The meter keeps the records of the current step (for per-step logs and tests) and running
totals per (phase, op, group) and per tensor name, so its memory does not grow with the run.
Phases separate what a method needs to train ("train") from evaluation, set-up and
bookkeeping, so comparisons can quote training traffic alone.

Tensors travel in a dtype the collectives take: bfloat16, which Horovod refuses, goes as
float32 (the reduction in float32, as torchtitan's default reduce dtype) and comes back in the
caller's dtype, unless init's reduce_dtype asks for bfloat16 on the torch engine; the meter
counts the bytes sent.

Horovod and mpi4py are imported inside the functions that use them: importing mpi4py's MPI
module initialises MPI, and the command line reports a bad config before MPI starts.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import pickle
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from hvd_lowcomm.comm import runtime
from hvd_lowcomm.comm.runtime import Group

# Bytes of one number as the methods send them (fp32), for the cost model and byte counts.
FLOAT_BYTES = 4

# train: what the method needs to learn; eval: test-set evaluation; setup: initial broadcasts;
# control: bookkeeping (summaries). Comparisons between methods quote "train".
PHASES = ("train", "eval", "setup", "control")


def wire_bytes(op: str, payload_bytes: float, group_size: int) -> float:
    """Bytes one rank puts on the wire for `op` in a ring over `group_size` ranks."""
    p = group_size
    if p <= 1 or op in ("recv", "barrier"):
        return 0.0
    if op == "allreduce":
        return 2.0 * (p - 1) / p * payload_bytes
    if op in ("allgather", "alltoall", "reduce_scatter"):  # allgather: payload_bytes is the gathered total here
        return (p - 1) / p * payload_bytes
    if op in ("broadcast", "send"):
        return float(payload_bytes)
    raise ValueError(f"unknown op {op!r}")


@dataclass(frozen=True)
class Record:
    step: int
    name: str
    op: str
    group: str
    group_size: int
    payload_bytes: int
    wire_bytes: float
    phase: str
    between_nodes_bytes: float = 0.0  # the part of wire_bytes sent to another node


@dataclass
class Totals:
    calls: int = 0
    payload_bytes: int = 0
    wire_bytes: float = 0.0
    between_nodes_bytes: float = 0.0  # default: checkpoints written before nodes were counted

    def add(self, record: Record) -> None:
        self.calls += 1
        self.payload_bytes += record.payload_bytes
        self.wire_bytes += record.wire_bytes
        self.between_nodes_bytes += record.between_nodes_bytes


# A user's own loop may never close steps (next_step); the records of the open step are then
# bounded, while the totals keep counting.
STEP_RECORDS_KEPT = 100_000


class TrafficMeter:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.step = 0
        self.phase = "train"
        self.step_records: collections.deque[Record] = collections.deque(maxlen=STEP_RECORDS_KEPT)
        self.by_kind: dict[tuple[str, str, str], Totals] = defaultdict(Totals)  # (phase, op, group)
        self.by_name: dict[str, Totals] = defaultdict(Totals)
        # Seconds spent blocked in metered communication, per phase (the exchange share of a
        # step: what is not hidden behind computation).
        self.seconds: dict[str, float] = defaultdict(float)

    # -- bookkeeping ----------------------------------------------------------------------
    def record(
        self,
        op: str,
        name: str,
        payload_bytes: int,
        group: Group | None,
        wire: float | None = None,
        dest: int | None = None,
    ) -> Record:
        """Record one call; `dest` is the global rank a point-to-point message goes to."""
        label, size = (group.label if group is not None else "world"), _members(group)
        wire = wire_bytes(op, payload_bytes, size) if wire is None else float(wire)
        rec = Record(
            self.step,
            name,
            op,
            label,
            size,
            int(payload_bytes),
            wire,
            self.phase,
            wire * _share_leaving_node(op, group, dest) if wire else 0.0,
        )
        self.step_records.append(rec)
        self.by_kind[(rec.phase, rec.op, rec.group)].add(rec)
        self.by_name[rec.name].add(rec)
        return rec

    def next_step(self) -> None:
        """Close the current training step (call after the optimiser step)."""
        self.step += 1
        self.step_records.clear()

    def state_dict(self) -> dict[str, Any]:
        """Step count and totals, for checkpoints (the current step's records are not kept)."""
        return {
            "step": self.step,
            "by_kind": {k: dataclasses.asdict(t) for k, t in self.by_kind.items()},
            "by_name": {k: dataclasses.asdict(t) for k, t in self.by_name.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = state["step"]
        self.step_records.clear()
        self.by_kind = defaultdict(Totals, {k: Totals(**t) for k, t in state["by_kind"].items()})
        self.by_name = defaultdict(Totals, {k: Totals(**t) for k, t in state["by_name"].items()})

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Count the time inside as communication of the current phase."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[self.phase] += time.perf_counter() - start

    @contextlib.contextmanager
    def in_phase(self, phase: str) -> Iterator[None]:
        previous, self.phase = self.phase, phase
        try:
            yield
        finally:
            self.phase = previous

    def total(
        self, phase: str | None = "train", group: str | None = None, op: str | None = None, field: str = "wire_bytes"
    ) -> float:
        """Sum of `field` over records matching phase/group/op (None matches all)."""
        return sum(
            getattr(t, field)
            for (ph, o, g), t in self.by_kind.items()
            if (phase is None or ph == phase) and (group is None or g == group) and (op is None or o == op)
        )

    def total_on(self, groups: tuple[str, ...], phases: tuple[str, ...] = ("train",)) -> float:
        """Wire bytes in `phases` on the process sets whose label starts with one of `groups`
        ("group" matches group0, group1, ...): a grouped method's intra- or inter-group traffic."""
        return sum(
            t.wire_bytes
            for (phase, _, group), t in self.by_kind.items()
            if phase in phases and group.startswith(groups)
        )

    def step_total(self, field: str = "wire_bytes") -> float:
        return sum(getattr(r, field) for r in self.step_records)

    def summary(self) -> dict[str, Any]:
        """Flat totals for metrics files: bytes per phase, and per op/group for training."""
        out: dict[str, Any] = {}
        for phase in sorted(set(PHASES) | {ph for ph, _, _ in self.by_kind}):
            out[f"{phase}_payload_bytes"] = self.total(phase, field="payload_bytes")
            out[f"{phase}_wire_bytes"] = self.total(phase)
            out[f"{phase}_between_nodes_wire_bytes"] = self.total(phase, field="between_nodes_bytes")
        for (phase, op, group), t in sorted(self.by_kind.items()):
            if phase == "train":
                out[f"train_{op}_{group}_wire_bytes"] = t.wire_bytes
        return out

    # -- metered collectives (the engine's: hvd_lowcomm.comm.engines) ---------------------------
    def allreduce(
        self, tensor: torch.Tensor, name: str, group: Group | None = None, average: bool = True, compression: Any = None
    ) -> torch.Tensor:
        """Allreduce (mean by default) within `group`; returns a new tensor. `compression`: a
        Horovod-style compressor (compress -> (tensor, ctx), decompress)."""
        compression = compression or NoCompression
        sent, ctx = compression.compress(tensor)
        self.record("allreduce", name, _nbytes(sent), group)
        op = "average" if average and tensor.is_floating_point() else "sum"
        engine = _engine(group)
        with self.waiting():
            out = engine.finish(engine.start_allreduce([to_wire(sent)], [name], op, _handle(group)))
        return compression.decompress(from_wire(out[0], sent), ctx)

    def allgather(self, tensor: torch.Tensor, name: str, group: Group | None = None) -> torch.Tensor:
        """Concatenate every member's tensor along dim 0 (first dims may differ)."""
        return self.allgather_many([(name, tensor)], group)[0]

    def allgather_many(self, named: list[tuple[str, torch.Tensor]], group: Group | None = None) -> list[torch.Tensor]:
        """Several allgathers submitted together, so the engine can fuse them."""
        return self.gather_and_reduce(named, [], group)[0]

    def allreduce_many(
        self, named: list[tuple[str, torch.Tensor]], group: Group | None = None, op: str = "sum"
    ) -> list[torch.Tensor]:
        """Several allreduces (op: sum, average or max) submitted together for fusion."""
        return self.gather_and_reduce([], named, group, op)[1]

    def gather_and_reduce(
        self,
        gathered: list[tuple[str, torch.Tensor]],
        reduced: list[tuple[str, torch.Tensor]],
        group: Group | None = None,
        op: str = "sum",
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Allgathers and allreduces (op: sum, average or max) submitted together before any is
        waited for: Horovod negotiates them in one cycle, where an allgather call followed by an
        allreduce call takes two, and every cycle is a round of coordination among all ranks
        before any data moves (for a small model, as long as its whole exchange); the torch
        engine sends the allreduces as one flat buffer."""
        size = _members(group)
        if size == 1:  # nothing to combine; skips an engine round (ms) per call
            outs = [tensor.clone() for _, tensor in gathered], [tensor.clone() for _, tensor in reduced]
        else:
            engine, handle = _engine(group), _handle(group)
            with self.waiting():
                gathering = [engine.start_allgather(to_wire(tensor), name, handle, size) for name, tensor in gathered]
                reducing = (
                    engine.start_allreduce([to_wire(t) for _, t in reduced], [n for n, _ in reduced], op, handle)
                    if reduced
                    else None
                )
                outs = (
                    [from_wire(engine.finish(h), t) for h, (_, t) in zip(gathering, gathered)],
                    [from_wire(out, t) for out, (_, t) in zip(engine.finish(reducing), reduced)] if reduced else [],
                )
        for (name, tensor), out in zip(gathered, outs[0]):
            self.record(
                "allgather",
                name,
                _nbytes(tensor),
                group,
                wire=wire_bytes("allgather", _nbytes(out), size) if size > 1 else 0.0,
            )
        for name, tensor in reduced:
            self.record("allreduce", name, _nbytes(tensor), group)
        return outs

    def start_allreduce(
        self,
        named: list[tuple[str, torch.Tensor]],
        group: Group | None = None,
        op: str = "average",
        prescale: float = 1.0,
        postscale: float = 1.0,
    ) -> Any:
        """Start one grouped allreduce (op: average or sum, each tensor scaled by `prescale`
        before and `postscale` after) without waiting: a handle for `finish_allreduce`."""
        if _members(group) == 1:  # nothing to combine or send (as Horovod, which skips it): the scaled tensors
            return [tensor * (prescale * postscale) for _, tensor in named]
        for name, tensor in named:
            self.record("allreduce", name, _nbytes(tensor), group)
        engine = _engine(group)
        started = engine.start_allreduce(
            [to_wire(tensor) for _, tensor in named],
            [n for n, _ in named],
            op,
            _handle(group),
            prescale,
            postscale,
            together=True,
        )
        return engine, started, [tensor for _, tensor in named]

    def finish_allreduce(self, handle: Any) -> list[torch.Tensor]:
        """Wait for an allreduce `start_allreduce` started; its results, on their tensors' devices."""
        with self.waiting():
            if isinstance(handle, list):
                return handle
            engine, started, tensors = handle
            return [from_wire(out, like) for out, like in zip(engine.finish(started), tensors)]

    def broadcast_(self, tensor: torch.Tensor, root_rank: int, name: str, group: Group | None = None) -> torch.Tensor:
        """In-place broadcast from global rank `root_rank` to the members of `group`."""
        self.record("broadcast", name, _nbytes(tensor), group)
        wire = to_wire(tensor)
        with self.waiting():
            _engine(group).broadcast_(wire, root_rank, name, _handle(group))
        if wire is not tensor:
            tensor.copy_(wire)
        return tensor

    def broadcast_tensors(
        self,
        tensors: dict[str, torch.Tensor] | Sequence[tuple[str, torch.Tensor]],
        root_rank: int,
        group: Group | None = None,
    ) -> None:
        """In-place broadcast of named tensors from global rank `root_rank` within `group`
        (Horovod's own broadcast_parameters works only on the global process set)."""
        items = tensors.items() if isinstance(tensors, dict) else tensors
        for name, tensor in items:
            self.broadcast_(tensor, root_rank, name=f"broadcast.{name}", group=group)

    def allreduce_object_sum(self, values: list[float], name: str, group: Group | None = None) -> list[float]:
        """Sum a few scalars (counts, losses) over `group` in float64."""
        summed = self.allreduce(torch.tensor(values, dtype=torch.float64), name, group, average=False)
        return summed.tolist()

    # -- small picklable objects (control messages: errors, paths, state dicts) -----------------
    def gather_object(self, obj: Any, name: str, root: int = 0) -> list[Any] | None:
        """Gather a picklable object from every rank to `root` (None elsewhere); each non-root
        rank's pickled size is recorded as sent."""
        from mpi4py import MPI

        size = _pickled_size(obj) if MPI.COMM_WORLD.Get_rank() != root else 0
        self.record("send", name, size, None, wire=size, dest=root)
        return MPI.COMM_WORLD.gather(obj, root=root)

    def allgather_object(self, obj: Any, name: str) -> list[Any]:
        from mpi4py import MPI

        out = MPI.COMM_WORLD.allgather(obj)
        self.record(
            "allgather",
            name,
            _pickled_size(obj),
            None,
            wire=wire_bytes("allgather", sum(map(_pickled_size, out)), len(out)),
        )
        return out

    def allreduce_ints(self, values: list[int], name: str, group: Group | None = None, op: str = "sum") -> list[int]:
        """Sum or max of a few integers over `group` (default: all ranks): one small MPI allreduce
        of int64 that skips Horovod's negotiation cycle, so cheap enough for per-step control
        messages."""
        from mpi4py import MPI

        local = np.array(values, dtype=np.int64)
        out = np.empty_like(local)
        with self.waiting():
            (MPI.COMM_WORLD if group is None else group.comm).Allreduce(
                local, out, op={"sum": MPI.SUM, "max": MPI.MAX}[op]
            )
        self.record("allreduce", name, local.nbytes, group)
        return [int(v) for v in out]

    def any_flags(self, flags: list[bool], name: str, group: Group | None = None) -> list[bool]:
        """For each flag, whether it is set on any rank of `group` (default: all ranks)."""
        return [bool(v) for v in self.allreduce_ints([int(f) for f in flags], name, group, op="max")]

    def barrier(self, name: str, group: Group | None = None) -> None:
        """Wait for every rank of `group` (default: all); recorded as a call with no payload."""
        from mpi4py import MPI

        with self.waiting():
            (MPI.COMM_WORLD if group is None else group.comm).Barrier()
        self.record("barrier", name, 0, group)

    def broadcast_object(self, obj: Any, name: str, root: int = 0) -> Any:
        from mpi4py import MPI

        out = MPI.COMM_WORLD.bcast(obj, root=root)
        self.record("broadcast", name, _pickled_size(out), None)
        return out

    # -- metered point-to-point (mpi4py) -------------------------------------------------------
    def send(self, tensor: torch.Tensor, dest: int, name: str, tag: int = 0) -> None:
        """Blocking send of a tensor (through host memory) to global rank `dest` over MPI_COMM_WORLD."""
        from mpi4py import MPI

        array = _mpi_buffer(tensor.detach().to("cpu", wire_dtype(tensor.dtype)).contiguous())
        self.record("send", name, array.nbytes, None, wire=array.nbytes, dest=dest)
        with self.waiting():
            MPI.COMM_WORLD.Send(array, dest=dest, tag=tag)

    def recv(self, out: torch.Tensor, source: int, name: str, tag: int = 0) -> torch.Tensor:
        """Blocking receive into `out` (through host memory when it is on a device) from global
        rank `source`."""
        from mpi4py import MPI

        on_wire = wire_dtype(out.dtype)
        host = (
            out
            if out.device.type == "cpu" and on_wire == out.dtype
            else torch.empty(out.shape, dtype=on_wire, pin_memory=_pinned(out))
        )
        array = _mpi_buffer(host)
        with self.waiting():
            MPI.COMM_WORLD.Recv(array, source=source, tag=tag)
        if host is not out:
            out.copy_(host)
        self.record("recv", name, array.nbytes, None, wire=0)
        return out


# -- a group's side channel (Group.side): blocking collectives a worker thread may run beside the
# training thread's; not recorded here, as their caller knows their bytes before they are sent


def side_allreduce_sum_(tensor: torch.Tensor, group: Group) -> torch.Tensor:
    """In-place sum of a CPU tensor over `group`'s side channel."""
    if group.size > 1:
        _engine(group).side_allreduce_sum_(tensor, _side(group))
    return tensor


def side_allgather(tensor: torch.Tensor, group: Group) -> list[torch.Tensor]:
    """Every member's CPU tensor (all of one shape), in member order."""
    return _engine(group).side_allgather(tensor, _side(group), group.size) if group.size > 1 else [tensor]


def side_alltoall(tensor: torch.Tensor, group: Group) -> list[torch.Tensor]:
    """Member j's chunk j of every member's CPU tensor (cut into `group.size` equal chunks)."""
    return _engine(group).side_alltoall(tensor, _side(group), group.size) if group.size > 1 else [tensor]


def side_thread_problem() -> str | None:
    """Why a worker thread cannot run side-channel collectives on this engine (None: it can)."""
    return runtime.engine().side_thread_problem()


def _side(group: Group) -> Any:
    if group.side is None:
        raise RuntimeError(f"{group.label} was split without a side channel (runtime.split(..., side=True))")
    return group.side


def wire_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a tensor of `dtype` travels in: bfloat16 as init's reduce_dtype (float32 unless
    bfloat16 was asked for on the torch engine; Horovod refuses bfloat16)."""
    return runtime.bf16_wire_dtype() if dtype == torch.bfloat16 else dtype


def _mpi_buffer(tensor: torch.Tensor) -> np.ndarray:
    """A contiguous CPU tensor as numpy for mpi4py (bfloat16, which numpy lacks, as its 16 bits)."""
    return (tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor).numpy()


def to_wire(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` as Horovod's collectives take it: itself where they read its device (the CPU; a
    GPU when Horovod was built with GPU operations and no two local ranks share one) and its
    dtype, else a copy in host memory (pinned for a GPU, so the copy runs at full speed) and in
    `wire_dtype`, which the caller's result goes back from (`from_wire`). The one place where
    device tensors are staged; the meter counts the collective once, whatever path it takes."""
    dtype = wire_dtype(tensor.dtype)
    if collectives_take(tensor.device):
        return tensor if dtype == tensor.dtype else tensor.to(dtype)
    if _pinned(tensor):
        return torch.empty(tensor.shape, dtype=dtype, pin_memory=True).copy_(tensor)
    return tensor.to("cpu", dtype)


def from_wire(out: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A collective's result `out` on the device and in the dtype of the tensor `like` it was
    sent from (a float32 sum of bfloat16 tensors is rounded once, here)."""
    return out.to(like.device, like.dtype, non_blocking=like.device.type == "cuda")


def collectives_take(device: torch.device) -> bool:
    """Whether the engine's collectives read tensors on `device` themselves."""
    takes = runtime.engine().takes(device, runtime.ranks_share_a_gpu())
    if not takes and device.type == "cuda" and not _warned_staging:
        _warn_staging()
    return takes


_warned_staging = False


def _warn_staging() -> None:
    global _warned_staging
    _warned_staging = True
    why = (
        "ranks of this node share a GPU, which NCCL refuses"
        if runtime.ranks_share_a_gpu()
        else runtime.engine().why_staged()
    )
    runtime.announce(
        f"hvd_lowcomm: warning: GPU tensors go through host memory for every collective (correct, slower): {why}"
    )


def _pinned(tensor: torch.Tensor) -> bool:
    """Whether host copies of `tensor` should be page-locked (a CUDA tensor's)."""
    return tensor.device.type == "cuda"


def _share_leaving_node(op: str, group: Group | None, dest: int | None) -> float:
    """The part of a call's wire bytes that goes to other nodes (all of it between MPI jobs)."""
    if group is not None and group.peers is not None:
        return 1.0
    if runtime.node_count() == 1:
        return 0.0
    ranks = group.ranks if group is not None else runtime.world().ranks
    me = runtime.rank()
    if op == "alltoall":  # an equal part to every other member
        others = [r for r in ranks if r != me]
        return sum(runtime.node_of(r) != runtime.node_of(me) for r in others) / max(len(others), 1)
    return float(runtime.leaves_node(ranks, me, dest))


def _pickled_size(obj: Any) -> int:
    return len(pickle.dumps(obj))


def _members(group: Group | None) -> int:
    return group.size if group is not None else _world_size()


def _nbytes(tensor: torch.Tensor) -> int:
    """Bytes of `tensor` on the wire (in `wire_dtype`)."""
    return tensor.numel() * wire_dtype(tensor.dtype).itemsize


def _engine(group: Group | None) -> Any:
    """What runs `group`'s collectives: the job's engine, or a group of peers' own."""
    return group.peers if group is not None and group.peers is not None else runtime.engine()


def position_in(group: Group) -> int:
    """This process's position among `group`'s members."""
    return group.peers.rank if group.peers is not None else group.rank_of(runtime.rank())


def _handle(group: Group | None) -> Any:
    """The engine's handle for `group`'s ranks (None: all ranks)."""
    return runtime.world().process_set if group is None else group.process_set


def _world_size() -> int:
    return runtime.size() if runtime.initialized() else 1


class NoCompression:
    """Horovod's Compression.none, for either engine: the tensor as it is."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, None]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: None) -> torch.Tensor:
        return tensor


class FP16Compression:
    """Horovod's Compression.fp16, for either engine: floating tensors in float16 on the wire,
    back in their own dtype."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:
        return (tensor.half() if tensor.is_floating_point() else tensor), tensor.dtype

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: torch.dtype) -> torch.Tensor:
        return tensor.to(ctx) if tensor.dtype != ctx else tensor


# The process-wide meter: methods, the training loop and tests all read and write this one.
meter = TrafficMeter()
