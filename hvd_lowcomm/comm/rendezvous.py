"""The torch engine's rendezvous from MPI: where rank 0's store listens and which network
interface each rank's Gloo connections use, agreed over MPI_COMM_WORLD, so that neither torchrun
nor MASTER_ADDR or GLOO_SOCKET_IFNAME is needed (where set, they are used).

- One node: the loopback (nothing leaves the node).
- Several nodes: rank 0 offers its IPv4 addresses (MASTER_ADDR alone, where set); every rank
  says which of them its routing table reaches (not counting one its own node also holds), and
  the first that every rank reaches is the store's. Each rank's Gloo (and NCCL bootstrap)
  interface is the one its route to that address leaves through: the kernel's own choice, read
  from a UDP socket's local address (no packet is sent).
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct
from typing import Any

from hvd_lowcomm.config import ConfigError

LOOPBACK = "127.0.0.1"
# The variables this process's rendezvous set (name -> value): a rank's own choice of interface,
# which a child job it launches must not inherit (its ranks may sit on other nodes).
SET_HERE: dict[str, str] = {}
SIOCGIFADDR = 0x8915  # Linux's ioctl for an interface's IPv4 address


def interfaces() -> dict[str, str]:
    """This host's interfaces that have an IPv4 address: name -> address."""
    found = {}
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            try:
                request = fcntl.ioctl(probe.fileno(), SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
            except OSError:  # up without an IPv4 address
                continue
        found[name] = socket.inet_ntoa(request[20:24])
    return found


def route_source(address: str) -> str | None:
    """The local address this host's route to `address` leaves from; None where none leads there."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((address, 1))
            return probe.getsockname()[0]
    except OSError:
        return None


def _set_default(name: str, value: str) -> None:
    """os.environ[name] = value where the user has not set it, noted in SET_HERE."""
    if name not in os.environ:
        os.environ[name] = SET_HERE[name] = value


def child_environment(environ: dict[str, str] | None = None) -> dict[str, str]:
    """`environ` (os.environ) without what this process's rendezvous set: for a job it launches."""
    env = dict(os.environ if environ is None else environ)
    for name, value in SET_HERE.items():
        if env.get(name) == value:
            del env[name]
    return env


def nodes_of(comm: Any) -> tuple[int, ...]:
    """The node of every rank of `comm` (index in order of first appearance of its host name);
    collective."""
    from mpi4py import MPI

    hosts = comm.allgather(MPI.Get_processor_name())
    return tuple(list(dict.fromkeys(hosts)).index(host) for host in hosts)


def agree(comm: Any, one_node: bool, beside_root: bool) -> str:
    """Rank 0's address for the store (collective over `comm`; `one_node`: all its ranks share
    a node, `beside_root`: this rank shares rank 0's); sets this rank's GLOO_SOCKET_IFNAME (and
    NCCL_SOCKET_IFNAME, for several nodes) where the user has not."""
    if one_node and "MASTER_ADDR" not in os.environ:
        _set_default("GLOO_SOCKET_IFNAME", _interface_of(LOOPBACK) or "lo")
        return LOOPBACK
    offered = None
    if comm.Get_rank() == 0:
        given = os.environ.get("MASTER_ADDR")
        offered = [given] if given else [a for a in interfaces().values() if not a.startswith("127.")]
    offered = comm.bcast(offered, root=0)
    # An address another node holds too (a container bridge's, say) leads there, not to rank 0.
    own = set(interfaces().values())
    reached = comm.allgather(
        [route_source(address) is not None and (beside_root or address not in own) for address in offered]
    )
    common = [address for i, address in enumerate(offered) if all(mine[i] for mine in reached)]
    if not common:
        raise ConfigError(
            f"the torch engine found no address of rank 0 ({', '.join(offered) or 'none'}) that every "
            f"rank can reach: set MASTER_ADDR to rank 0's address on the network between the nodes "
            f"(and GLOO_SOCKET_IFNAME to each node's interface on it), or use the horovod engine"
        )
    store = common[0]
    interface = _interface_of(route_source(store))
    if interface:
        _set_default("GLOO_SOCKET_IFNAME", interface)
        if not one_node:
            _set_default("NCCL_SOCKET_IFNAME", interface)
    return store


def _interface_of(address: str | None) -> str | None:
    return next((name for name, own in interfaces().items() if own == address), None)
