"""Emulated networks whose traffic is measured from outside the processes.

Two shapes, each made for one run in network namespaces this module creates:

* `ShapedLink`: one namespace whose loopback is rate-limited with a token-bucket filter
  (`tc qdisc ... tbf rate 1gbit`), Open MPI forced to TCP on it (no shared memory): every byte
  any rank sends crosses that one medium, as if each rank were a node on a shared network.
* `EmulatedCluster`: N nodes, each its own namespace and host name holding np/N ranks that
  share memory, joined through a switch (a bridge in a namespace of its own) by links shaped to
  a rate and latency. Traffic inside a node never touches the shaped links; Open MPI, Horovod
  and hvd_lowcomm see N nodes of np/N local ranks, as under Slurm.

The interfaces' own counters (/proc/net/dev inside a namespace) count the bytes: a measurement
independent of hvd_lowcomm's meter. Only interfaces and addresses inside these namespaces are
touched; the namespaces are deleted on exit, also when the run fails or is interrupted.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from itertools import count
from typing import Callable, Self, TextIO

from hvd_lowcomm.config import rate_bits  # noqa: F401 (tc's units; compare imports it from here)

MPIRUN = ["mpirun", "--allow-run-as-root", "--oversubscribe"]
# How long an interrupted job may take to end before it is killed (the trainer checkpoints on
# SIGTERM at its next step, which on 64 ranks sharing 2 cores can take tens of seconds).
STOP_GRACE_SECONDS = 60
# Open MPI over TCP on the namespace's loopback only: btl tcp,self excludes shared memory
# (vader), which would bypass the shaped interface.
MPI_OVER_LOOPBACK = [
    "--mca",
    "btl",
    "tcp,self",
    "--mca",
    "btl_tcp_if_include",
    "lo",
    "--mca",
    "oob_tcp_if_include",
    "lo",
]
# Ranks run at a lower priority than mpirun and the harness: on a machine whose cores the ranks
# fill, a line they print is then forwarded, and the counters read, at once rather than after the
# ranks' next time slices, which can be longer than a short run's whole training.
RANKS_BELOW_OBSERVER = ["nice", "-n", "10"]
_names = count()


class LinkUnavailable(RuntimeError):
    """Shaping needs root and iproute2 (ip, tc)."""


def check_available() -> None:
    if os.geteuid() != 0:
        raise LinkUnavailable("--link needs root (network namespaces and tc); run as root or drop --link")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise LinkUnavailable(f"--link needs iproute2 ({', '.join(missing)} not found): apt-get install iproute2")


class _EmulatedNetwork:
    """Namespaces made on entering and always deleted on leaving, also when making them failed."""

    def __enter__(self) -> Self:
        try:
            self._create()
        except BaseException:
            self._delete()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._delete()

    def _create(self) -> None:
        raise NotImplementedError

    def _delete(self) -> None:
        raise NotImplementedError


class ShapedLink(_EmulatedNetwork):
    """`with ShapedLink("1gbit") as link:` run `link.mpirun(np_) + command`; `link.node_bytes()` counts."""

    def __init__(self, rate: str) -> None:
        check_available()
        self.rate = rate
        self.rate_bits = rate_bits(rate)
        self.name = f"hvdlc-{os.getpid()}-{next(_names)}"
        self.prefix = ["ip", "netns", "exec", self.name]

    def _create(self) -> None:
        _run(["ip", "netns", "add", self.name])
        _run([*self.prefix, "ip", "link", "set", "lo", "up"])
        _shape(self.name, "lo", self.rate)

    def mpirun(self, np_: int) -> list[str]:
        """The mpirun command (without the program) that runs np_ ranks on the shaped loopback."""
        return [*self.prefix, *MPIRUN, *MPI_OVER_LOOPBACK, "-np", str(np_), *RANKS_BELOW_OBSERVER]

    def node_bytes(self) -> list[int]:
        """Bytes sent through the namespace's loopback so far (each byte is counted once), as the
        one entry of a list (an EmulatedCluster has one per node)."""
        return [_interface_bytes(self.name, "lo")]

    def _delete(self) -> None:
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)


# Emulated nodes: addresses live only inside the namespaces this module creates, so one fixed
# subnet serves every cluster (each namespace has its own network stack).
CLUSTER_SUBNET = "10.77.0.0/24"
LAUNCHER_ADDRESS = "10.77.0.254"
# Jumbo frames, as on HPC Ethernet: at the default 1500 bytes, Ethernet/IP/TCP headers alone add
# about 4.6 % to the bytes the outside counters see, which would hide what the meter predicts.
CLUSTER_MTU = 9000
# Open MPI on the emulated cluster: shared memory (vader) inside a node, TCP on the cluster's
# subnet between nodes; every node's daemon started by the launcher itself (no tree spawn, whose
# second hop would run the agent inside a node's namespace). Allreduce and allgatherv are pinned to
# the ring algorithm, the one hvd_lowcomm's meter and cost model count (a ring leaves each node
# once per node); left to choose, Open MPI's recursive halving sends less between 2 nodes of 2.
MPI_ON_CLUSTER = [
    "--mca",
    "btl",
    "tcp,self,vader",
    "--mca",
    "btl_tcp_if_include",
    CLUSTER_SUBNET,
    "--mca",
    "oob_tcp_if_include",
    CLUSTER_SUBNET,
    "--mca",
    "plm_rsh_no_tree_spawn",
    "1",
    "--mca",
    "coll_tuned_use_dynamic_rules",
    "1",
    "--mca",
    "coll_tuned_allreduce_algorithm",
    "4",
    "--mca",
    "coll_tuned_allgatherv_algorithm",
    "3",
    # The emulated nodes share this machine's few cores, but each claims np/N slots, so
    # Open MPI would busy-poll while waiting and starve the ranks that have work.
    "--mca",
    "mpi_yield_when_idle",
    "1",
]
# Open MPI's launcher calls `AGENT HOST COMMAND...` where it would call ssh; this agent enters the
# host's namespace instead, with a host name of its own (Open MPI tells nodes apart by host name,
# and shared-memory segments of two "nodes" with one name would collide).
AGENT = """#!/bin/sh
# Written by hvd_lowcomm's benchmarks/netns.py: Open MPI's launch agent for an emulated cluster.
host=$1; shift
case "$host" in
{cases}
  *) echo "emulated cluster: no node named $host" >&2; exit 1;;
esac
exec ip netns exec "$ns" unshare --uts sh -c "hostname $host && $*"
"""


class EmulatedCluster(_EmulatedNetwork):
    """`nodes` emulated nodes joined by links of `rate` (and one-way `latency`, tc units such as
    100us or 1ms) through a switch; `with EmulatedCluster(2, "1gbit") as cluster:` run
    `cluster.mpirun(np_) + command`; `cluster.node_bytes()` counts what crossed each node's link.

    Each node is a network namespace with one interface (eth0) into a bridge in a namespace of
    its own; mpirun runs in one more namespace on the bridge and starts a node's ranks through
    AGENT. Ranks of one node share memory, so only traffic between nodes crosses the shaped
    interfaces: each node's eth0 limits what it sends, the switch's port to it what it receives
    (full duplex, as a NIC), and latency is added where a node sends.
    """

    def __init__(self, nodes: int, rate: str, latency: str | None = None) -> None:
        check_available()
        if nodes < 1 or nodes > 250:
            raise ValueError(f"an emulated cluster has 1 to 250 nodes, got {nodes}")
        self.nodes, self.rate, self.latency = nodes, rate, latency
        self.rate_bits = rate_bits(rate)
        self.tag = f"hvdlc-{os.getpid()}-c{next(_names)}"
        self.switch = f"{self.tag}-sw"
        self.launcher = f"{self.tag}-mpirun"
        self.hosts = [f"node{i}" for i in range(nodes)]
        self.node_namespaces = [f"{self.tag}-{host}" for host in self.hosts]
        self._directory = tempfile.mkdtemp(prefix=f"{self.tag}-")
        self.agent = os.path.join(self._directory, "agent.sh")

    def mpirun(self, np_: int) -> list[str]:
        """The mpirun command (without the program) that places np_ ranks, np_/nodes per node,
        as block placement on a real cluster does: contiguous ranks share a node."""
        if np_ % self.nodes:
            raise ValueError(f"{np_} ranks do not fill {self.nodes} nodes evenly: use a multiple of {self.nodes}")
        per_node = np_ // self.nodes
        return [
            "ip",
            "netns",
            "exec",
            self.launcher,
            *MPIRUN,
            "--mca",
            "plm_rsh_agent",
            self.agent,
            *MPI_ON_CLUSTER,
            "--host",
            ",".join(f"{host}:{per_node}" for host in self.hosts),
            "--map-by",
            "slot",
            "-np",
            str(np_),
            *RANKS_BELOW_OBSERVER,
        ]

    def node_bytes(self) -> list[int]:
        """Bytes each node has sent to the others so far (its eth0 transmit counter)."""
        return [_interface_bytes(ns, "eth0") for ns in self.node_namespaces]

    def _create(self) -> None:
        with open(self.agent, "w") as fh:
            fh.write(
                AGENT.format(
                    cases="\n".join(f"  {host}) ns={ns};;" for host, ns in zip(self.hosts, self.node_namespaces))
                )
            )
        os.chmod(self.agent, 0o755)
        _run(["ip", "netns", "add", self.switch])
        _run(["ip", "-n", self.switch, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", self.switch, "link", "set", "br0", "up"])
        addresses = [f"10.77.0.{i + 1}" for i in range(self.nodes)] + [LAUNCHER_ADDRESS]
        for i, (ns, address) in enumerate(zip([*self.node_namespaces, self.launcher], addresses)):
            port = f"port{i}"
            _run(["ip", "netns", "add", ns])
            _run(
                [
                    "ip",
                    "-n",
                    self.switch,
                    "link",
                    "add",
                    port,
                    "mtu",
                    str(CLUSTER_MTU),
                    "type",
                    "veth",
                    "peer",
                    "name",
                    "eth0",
                    "mtu",
                    str(CLUSTER_MTU),
                    "netns",
                    ns,
                ]
            )
            _run(["ip", "-n", self.switch, "link", "set", port, "master", "br0", "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{address}/24", "dev", "eth0"])
            _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
            if ns != self.launcher:  # the launcher's own link is not part of the network under test
                _shape(ns, "eth0", self.rate, self.latency)
                _shape(self.switch, port, self.rate)

    def _delete(self) -> None:
        for ns in [*self.node_namespaces, self.launcher, self.switch]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        shutil.rmtree(self._directory, ignore_errors=True)


def run_reading_counters(
    command: list[str],
    net: "_EmulatedNetwork | None",
    marks: dict[str, Callable[[str], bool]],
    env: dict[str, str] | None = None,
    log: TextIO | None = None,
) -> tuple[int, list[str], dict[str, tuple[float, list[int]]]]:
    """Run `command` (stdout and stderr merged) and, whenever an output line satisfies
    marks[name], read `net`'s counters with the time under that name (a later line replaces an
    earlier one): counts between moments the program announces. Returns the exit status, the
    output lines and the readings. `env`: the command's environment (default: this process's).
    `log`: each line is also written there as it comes (a long launch can be followed, and an
    interrupted one keeps what it printed)."""
    lines: list[str] = []
    readings: dict[str, tuple[float, list[int]]] = {}
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) as proc:
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                lines.append(line)
                if log is not None:
                    log.write(line)
                    log.flush()
                for name, matches in marks.items():
                    if net is not None and matches(line):
                        readings[name] = (time.monotonic(), net.node_bytes())
        except BaseException:  # interrupted (SIGTERM, Ctrl-C): the job must not outlive its caller
            _stop(proc)
            raise
    return proc.returncode, lines, readings


def _stop(proc: subprocess.Popen) -> None:
    """End a job: SIGTERM (mpirun passes it to every rank), SIGKILL if it has not ended after
    STOP_GRACE_SECONDS."""
    proc.terminate()
    try:
        proc.wait(timeout=STOP_GRACE_SECONDS)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _shape(ns: str, device: str, rate: str, latency: str | None = None) -> None:
    """Limit what `device` in namespace `ns` sends to `rate` with a token bucket (burst: a few
    full-size packets; its latency bounds the queue), after a one-way `latency` (netem) if given."""
    tc = ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", device]
    parent = ["root"]
    if latency:  # netem delays every packet; the token bucket below it sets the rate
        proc = subprocess.run(
            [*tc, "root", "handle", "1:", "netem", "delay", latency, "limit", "100000"], capture_output=True, text=True
        )
        if proc.returncode != 0:
            raise LinkUnavailable(
                f"cannot add {latency} of latency: {proc.stderr.strip()} (latency needs the "
                "kernel's netem qdisc, sch_netem; give the link without a latency)"
            )
        parent = ["parent", "1:1"]
    _run([*tc, *parent, "handle", "10:", "tbf", "rate", rate, "burst", "256kb", "latency", "100ms"])


def _interface_bytes(ns: str, device: str) -> int:
    """Transmit bytes of `device` inside namespace `ns` (/proc/net/dev, read from outside the ranks)."""
    out = _run(["ip", "netns", "exec", ns, "cat", "/proc/net/dev"])
    for line in out.splitlines():
        name, _, fields = line.partition(":")
        if name.strip() == device:
            return int(fields.split()[8])
    raise RuntimeError(f"no counters for {device} in namespace {ns}")


def _run(command: list[str]) -> str:
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed: {proc.stderr.strip()}")
    return proc.stdout
