"""The elastic launcher: one MPI job per DiLoCo group, and the coordinator beside them.

    python -m hvd_lowcomm.elastic --groups 4 --ranks-per-group 8 -- \\
        python -m hvd_lowcomm.train --config run.yaml --method diloco

It serves the coordinator's store (a torch.distributed TCPStore, advertised by IP address, on
the interface --interface names), starts every group as its own job (`mpirun -np N` on its
share of --hostfile's hosts, or with --launcher srun an `srun` step per group inside a Slurm
allocation), watches them, relaunches a group that failed (up to
--max-restarts times, after --backoff seconds), and ends with the training's exit status: 0
when the groups that ran to the end finished cleanly and at least --min-groups of them did.
A failure inside one group ends that group's job alone; the others go on without it.

SIGUSR1 or SIGTERM (a scheduler's warning) has every group checkpoint after the same next
round and end, so that `--resume auto` continues every group exactly (set the scheduler's
warning earlier than a round takes); a second one, or SIGINT, ends the groups now (SIGTERM,
SIGKILL after a grace).
"""

from __future__ import annotations

import argparse
import datetime
import os
import selectors
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from hvd_lowcomm.comm.devices import compute_threads
from hvd_lowcomm.comm.rendezvous import interfaces
from hvd_lowcomm.elastic import protocol
from hvd_lowcomm.elastic.coordinator import Coordinator

LAUNCHERS = ("mpirun", "srun", "none")
POLL_SECONDS = 0.02
END_GRACE_SECONDS = 5.0  # how long a group's job may take to end on SIGTERM before SIGKILL


@dataclass
class Slot:
    """One group's place in the run: its current process, launches and when it may relaunch."""

    index: int
    process: subprocess.Popen | None = None
    life: int = -1
    restarts: int = 0
    relaunch_at: float | None = None
    code: int | None = None  # the last launch's exit status


def group_command(args: argparse.Namespace, command: list[str], slot: int) -> list[str]:
    """How one group's job starts (with --hostfile, mpirun on the slot's own hosts)."""
    extra = shlex.split(args.launcher_args)
    n = str(args.ranks_per_group)
    if args.launcher == "mpirun":
        hosts = group_hosts(args.hostfile, args.groups, args.ranks_per_group, slot) if args.hostfile else []
        # Each job binds its ranks from the node's first core on: jobs sharing this machine (no
        # hostfile) would all pile onto the same cores, so they are left unbound unless the user binds them.
        binding = [] if hosts or "--bind-to" in extra else ["--bind-to", "none"]
        return ["mpirun", "-np", n, *binding, *hosts, *extra, *command]
    if args.launcher == "srun":
        return ["srun", "--exact", "--kill-on-bad-exit=1", "-n", n, *extra, *command]
    return command


def group_hosts(hostfile: str, groups: int, ranks: int, slot: int) -> list[str]:
    """mpirun's --host for `slot`: its equal share of the file's hosts (each named once per rank
    or once, as PBS_NODEFILE or a Slurm host list has them), in order."""
    names = list(dict.fromkeys(line.split()[0] for line in Path(hostfile).read_text().splitlines() if line.strip()))
    if len(names) % groups or ranks % (len(names) // groups):
        raise SystemExit(
            f"elastic: {len(names)} hosts in {hostfile} do not split into {groups} groups of {ranks} rank(s): "
            f"give a host count that is a multiple of --groups"
        )
    share = len(names) // groups
    mine = names[slot * share : (slot + 1) * share]
    return ["--host", ",".join(f"{host}:{ranks // share}" for host in mine)]


def address(interface: str) -> str:
    """The IP address groups reach the coordinator at: `interface`'s, else this host's first
    non-loopback one (a host name may resolve to a slow network: torchft#329)."""
    found = interfaces()
    if interface:
        if interface not in found:
            raise SystemExit(
                f"elastic: no interface {interface!r} with an IPv4 address here; there are {sorted(found)}"
            )
        return found[interface]
    return next((a for a in found.values() if not a.startswith("127.")), "127.0.0.1")


class Lifelines:
    """The launcher's end of the groups' lifelines (hvd_lowcomm.elastic.protocol): a listening
    socket, and each connection's "slot life" until it closes."""

    def __init__(self, host: str) -> None:
        self.server = socket.create_server((host, 0))
        self.server.setblocking(False)
        self.port = self.server.getsockname()[1]
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.server, selectors.EVENT_READ, None)

    def closed(self) -> list[tuple[int, int]]:
        """(slot, life) of every lifeline that closed since the last call (without waiting)."""
        ended = []
        for key, _ in self.selector.select(timeout=0):
            if key.data is None:
                line, _ = self.server.accept()
                line.setblocking(False)
                self.selector.register(line, selectors.EVENT_READ, bytearray())
                continue
            try:
                chunk = key.fileobj.recv(64)
            except OSError:
                chunk = b""
            if chunk:
                key.data.extend(chunk)
                continue
            self.selector.unregister(key.fileobj)
            key.fileobj.close()
            said = key.data.decode(errors="replace").split()
            if len(said) == 2 and all(part.isdigit() for part in said):
                ended.append((int(said[0]), int(said[1])))
        return ended


def run(args: argparse.Namespace, command: list[str]) -> int:
    host = args.address or address(args.interface)
    store = dist.TCPStore(
        host, args.port, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=args.timeout)
    )
    lifelines = Lifelines(host)
    coordinator = Coordinator(store, args.groups, args.timeout, startup=args.startup_timeout)
    slots = [Slot(i) for i in range(args.groups)]
    print(
        f"elastic: coordinator at {host}:{store.port}; {args.groups} groups of {args.ranks_per_group} "
        f"rank(s), timeout {args.timeout:g} s, up to {args.max_restarts} relaunches each",
        flush=True,
    )

    def launch(slot: Slot) -> None:
        slot.life += 1
        coordinator.launched(slot.index, slot.life)
        env = dict(os.environ)
        told = protocol.Launch(host, store.port, slot.index, slot.life, args.groups, args.timeout, lifelines.port)
        env.update(told.environment())
        if args.interface:
            env.setdefault("GLOO_SOCKET_IFNAME", args.interface)
        if args.launcher != "srun" and not args.hostfile:  # every group's ranks on this machine's cores
            ranks = args.groups * args.ranks_per_group
            env.setdefault(
                "OMP_NUM_THREADS", str(compute_threads(ranks, len(os.sched_getaffinity(0)), os.cpu_count() or 1))
            )
        slot.process = subprocess.Popen(group_command(args, command, slot.index), env=env, start_new_session=True)
        slot.relaunch_at = None

    def end_all() -> None:
        """End every group's job: SIGTERM (a rank takes it as a request to stop at a round, so
        it may not end), then SIGKILL after a grace."""
        running = [slot.process for slot in slots if slot.process is not None and slot.process.poll() is None]
        for process in running:
            os.killpg(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + END_GRACE_SECONDS
        for process in running:
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()

    def on_signal(signum: int, frame: object) -> None:
        if signum == signal.SIGINT or coordinator.preempting:  # Ctrl-C, or a second warning: end now
            end_all()
            raise SystemExit(128 + signum)
        print(
            f"elastic: {signal.Signals(signum).name}: every group checkpoints after the next round and ends",
            flush=True,
        )
        coordinator.preempt()

    for ending in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):  # a scheduler's warning: checkpoint and end
        signal.signal(ending, on_signal)
    for slot in slots:
        launch(slot)
    finished = 0
    try:
        while True:
            for slot_index, life in lifelines.closed():
                coordinator.lifeline_closed(slot_index, life)
            coordinator.poll()
            now = time.monotonic()
            for slot in slots:
                life = coordinator.state.get((slot.index, slot.life))
                if slot.process is not None and life is not None and life.ended.startswith("silent"):
                    os.killpg(slot.process.pid, signal.SIGKILL)  # a stalled node: end its job, maybe relaunch
                    slot.process.wait()
                if slot.process is not None and slot.process.poll() is not None:
                    slot.code, slot.process = slot.process.returncode, None
                    coordinator.exited(slot.index, slot.life, slot.code)
                    if slot.code == 0:
                        finished += 1
                    elif slot.restarts < args.max_restarts and not finished and not coordinator.stopped:
                        slot.restarts += 1
                        slot.relaunch_at = now + args.backoff
                        print(
                            f"elastic: group {slot.index} failed (code {slot.code}); relaunch "
                            f"{slot.restarts}/{args.max_restarts} in {args.backoff:g} s",
                            flush=True,
                        )
                    else:
                        print(f"elastic: group {slot.index} failed (code {slot.code}); not relaunched", flush=True)
                if slot.relaunch_at is not None and coordinator.stopped:
                    slot.relaunch_at = None  # the run is over (preempted, or too few groups)
                if slot.relaunch_at is not None and now >= slot.relaunch_at:
                    launch(slot)
            running = [s for s in slots if s.process is not None or s.relaunch_at is not None]
            if not running:
                break
            if not finished and len(running) < args.min_groups:
                coordinator.stop(f"fewer than --min-groups {args.min_groups} groups are left")
            time.sleep(POLL_SECONDS)
    finally:
        end_all()
        if args.record:
            coordinator.write(Path(args.record))
    failures = sum(e["event"] == "failure" for e in coordinator.events)
    print(f"elastic: {finished} of {args.groups} groups finished; {failures} failure(s)", flush=True)
    if finished >= args.min_groups:
        return 0
    return next((s.code for s in slots if s.code), 1)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    options, command = argv[:split], argv[split + 1 :]
    parser = argparse.ArgumentParser(
        prog="python -m hvd_lowcomm.elastic", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--groups", type=int, required=True, help="DiLoCo groups, one MPI job each")
    parser.add_argument("--ranks-per-group", type=int, default=1, help="ranks in each group's job (default: 1)")
    parser.add_argument(
        "--min-groups", type=int, default=1, help="end the run when fewer groups are left (default: %(default)s)"
    )
    parser.add_argument("--max-restarts", type=int, default=3, help="relaunches per group (default: %(default)s)")
    parser.add_argument("--backoff", type=float, default=5.0, help="seconds before a relaunch (default: %(default)s)")
    parser.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        help="seconds of silence (no heartbeat, no answer in an exchange) after which a group is out "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--startup-timeout",
        type=float,
        default=300.0,
        help="seconds a launch may take to its first heartbeat (default: %(default)s)",
    )
    parser.add_argument(
        "--launcher", choices=LAUNCHERS, default="mpirun", help="how each group starts (default: %(default)s)"
    )
    parser.add_argument(
        "--launcher-args", default="", help="more arguments for each group's mpirun/srun (--launcher-args='-N 1')"
    )
    parser.add_argument(
        "--hostfile", default="", help="mpirun: give each group its share of these hosts (e.g. $PBS_NODEFILE)"
    )
    parser.add_argument("--interface", default="", help="the network interface groups reach the coordinator on")
    parser.add_argument("--address", default="", help="the coordinator's IP address (default: --interface's)")
    parser.add_argument("--port", type=int, default=0, help="the coordinator's port (default: any free one)")
    parser.add_argument("--record", default="", help="write the membership history (JSON) here")
    args = parser.parse_args(options)  # --help answers here, with or without a command
    if not command:
        parser.error("give the training command after --, e.g. -- python -m hvd_lowcomm.train ...")
    if args.groups < 1 or args.ranks_per_group < 1 or not 1 <= args.min_groups <= args.groups:
        parser.error("need --groups >= 1, --ranks-per-group >= 1 and 1 <= --min-groups <= --groups")
    return run(args, command)
