"""The network of the cost model: `Link`, Hockney's α-β costs of the collectives on it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


from hvd_lowcomm.comm.traffic import wire_bytes
from hvd_lowcomm.config import ConfigError, rate_bits


# Message latency (α) in µs by the network's kind: InfiniBand's RDMA takes one or two, TCP over
# Ethernet tens (the operating system's network stack on both ends).
LATENCY_US = {"ib": 2.0, "eth": 30.0}
# A link named by its rate alone is InfiniBand from this rate (bits/s) up, Ethernet below it.
IB_FROM = 100e9


def link_kind(link: str) -> tuple[str, float]:
    """(kind, bits per second) of a link named 'RATE' (25gbit) or 'KIND:RATE' (ib:200gbit,
    eth:100gbit), the kind one of LATENCY_US's; a rate alone is of the kind IB_FROM says."""
    kind, _, rate = link.rpartition(":")
    bits = rate_bits(rate)
    kind = kind.strip().lower() or ("ib" if bits >= IB_FROM else "eth")
    if kind not in LATENCY_US:
        raise ConfigError(
            f"link {link!r}: name its kind {' or '.join(LATENCY_US)} before the rate "
            f"(ib:200gbit, eth:100gbit), or give the rate alone (25gbit)"
        )
    return kind, bits


@dataclass(frozen=True)
class Link:
    """The network between ranks."""

    bandwidth: float  # bytes per second, one direction, between nodes
    latency: float = 2e-6  # seconds per message (α)
    ranks_per_node: int = 1
    intra_bandwidth: float = 20e9  # bytes per second between ranks of one node
    shared: bool = False  # one medium for every rank's bytes (an emulated link)
    # The share of the backward pass that communication can hide behind: 1 when every rank has
    # a core (or a GPU) of its own, so a core is free to drive the network while it computes;
    # 0 when ranks outnumber cores (the emulated clusters on 2 cores: measured, none hides).
    overlap: float = 1.0

    @classmethod
    def parse(cls, link: str, latency_us: float | None = None, **kwargs: Any) -> "Link":
        """The network `link` names (link_kind), with its kind's latency unless `latency_us` is given."""
        kind, bits = link_kind(link)
        return cls(bits / 8, (LATENCY_US[kind] if latency_us is None else latency_us) * 1e-6, **kwargs)

    def describe(self) -> str:
        text = f"{self.bandwidth * 8 / 1e9:.3g} Gbit/s, {self.latency * 1e6:.3g} µs"
        if self.ranks_per_node > 1:
            text += f", {self.ranks_per_node} ranks per node"
        return text + (", shared medium" if self.shared else "")

    def beta(self, group: int, spans_nodes: bool | None = None) -> float:
        """The bandwidth a ring over `group` ranks runs at: the network's once it leaves a node
        (by default: when the group is larger than a node; `spans_nodes` says so for a group of
        ranks picked across nodes, such as one rank per node)."""
        spans = group > self.ranks_per_node if spans_nodes is None else spans_nodes
        if not spans:
            return self.intra_bandwidth
        if spans_nodes is True:
            # One rank per node: every rank of a node runs its own such ring at the same time
            # (DiLoCo's columns), so the node's ranks share its link.
            return self.bandwidth / self.ranks_per_node
        # A ring over several nodes also passes between the ranks inside each node, so the
        # slower of the two links sets its pace.
        return min(self.bandwidth, self.intra_bandwidth)

    def node_share(self, group: int, spans_nodes: bool | None = None) -> float:
        """Bytes a node sends to other nodes per byte one rank sends in a ring over `group` ranks
        (arguments as `beta`'s): none inside a node; one rank's in a ring that leaves each node
        once; every rank's for rings of one rank per node run by all of a node's ranks at once."""
        spans = group > self.ranks_per_node if spans_nodes is None else spans_nodes
        if group <= 1 or not spans:
            return 0.0
        return float(self.ranks_per_node) if spans_nodes is True else 1.0

    def _time(self, messages: float, bytes_per_rank: float, group: int, ranks: int, spans_nodes: bool | None) -> float:
        if group <= 1:
            return 0.0
        if self.shared:  # every rank's bytes cross the one medium
            return messages * self.latency + ranks * bytes_per_rank / self.bandwidth
        return messages * self.latency + bytes_per_rank / self.beta(group, spans_nodes)

    def allreduce(self, nbytes: float, group: int, ranks: int, spans_nodes: bool | None = None) -> float:
        return self._time(2 * _log2(group), 2 * (group - 1) / group * nbytes, group, ranks, spans_nodes)

    def allgather(self, nbytes_per_rank: float, group: int, ranks: int, spans_nodes: bool | None = None) -> float:
        return self._time(_log2(group), (group - 1) * nbytes_per_rank, group, ranks, spans_nodes)

    def reduce_scatter(self, nbytes: float, group: int, ranks: int, spans_nodes: bool | None = None) -> float:
        """`nbytes`: each rank's whole input, of which it keeps the reduced 1/group."""
        return self._time(_log2(group), (group - 1) / group * nbytes, group, ranks, spans_nodes)

    def send(self, nbytes: float, ranks: int, across_nodes: bool = True) -> float:
        if self.shared:
            return self.latency + ranks * nbytes / self.bandwidth
        return self.latency + nbytes / (self.bandwidth if across_nodes else self.intra_bandwidth)


def _log2(group: int) -> int:
    return math.ceil(math.log2(group)) if group > 1 else 0


def sent_bytes(op: str, nbytes_per_rank: float, group: int) -> float:
    """Bytes one rank puts on the wire for `op` of `nbytes_per_rank` in a group of `group`
    ranks: the traffic meter's rule (an allgather's is counted on the gathered total)."""
    return wire_bytes(op, nbytes_per_rank * group if op == "allgather" else nbytes_per_rank, group)
