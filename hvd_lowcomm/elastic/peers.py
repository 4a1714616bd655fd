"""Collectives between processes of different MPI jobs: a Gloo process group built directly on
the coordinator's store for one membership (torchft's pattern: `dist.new_group` needs every rank
of one world and cannot be rebuilt after a failure), and the engine interface the traffic meter
calls, so that every DiLoCo exchange form runs over it unchanged."""

from __future__ import annotations

import datetime
from typing import Any, Callable

import torch
import torch.distributed as dist

from hvd_lowcomm.comm.groups import Group


def peer_group(store: Any, prefix: str, rank: int, size: int, timeout: float, label: str = "column") -> Group:
    """A group of `size` peers whose members call this with the same `prefix` (fresh for every
    membership: the store's keys of an old one would mix with it); returns once all have
    connected, raises after `timeout` seconds when one does not."""
    pg = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, size, datetime.timedelta(seconds=timeout))
    engine = PeerEngine(pg, rank, size)
    return Group(label, 0, tuple(range(size)), process_set=pg, comm=None, side=pg, peers=engine)


class PeerEngine:
    """The traffic meter's engine interface (hvd_lowcomm.comm.engines) over one process group
    of peers; `root_rank`s are positions among them. Every call blocks (or its result does) at
    most the group's timeout: a peer that died raises, it never hangs."""

    name = "peers"

    def __init__(self, pg: Any, rank: int, size: int) -> None:
        self.pg, self.rank, self.size = pg, rank, size

    def start_allreduce(
        self,
        tensors: list[torch.Tensor],
        names: list[str],
        op: str,
        handle: Any,
        prescale: float = 1.0,
        postscale: float = 1.0,
        together: bool = False,
    ) -> Callable[[], list[torch.Tensor]]:
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM
        after = postscale / self.size if op == "average" else postscale
        flats = [t.reshape(-1).clone() * prescale if prescale != 1.0 else t.reshape(-1).clone() for t in tensors]
        works = [self.pg.allreduce([flat], options) for flat in flats]

        def results() -> list[torch.Tensor]:
            for work in works:
                work.wait()
            return [(f * after if after != 1.0 else f).view_as(t) for f, t in zip(flats, tensors)]

        return results

    def start_allgather(self, tensor: torch.Tensor, name: str, handle: Any, members: int) -> Callable[[], Any]:
        """All members' tensors along dim 0 (first dimensions may differ)."""
        counts = self.side_allgather(torch.tensor([tensor.shape[0]], dtype=torch.int64), handle, members)
        rows = [int(c) for c in counts]
        padded = tensor.new_zeros((max(rows), *tensor.shape[1:]))
        padded[: tensor.shape[0]] = tensor
        parts = self.side_allgather(padded, handle, members)
        return lambda: torch.cat([part[:n] for part, n in zip(parts, rows)])

    def finish(self, started: Callable[[], Any]) -> Any:
        return started()

    def broadcast_(self, tensor: torch.Tensor, root_rank: int, name: str, handle: Any) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = root_rank
        self.pg.broadcast([tensor], options).wait()

    def side_thread_problem(self) -> str | None:
        return None

    def side_allreduce_sum_(self, tensor: torch.Tensor, handle: Any) -> None:
        self.pg.allreduce([tensor]).wait()

    def side_allgather(self, tensor: torch.Tensor, handle: Any, members: int) -> list[torch.Tensor]:
        parts = [torch.empty_like(tensor) for _ in range(members)]
        self.pg.allgather([parts], [tensor.contiguous()]).wait()
        return parts

    def side_alltoall(self, tensor: torch.Tensor, handle: Any, members: int) -> list[torch.Tensor]:
        out = torch.empty_like(tensor)
        self.pg.alltoall_base(out, tensor.contiguous(), [], [], dist.AllToAllOptions()).wait()
        return list(out.chunk(members))
